"""The `dflash-trt generate` contract (other checks depend on it) and clean failures."""
from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys

import pytest

from dflash_trt.models.tiny import save_tiny_checkpoint


def cli(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "dflash_trt.cli", *args], capture_output=True, text=True, timeout=300)
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}: {proc.stderr[-2000:]}")
    return proc


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    target, drafter = save_tiny_checkpoint(root, "qwen3", block_size=8, max_position_embeddings=512)
    other, _ = save_tiny_checkpoint(root / "other", "llama", hidden_size=32, max_position_embeddings=512)
    return target, drafter, other


def test_generate_json_contract(ckpt):
    target, drafter, _ = ckpt
    base = ["generate", "--target", str(target), "--drafter", str(drafter), "--max-seq-len", "256", "--json"]
    spec = json.loads(cli(*base, "--prompt", "hello there", "--max-new-tokens", "20", "--ignore-eos").stdout)
    assert set(spec) >= {"tokens", "text", "steps", "mean_acceptance_length", "tokens_per_s"}
    assert len(spec["tokens"]) == 20 and spec["block_size"] == 8
    assert all(0 <= s["accepted"] <= s["draft_tokens"] <= 7 for s in spec["steps"])
    assert 1.0 <= spec["mean_acceptance_length"] <= 8.0 and spec["tokens_per_s"] > 0
    ar = json.loads(cli(*base, "--prompt", "hello there", "--max-new-tokens", "20", "--ignore-eos", "--no-spec").stdout)
    assert ar["tokens"] == spec["tokens"] and ar["text"] == spec["text"]
    assert all(s == {"draft_tokens": 0, "accepted": 0} for s in ar["steps"])
    small = json.loads(cli(*base, "--prompt-ids", "3,80,81,82", "--max-new-tokens", "12", "--block-size", "4",
                           "--ignore-eos").stdout)
    ids_ar = json.loads(cli(*base, "--prompt-ids", "3,80,81,82", "--max-new-tokens", "12", "--no-spec",
                            "--ignore-eos").stdout)
    assert small["block_size"] == 4 and small["tokens"] == ids_ar["tokens"]


def test_draft_truncation_flags_keep_the_output(ckpt):
    target, drafter, _ = ckpt
    base = ["generate", "--target", str(target), "--drafter", str(drafter), "--max-seq-len", "256", "--json",
            "--prompt", "hello there", "--max-new-tokens", "16", "--ignore-eos"]
    full = json.loads(cli(*base, "--draft-confidence", "0").stdout)
    assert all(s["draft_tokens"] == 7 for s in full["steps"])  # 0: the whole block
    default = json.loads(cli(*base).stdout)  # on CPU: CPU_DRAFT_CONFIDENCE
    assert default["tokens"] == full["tokens"]
    assert any(s["draft_tokens"] < 7 for s in default["steps"])  # a random tiny drafter is rarely confident
    cut = json.loads(cli(*base, "--draft-confidence", "0.5", "--draft-len-schedule", "1:3,2:0").stdout)
    assert cut["tokens"] == full["tokens"]
    assert all(s["draft_tokens"] <= 3 for s in cut["steps"])
    assert any(s["draft_tokens"] < 3 for s in cut["steps"])  # a random tiny drafter is rarely confident
    bad = cli(*base, "--draft-len-schedule", "2:3", check=False)
    assert bad.returncode == 2 and "draft_len_schedule" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.parametrize("extra,message", [
    (["--prompt-ids", "1,x"], "comma-separated integers"),
    (["--prompt", ""], "empty"),
    (["--prompt-ids", "1,100000"], "outside the vocabulary"),
    (["--prompt-ids", "1,2", "--max-new-tokens", "5000"], "exceeds the context"),
    (["--prompt-ids", "1,2", "--temperature", "-1"], "temperature"),
])
def test_bad_input_exits_2_with_a_clear_message(ckpt, extra, message):
    target, drafter, _ = ckpt
    proc = cli("generate", "--target", str(target), "--drafter", str(drafter), "--max-seq-len", "256", *extra,
               check=False)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr


