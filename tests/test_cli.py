"""The `dflash-trt generate` contract (other checks depend on it) and clean failures."""
from __future__ import annotations

import json
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
    assert all(s["draft_tokens"] == 7 and 0 <= s["accepted"] <= 7 for s in spec["steps"])
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
    full = json.loads(cli(*base).stdout)
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
    bad = cli("demo", "--tiny", "--repeats", "0", check=False)
    assert bad.returncode == 2 and "--repeats" in bad.stderr and "Traceback" not in bad.stderr
    for flag in ("--no-spec", "--max-batch-size", "--acceptance"):  # flags that would do nothing in a demo
        assert flag not in cli("demo", "--help").stdout
