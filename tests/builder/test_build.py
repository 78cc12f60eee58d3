"""Real CPU builds: the tiny gpt-oss stand-in of the gpt-oss-120b config (the MXFP4 release layout,
copied as is; TP2 x EP2 shards for the torch runtime), interrupted with SIGKILL mid-stage and
re-run, its output loaded and served by our runtime, its size estimates checked against what it
wrote; and the CPU default (embedded SmolLM2) served by `dflash-trt serve` from the built directory."""
from __future__ import annotations

import filecmp
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
import yaml

from dflash_trt.builder.builder import BuildOptions, build
from dflash_trt.engine import EngineConfig, SamplingParams

CONFIGS = Path(__file__).resolve().parents[2] / "build_configs"
TINY = CONFIGS / "tiny-gpt-oss_cpu_tp2_mxfp4.yaml"
DFLASH = [sys.executable, "-m", "dflash_trt.cli"]


def _greedy(target, drafter, prompt: list[int], spec: bool, n: int = 12) -> list[int]:
    from dflash_trt.speculative.decoder import DFlashEngine

    engine = DFlashEngine(target, drafter if spec else None, EngineConfig(max_batch_size=1, max_seq_len=128, speculative=spec))
    return engine.generate([prompt], SamplingParams(max_new_tokens=n, ignore_eos=True))[0].tokens


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, object, Path]:
    """Start the shipped stand-in config's build in a subprocess (it writes `@tiny-gpt-oss` into
    its cache dir first), SIGKILL it while it sleeps inside the shard stage, check no output
    directory exists, then re-run it (in process): finished stages are skipped.
    Returns (output dir, report, stand-in root)."""
    root = tmp_path_factory.mktemp("tiny_gpt_oss")
    out, cache = root / "out", root / "out.build-cache"
    proc = subprocess.Popen([*DFLASH, "build", str(TINY), "--output", str(out), "--no-progress",
                             "--cache-dir", str(root / "cache"), "--test-stage-delay", "shard=120"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 240
    while not list(cache.glob("shard.tmp-*/rank1.safetensors")) and not list(cache.glob("shard.tmp-*/config.json")):
        assert proc.poll() is None, proc.communicate()[1].decode()[-2000:]
        assert time.monotonic() < deadline, "the build never reached the shard stage"
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert not out.exists(), "an interrupted build left its output directory"
    assert [p.name for p in out.parent.glob(".out.tmp-*")] == []
    assert len(list(cache.glob("target-*/.done.json"))) == 1  # finished before the kill
    tiny = root / "cache" / "tiny-gpt-oss-mxfp4"
    report = build(TINY, BuildOptions(output=out, progress=False, tiny_gpt_oss=tiny))
    return out, report, tiny


def test_interrupted_build_reruns_and_skips_finished_stages(built):
    out, report, _ = built
    status = {r.name: r.status for r in report.results}
    assert status["target"] == "skipped" and status["drafter"] == "skipped"
    assert status["shard"] == "run" and status["triton"] == "run" and status["manifest"] == "run"
    assert out.is_dir() and not list(out.parent.glob("out.build-cache/*.tmp-*"))
    table = report.summary()
    assert "skipped" in table and "shard" in table and "seconds" in table


def test_output_keeps_the_mxfp4_release_and_says_what_each_group_became(built):
    """target/ is the release layout byte for byte (MXFP4 experts, BF16 elsewhere, no ModelOpt
    config); manifest.json records per tensor group the source and written formats, the estimate
    and the bytes written."""
    from dflash_trt.config import DrafterConfig
    from dflash_trt.serve.config import parse_llm_api_config

    out, _, tiny = built
    for rel in ("target/config.json", "target/model.safetensors", "drafter/config.json",
                "shards/target/rank0.safetensors", "shards/target/rank1.safetensors", "llm_api_options.yaml",
                "launch/mpirun.sh", "triton/tiny/config.pbtxt", "triton/tiny/1/model.yaml", "manifest.json"):
        assert (out / rel).is_file(), rel
    assert not (out / "target" / "hf_quant_config.json").exists()
    assert filecmp.cmp(out / "target" / "model.safetensors", tiny / "target" / "model.safetensors", shallow=False)
    assert json.loads((out / "target" / "config.json").read_text())["quantization_config"]["quant_method"] == "mxfp4"
    assert sorted(p.name for p in (out / "launch").iterdir()) == ["mpirun.sh"]  # CPU TP2: no Slurm, no container
    drafter = DrafterConfig.load(tiny / "drafter")
    manifest = json.loads((out / "manifest.json").read_text())
    taps = manifest["dflash"]["hidden_state_taps"]
    assert taps["target_layer_ids"] == list(drafter.target_layer_ids) and taps["backend"] == "torch"
    assert manifest["config"]["parallel"]["tp"] == 2 and manifest["config"]["target"]["quantization"] == "mxfp4"
    assert len(manifest["sources"]["target"]["sha256"]) == 64
    assert [s["name"] for s in manifest["stages"]][:4] == ["validate", "target", "drafter", "shard"]
    groups = {g["group"]: g for g in manifest["tensor_groups"]["target"]["groups"]}
    assert groups["experts"]["source"] == "MXFP4 + BF16" and groups["experts"]["output"] == "MXFP4 + BF16 (copied)"
    assert groups["attention"]["output"] == "BF16 (copied)"
    for g in groups.values():  # the estimate is exact per group when the source is on disk
        assert g["est_bytes"] == g["written_bytes"], g
    opts = yaml.safe_load((out / "llm_api_options.yaml").read_text())
    assert opts["speculative_config"] == {
        "decoding_type": "DFlash", "max_draft_len": 7, "speculative_model": str(out / "drafter"),
        "mask_token_id": 4, "target_layer_ids": list(drafter.target_layer_ids)}
    parse_llm_api_config(opts)  # the serve command accepts what the builder writes
    mapping = json.loads((out / "shards/target/config.json").read_text())["mapping"]
    assert mapping["tp_size"] == 2 and mapping["moe_ep_size"] == 2


def test_shards_split_the_mxfp4_experts_without_changing_a_byte(built):
    """The TP2 x EP2 shards hold the source's MXFP4 blocks and scales, split by expert: merged back
    they equal the release tensors bit for bit."""
    from safetensors.torch import load_file

    from dflash_trt.checkpoint.mapping import Dims, merge_shards
    from dflash_trt.checkpoint.sharding import read_mapping
    from dflash_trt.models.target import load_hf_config

    out, _, tiny = built
    source = load_file(tiny / "target" / "model.safetensors")
    mapping = read_mapping(out / "shards" / "target")
    dims = Dims.of(load_hf_config(tiny / "target"))
    ranks = [load_file(out / "shards" / "target" / f"rank{r}.safetensors") for r in range(2)]
    assert ranks[0]["model.layers.0.mlp.experts.gate_up_proj_blocks"].shape[0] == 4  # 8 experts / EP 2
    for name, tensor in source.items():
        merged = merge_shards(name, [r[name] for r in ranks], tuple(tensor.shape), dims, mapping)
        assert merged.dtype == tensor.dtype and torch.equal(merged, tensor), name


def test_estimates_match_what_the_build_wrote(built, tmp_path):
    """Dry-run estimates against the real output: exact tensor bytes and within 5% in all when the
    sources are on disk (issue 17); within 15% from the build config alone, the way the
    gpt-oss-120b plan is made without its weights (issue 15)."""
    from dflash_trt.builder.builder import prepare
    from dflash_trt.builder.config import load_build_config
    from dflash_trt.builder.plan import make_plan
    from dflash_trt.builder.sizes import dir_bytes
    from dflash_trt.builder.sources import Sources

    out, _, tiny = built
    real = {"target": dir_bytes(out / "target"), "drafter": dir_bytes(out / "drafter"),
            "shard": dir_bytes(out / "shards" / "target")}
    plan = prepare(TINY, BuildOptions(output=tmp_path / "o", dry_run=True, tiny_gpt_oss=tiny))
    for stage, size in real.items():
        assert abs(plan.stage(stage).est_bytes - size) <= 0.05 * size, (stage, plan.stage(stage).est_bytes, size)
    absent = Sources(tiny / "target", tiny / "drafter", False, False, None, None)
    blind = make_plan(load_build_config(TINY), tmp_path / "o", absent)
    for stage in ("target", "drafter", "shard"):
        assert abs(blind.stage(stage).est_bytes - real[stage]) <= 0.15 * real[stage], stage


def test_built_directory_generates_losslessly(built):
    """The copied MXFP4 target (dequantized on load) and the drafter from the output load in our
    runtime; DFlash greedy output equals the target's own autoregressive greedy output, and
    `dflash-trt serve` on the built directory answers with it."""
    from dflash_trt.models.drafter import DFlashDrafter
    from dflash_trt.models.target import load_native_target

    out, _, _ = built
    target = load_native_target(out / "target", torch.float32)
    drafter = DFlashDrafter.from_pretrained(out / "drafter", torch.float32)
    prompt = [3, 120, 77, 9, 200, 41]
    reference = _greedy(target, drafter, prompt, spec=False)
    assert _greedy(target, drafter, prompt, spec=True) == reference
    # one rank: the TP keys go (the TP2 launch is launch/mpirun.sh; tests/runtime/test_tp.py runs TP)
    opts = yaml.safe_load((out / "llm_api_options.yaml").read_text())
    for key in ("tensor_parallel_size", "moe_expert_parallel_size", "moe_tensor_parallel_size"):
        opts.pop(key, None)
    one_rank = out.parent / "one_rank_options.yaml"
    one_rank.write_text(yaml.safe_dump(opts))
    port = _free_port()
    server = subprocess.Popen([*DFLASH, "serve", str(out / "target"), "--config", str(one_rank),
                               "--port", str(port), "--log-level", "warning"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        _wait_healthy(server, port)
        # a build's target/ is served under the build's name (not its path) without --served-model-name
        name = json.loads((out / "manifest.json").read_text())["name"]
        assert [m["id"] for m in httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()["data"]] == [name]
        body = {"model": name, "prompt": prompt, "max_tokens": 12, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True}
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=120).json()
        assert reply["choices"][0]["token_ids"] == reference, reply
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=30)


def test_editing_a_build_leaves_its_sources_and_its_cache_alone(built, tmp_path):
    """Build outputs are copies (or reflinks) of their sources, never hard links: appending to the
    built target and drafter changes neither source file. A re-run notices that the cached stage
    behind the edited file changed and rebuilds it."""
    out, _, tiny = built
    edits = {out / "target" / "tokenizer_config.json": tiny / "target" / "tokenizer_config.json",
             out / "drafter" / "config.json": tiny / "drafter" / "config.json"}
    before = {src: src.read_bytes() for src in edits.values()}
    for built_file, src in edits.items():
        assert built_file.stat().st_ino != src.stat().st_ino
        with open(built_file, "a") as fh:
            fh.write("\n")
    assert {src: src.read_bytes() for src in edits.values()} == before
    report = build(TINY, BuildOptions(output=out, progress=False, force=True, tiny_gpt_oss=tiny))
    status = {r.name: r.status for r in report.results}
    assert status["target"] == "run" and status["drafter"] == "run" and status["shard"] == "skipped"
    for built_file, src in edits.items():
        assert built_file.read_bytes() == src.read_bytes()


def _tiny_b300_config(path: Path, drafter_dir: Path) -> tuple[Path, dict]:
    """The gpt-oss-120b DGX B300 build config over the tiny gpt-oss stand-in (TP2 x EP2) and `drafter_dir`."""
    raw = yaml.safe_load((CONFIGS / "gpt-oss-120b_dgx-b300_tp8_mxfp4.yaml").read_text())
    raw["target"] = yaml.safe_load(TINY.read_text())["target"]
    raw["drafter"] = {"path": str(drafter_dir), "num_hidden_layers": 1, "quantization": "none"}
    raw["parallel"] = {"tp": 2, "ep": 2, "pp": 1, "ranks": 2, "gpus_per_node": 8, "nodes": 1}
    raw.update(max_seq_len=1024, max_draft_len=9, max_num_tokens=1024)
    path.write_text(yaml.safe_dump(raw))
    return path, raw


def test_trtllm_gpt_oss_build_ships_the_release_and_a_bf16_drafter(built, tmp_path):
    """The gpt-oss-120b B300 config with the stand-in's sizes, built for real (a TensorRT-LLM build
    needs no GPU to write its files): target/ is the MXFP4 release byte for byte with no ModelOpt
    config, an FP32 drafter is written BF16, launch/ holds the TRT-LLM launchers and the DGX B300
    single-node Slurm jobs, and the plan made from the config alone is within 15% of every stage."""
    from safetensors import safe_open

    from dflash_trt.builder.config import load_build_config
    from dflash_trt.builder.plan import make_plan
    from dflash_trt.builder.sizes import dir_bytes
    from dflash_trt.builder.sources import Sources
    from dflash_trt.models.target import load_hf_config
    from dflash_trt.models.tiny import build_tiny_drafter

    _, _, tiny = built
    drafter = build_tiny_drafter(load_hf_config(tiny / "target"), num_layers=1, block_size=10, mask_token_id=4)
    drafter_dir = drafter.save_pretrained(tmp_path / "drafter-fp32")
    cfg, raw = _tiny_b300_config(tmp_path / "gpt-oss-tiny-b300.yaml", drafter_dir)
    out = tmp_path / "out"
    build(cfg, BuildOptions(output=out, progress=False, tiny_gpt_oss=tiny))
    assert filecmp.cmp(out / "target" / "model.safetensors", tiny / "target" / "model.safetensors", shallow=False)
    assert not (out / "target" / "hf_quant_config.json").exists()
    with safe_open(str(out / "drafter" / "model.safetensors"), "pt") as fh:
        assert {fh.get_slice(k).get_dtype() for k in fh.keys()} == {"BF16"}
    assert json.loads((out / "drafter" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert sorted(p.name for p in (out / "launch").iterdir()) == [
        "common.sh", "dgx-b300_tp8_single_node.sh", "dgx-b300_triton.sh", "env.sh", "mpirun.sh", "serve.sh", "srun.sh",
        "triton_rank.sh"]
    env = (out / "launch" / "env.sh").read_text()  # the Slurm jobs' trtllm-serve --served_model_name
    assert f"export DFLASH_SERVED_MODEL_NAME={raw['name']}" in env, env
    (model_yaml,) = (out / "triton").glob("*/1/model.yaml")  # one node: one tritonserver, TensorRT-LLM spawns workers
    triton = yaml.safe_load(model_yaml.read_text())
    assert triton["mpi"] == "spawn" and triton["triton_config"] == {"max_batch_size": 0, "decoupled": False,
                                                                    "cancellation_check_period_ms": 100}
    assert triton["trtllm_llm_args"]["speculative_config"]["attention_backend"] == "TRTLLM"  # B300: SM103
    groups = json.loads((out / "manifest.json").read_text())["tensor_groups"]
    assert {g["group"]: g["output"] for g in groups["drafter"]["groups"]}["fc"] == "BF16 (cast from FP32)"
    absent = Sources(tiny / "target", drafter_dir, False, False, None, None)
    blind = make_plan(load_build_config(cfg), out, absent)
    for stage in ("target", "drafter"):
        real = dir_bytes(out / stage)
        assert abs(blind.stage(stage).est_bytes - real) <= 0.15 * real, (stage, blind.stage(stage).est_bytes, real)


def test_trtllm_build_refuses_an_already_quantized_drafter(built, tmp_path):
    """drafter.quantization none with an FP8 drafter source: the TensorRT-LLM drafter stage would
    cast the e4m3 codes to BF16 and keep their scales beside them, a drafter upstream multiplies
    unscaled (_torch/models/modeling_dflash.py). The build stops before any stage, in one line."""
    from dflash_trt.checkpoint.modelopt_hf import write_drafter
    from dflash_trt.errors import ConfigError
    from dflash_trt.models.target import load_hf_config
    from dflash_trt.models.tiny import build_tiny_drafter

    _, _, tiny = built
    drafter = build_tiny_drafter(load_hf_config(tiny / "target"), num_layers=1, block_size=10, mask_token_id=4)
    fp8 = write_drafter(drafter, tmp_path / "drafter-fp8", "FP8")
    cfg, _ = _tiny_b300_config(tmp_path / "fp8-drafter.yaml", fp8)
    out = tmp_path / "out"
    with pytest.raises(ConfigError, match="is quantized .* needs the BF16 \\(unquantized\\) drafter") as info:
        build(cfg, BuildOptions(output=out, progress=False, tiny_gpt_oss=tiny))
    assert "\n" not in str(info.value)
    assert not out.exists() and not (tmp_path / "out.build-cache").exists()


def test_quantized_dense_build_matches_its_estimates(tmp_path):
    """A torch-backend FP8 Qwen3 target with an FP8 drafter and TP2 legacy shards, built for real:
    every stage's dry-run estimate is within 5% of what it wrote, and the FP8 drafter is a torch
    feature (its ModelOpt directory loads in our runtime)."""
    from dflash_trt.builder.sizes import dir_bytes
    from dflash_trt.checkpoint.modelopt_hf import load_drafter
    from dflash_trt.models.tiny import save_tiny_checkpoint

    target, drafter = save_tiny_checkpoint(tmp_path / "m", "qwen3")
    raw = {"name": "tiny-qwen3-fp8", "backend": "torch", "gpu_arch": "cpu", "max_batch_size": 2,
           "max_seq_len": 128, "max_draft_len": 7, "calibration_samples": 2,
           "drafter": {"path": str(drafter), "quantization": "fp8"},
           "parallel": {"tp": 2, "ranks": 2, "gpus_per_node": 2},
           "target": {"path": str(target), "architecture": "qwen3", "num_hidden_layers": 6, "hidden_size": 64,
                      "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
                      "vocab_size": 261, "dtype": "float32", "quantization": "fp8"}}
    cfg = tmp_path / "qwen3-fp8.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    out = tmp_path / "out"
    plan = build(cfg, BuildOptions(output=out, progress=False)).plan
    for stage, folder in (("target", "target"), ("drafter", "drafter"), ("shard", "shards/target")):
        real = dir_bytes(out / folder)
        assert abs(plan.stage(stage).est_bytes - real) <= 0.05 * real, (stage, plan.stage(stage).est_bytes, real)
    assert load_drafter(out / "drafter").layers[0].self_attn.q_proj.weight.dtype == torch.float8_e4m3fn


def _wait_healthy(server: subprocess.Popen, port: int, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        assert server.poll() is None, server.communicate()[1].decode()[-3000:]
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "server did not become healthy"
        time.sleep(0.5)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cpu_default_build_is_served(tmp_path):
    """cpu-default.yaml (embedded SmolLM2; a random stand-in drafter when the shipped one is absent)
    builds, and `dflash-trt serve` on the output answers with the target's greedy continuation."""
    from dflash_trt.builder.sources import SHIPPED_DRAFTER
    from dflash_trt.models.smollm2 import default_cache_dir, ensure_default_target
    from dflash_trt.models.target import load_hf_config, load_native_target
    from dflash_trt.models.tiny import build_tiny_drafter

    try:
        smol = ensure_default_target(default_cache_dir(), progress=False)
    except Exception as exc:  # noqa: BLE001 - report why the embedded default is unavailable
        pytest.skip(f"embedded default target unavailable: {exc}")
    raw = yaml.safe_load((CONFIGS / "cpu-default.yaml").read_text())
    if not (SHIPPED_DRAFTER / "config.json").is_file():
        drafter = build_tiny_drafter(load_hf_config(smol), num_layers=1, block_size=16, mask_token_id=0)
        raw["drafter"]["path"] = str(drafter.save_pretrained(tmp_path / "standin-drafter"))
    cfg = tmp_path / "cpu.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    out = tmp_path / "cpu-out"
    report = build(cfg, BuildOptions(output=out, progress=False, default_target=smol))
    assert {r.name: r.status for r in report.results}["target"] == "run"
    assert (out / "target" / "model.safetensors").stat().st_ino != (smol / "model.safetensors").stat().st_ino
    assert sorted(p.name for p in (out / "launch").iterdir()) == ["serve.sh"]  # no Slurm, no TRT-LLM env.sh
    plan = report.plan  # estimates from the sources' headers: within 5% of what was written
    from dflash_trt.builder.sizes import dir_bytes

    for stage in ("target", "drafter"):
        real = dir_bytes(out / stage)
        assert abs(plan.stage(stage).est_bytes - real) <= 0.05 * real, (stage, plan.stage(stage).est_bytes, real)
    port = _free_port()
    # the build's own launch line (launch/serve.sh runs it), on a free port
    argv = shlex.split(json.loads((out / "manifest.json").read_text())["launch"]["commands"]["serve"])
    assert argv[:2] == ["dflash-trt", "serve"] and argv[argv.index("--served-model-name") + 1] == "cpu-default"
    argv[argv.index("--port") + 1] = str(port)
    server = subprocess.Popen([*DFLASH, *argv[1:], "--log-level", "warning"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        _wait_healthy(server, port)
        prompt = "The capital of France is"
        body = {"model": "cpu-default", "prompt": prompt, "max_tokens": 8, "temperature": 0}
        answer = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=120).json()
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=30)
    from dflash_trt.runtime.factory import load_tokenizer

    tok = load_tokenizer(smol)
    expected = _greedy(load_native_target(smol), None, tok.encode(prompt), spec=False, n=8)
    assert answer["choices"][0]["text"] == tok.decode(expected, skip_special_tokens=True)