def test_missing_paths_and_mismatched_drafter(ckpt, tmp_path):
    target, drafter, other = ckpt
    proc = cli("generate", "--target", str(tmp_path / "none"), "--drafter", str(drafter), "--prompt-ids", "1", check=False)
    assert proc.returncode == 2 and "does not exist" in proc.stderr
    proc = cli("generate", "--target", str(other), "--drafter", str(drafter), "--prompt-ids", "1",
               "--max-seq-len", "256", check=False)
    assert proc.returncode == 2 and "hidden_size" in proc.stderr and "Traceback" not in proc.stderr


@pytest.fixture(scope="module")
def unloadable(ckpt, tmp_path_factory):
    """A target directory whose loading fails at once (its config.json is no model's), beside a real
    drafter: a flag error reported instead of the load error was found before any model load."""
    target = tmp_path_factory.mktemp("unloadable")
    (target / "config.json").write_text("{}")
    return target, ckpt[1]


@pytest.mark.parametrize("extra,message", [
    (["--block-size", "0"], "block_size must be in [1, 64]"),
    (["--block-size", "100"], "block_size must be in [1, 64]"),
    (["--block-size", "16"], "exceeds the block size 8 the drafter"),  # a block-8 drafter
    (["--max-new-tokens", "0"], "max_new_tokens"),
    (["--max-new-tokens", "-1"], "max_new_tokens"),
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "2"], "top_p"),
    (["--max-seq-len", "1"], "max_seq_len must be >= 2"),
    (["--tp", "0"], "--tp must be >= 1"),
    (["--chat"], "--chat wraps --prompt text"),  # with --prompt-ids it would do nothing
], ids=lambda x: " ".join(x) if isinstance(x, list) else None)
def test_generate_checks_its_flags_before_loading_a_model(unloadable, extra, message):
    target, drafter = unloadable
    proc = cli("generate", "--target", str(target), "--drafter", str(drafter), "--prompt-ids", "1,2", *extra,
               check=False)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


def test_empty_prompt_is_refused_before_loading_a_model(unloadable):
    target, drafter = unloadable
    proc = cli("generate", "--target", str(target), "--drafter", str(drafter), "--prompt", "", check=False)
    assert proc.returncode == 2 and "the prompt is empty" in proc.stderr, proc.stderr


@pytest.mark.parametrize("extra,message", [
    (["--port", "70000"], "port must be in [0, 65535]"),
    (["--max-queue", "-1"], "--max-queue must be >= 0"),
    (["--max-num-tokens", "0"], "--max-num-tokens must be >= 1"),
    (["--max-input-len", "0"], "max_input_len must be >= 1"),
    (["--block-size", "16"], "exceeds the block size 8 the drafter"),
    (["--max-batch-size", "0"], "max_batch_size must be >= 1"),
    (["--api-key", ""], "--api-key must not be empty"),
])
def test_serve_checks_its_flags_before_loading_a_model(unloadable, extra, message):
    target, drafter = unloadable
    proc = cli("serve", str(target), "--drafter", str(drafter), *extra, check=False)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("config,message", [
    ("max_batch_size: 0", "max_batch_size: Input should be greater than or equal to 1"),
    ("max_seq_len: 1", "max_seq_len: Input should be greater than or equal to 2"),
    ("max_num_tokens: 0", "max_num_tokens: Input should be greater than or equal to 1"),
    ("speculative_config: {decoding_type: DFlash, max_draft_len: 15}", "exceeds the block size 8 the drafter"),
    ("bogus_key: 1", "unknown key 'bogus_key'"),
], ids=lambda x: x.split(":")[0] if " " in x else None)
def test_serve_checks_its_config_file_before_loading_a_model(unloadable, tmp_path, config, message):
    target, drafter = unloadable
    path = tmp_path / "options.yaml"
    path.write_text(config + "\n")
    proc = cli("serve", str(target), "--drafter", str(drafter), "--config", str(path), check=False)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_serve_on_a_busy_port_says_so_before_loading(unloadable):
    target, drafter = unloadable
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = cli("serve", str(target), "--drafter", str(drafter), "--port", str(port), check=False)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"dflash-trt serve: error: port {port} on 127.0.0.1 is already in use (another server?): stop it or pick "
        "another --port"]


def test_target_paths_are_checked_first_and_precisely(ckpt, tmp_path):
    a_file = tmp_path / "weights.bin"
    a_file.write_text("not a checkpoint")
    proc = cli("generate", "--target", str(a_file), "--drafter", str(ckpt[1]), "--prompt-ids", "1", check=False)
    assert proc.returncode == 2 and f"target directory {a_file} is not a directory" in proc.stderr, proc.stderr
    proc = cli("generate", "--target", str(ckpt[0]), "--drafter", str(a_file), "--prompt-ids", "1", check=False)
    assert proc.returncode == 2 and f"drafter directory {a_file} is not a directory" in proc.stderr, proc.stderr
    # a missing target is reported before the missing --drafter
    proc = cli("generate", "--target", str(tmp_path / "nope"), "--prompt-ids", "1", check=False)
    assert proc.returncode == 2 and "nope does not exist" in proc.stderr and "--drafter" not in proc.stderr


def test_a_build_directory_given_as_the_target_says_which_folder_to_pass(tmp_path):
    """`dflash-trt serve DIR` on a build's output (its manifest.json names the build): one line naming
    DIR/target, DIR/drafter and DIR/launch/serve.sh, not '--drafter is required'."""
    from dflash_trt.builder.manifest import FORMAT, MANIFEST

    build = tmp_path / "b-cpu-default"
    build.mkdir()
    (build / MANIFEST).write_text(json.dumps({"format": FORMAT, "name": "cpu-default"}))
    for argv in (["serve", str(build)], ["generate", "--target", str(build), "--prompt-ids", "1"]):
        proc = cli(*argv, check=False)
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert f"{build} is the build directory of 'cpu-default'" in proc.stderr
        assert f"pass {build / 'target'} (with --drafter {build / 'drafter'})" in proc.stderr
        assert str(build / "launch" / "serve.sh") in proc.stderr


def test_max_seq_len_defaults_to_the_targets_context(ckpt):
    """The tiny target holds 512 positions: no --max-seq-len runs at 512; an explicit larger one is an error."""
    target, drafter, _ = ckpt
    base = ["generate", "--target", str(target), "--drafter", str(drafter), "--prompt-ids", "3,80,81"]
    out = json.loads(cli(*base, "--max-new-tokens", "509", "--ignore-eos", "--json").stdout)
    assert len(out["tokens"]) == 509 and out["finish_reason"] == "length"  # 3 + 509 = the whole context
    proc = cli(*base, "--max-seq-len", "1024", check=False)
    assert proc.returncode == 2 and "max_seq_len 1024 exceeds the target's context (512 positions)" in proc.stderr


def test_default_max_seq_len_is_capped_by_the_kv_budget():
    """A long-context target: the default is capped so the KV cache fits KV_CACHE_BUDGET_BYTES."""
    from dflash_trt.config import TargetInfo
    from dflash_trt.engine import KV_CACHE_BUDGET_BYTES, MAX_SEQ_LEN_STEP, EngineConfig

    info = TargetInfo("llama", 32, 4096, 128256, 131072, (2,), 8, 128)  # Llama-3.1-8B's geometry
    per_position = info.kv_bytes_per_position(2)
    assert per_position == 2 * 32 * 8 * 128 * 2
    config = EngineConfig(max_batch_size=8).for_models(info, None, 2)
    assert config.max_seq_len % MAX_SEQ_LEN_STEP == 0 and config.max_seq_len < 131072
    assert 8 * config.max_seq_len * per_position <= KV_CACHE_BUDGET_BYTES < 8 * (config.max_seq_len + MAX_SEQ_LEN_STEP) * per_position
    assert EngineConfig(max_seq_len=100_000).for_models(info, None, 2).max_seq_len == 100_000  # explicit: as given
    small = TargetInfo("llama", 2, 64, 256, 512, (2,), 2, 32)
    assert EngineConfig().for_models(small, None, 4).max_seq_len == 512  # the whole context fits


def test_block_size_above_the_drafters_is_an_error_in_every_command(ckpt, tmp_path):
    """The same rule everywhere (the drafter was trained for block 8): generate, bench, triton-repo,
    demo; serve in test_serve_checks_its_flags_before_loading_a_model and tests/serve/test_config.py."""
    target, drafter, _ = ckpt
    models = ["--target", str(target), "--drafter", str(drafter), "--block-size", "16"]
    runs = {"generate": cli("generate", *models, "--prompt-ids", "1", check=False),
            "bench": cli("bench", *models, "--output", str(tmp_path / "bench"), check=False),
            "triton-repo": cli("triton-repo", *models, "--output", str(tmp_path / "repo"), check=False),
            "demo": cli("demo", "--tiny", "--block-size", "16", check=False)}
    for command, proc in runs.items():
        assert proc.returncode == 2, (command, proc.stderr)
        assert "exceeds the block size 8 the drafter" in proc.stderr and "Traceback" not in proc.stderr, command


@pytest.mark.parametrize("extra,message", [
    (["--block-size", "16"], "exceeds the block size 8 the drafter"),  # the shipped drafter is block 8
    (["--block-size", "0"], "block_size must be in [1, 64]"),
    (["--draft-confidence", "1.5"], "draft_confidence must be in [0, 1)"),
    (["--ngram-lookup", "9"], "ngram_lookup must be in [0, 8]"),
    (["--tiny", "--drafter", "."], "--drafter does nothing with --tiny"),
], ids=lambda x: " ".join(x) if isinstance(x, list) else None)
def test_demo_checks_its_flags_before_loading_the_default(tmp_path, extra, message):
    """An empty --cache-dir stays empty: the embedded default was neither converted nor loaded."""
    cache = tmp_path / "cache"
    cache.mkdir()
    proc = cli("demo", "--cache-dir", str(cache), *extra, check=False)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and list(cache.iterdir()) == []


def test_help_lists_the_json_keys_and_every_default():
    from dflash_trt.cli import HelpFormatter, build_parser

    text = cli("generate", "--help").stdout
    assert "block_size" in text and "default: 128" in text and "default: 1.0" in text
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert set(commands) >= {"generate", "demo", "bench", "serve", "triton-repo", "triton-serve", "build", "train",
                             "quantize"}
    for name, sub in commands.items():
        shown = "".join(sub.format_help().split())  # argparse wraps long defaults at spaces and hyphens
        for action in sub._actions:
            if HelpFormatter._shows_default(action):
                assert "default:" + "".join(str(action.default).split()) in shown, (name, action.dest)


def test_import_needs_no_gpu_stack():
    code = ("import sys, dflash_trt, dflash_trt.cli, dflash_trt.speculative.decoder, dflash_trt.runtime.factory\n"
            "bad = [m for m in ('tensorrt', 'tensorrt_llm', 'mpi4py', 'triton') if m in sys.modules]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_demo_interleaves_timed_runs_after_a_warm_up():
    out = cli("demo", "--tiny", "--max-new-tokens", "8", "--repeats", "2").stdout
    assert "after one warm-up run each, 2 interleaved runs per mode" in out
    runs = [line.split("(runs ")[1].rstrip(" s)").split() for line in out.splitlines() if "(runs " in line]
    assert len(runs) == 2 and all(len(r) == 2 for r in runs)  # AR and DFlash, 2 timed runs each
    assert "speedup:" in out and "median AR time / median DFlash time" in out
    assert "--ngram-lookup" not in out
    from dflash_trt.models.cpu_linear import onednn_available

    assert ("float32 linears on oneDNN-prepacked weights" in out) == onednn_available()
    aten = cli("demo", "--tiny", "--max-new-tokens", "8", "--repeats", "1", "--cpu-kernels", "torch").stdout
    assert "speedup:" in aten and "oneDNN" not in aten
    lookup = cli("demo", "--tiny", "--max-new-tokens", "24", "--repeats", "1", "--ngram-lookup", "1").stdout
    assert "--ngram-lookup 1: " in lookup and "steps drafted by lookup" in lookup
    bad = cli("demo", "--tiny", "--repeats", "0", check=False)
    assert bad.returncode == 2 and "--repeats" in bad.stderr and "Traceback" not in bad.stderr
    for flag in ("--no-spec", "--max-batch-size", "--acceptance"):  # flags that would do nothing in a demo
        assert flag not in cli("demo", "--help").stdout
