"""`dflash-trt train-prompts`: the prompt mix `train --prompts` reads, through the real CLI."""
from __future__ import annotations

import json
import subprocess
import sys

from dflash_trt.bench.datasets import load_humaneval, load_mtbench
from dflash_trt.models.tiny import save_tiny_checkpoint
from dflash_trt.train.data import ngrams
from dflash_trt.train.mix import read_prompts


def _cli(*args: str):
    return subprocess.run([sys.executable, "-m", "dflash_trt.cli", "train-prompts", *args], capture_output=True,
                          text=True, timeout=600)


def test_train_prompts_writes_a_disjoint_filtered_mix(tmp_path):
    target, _ = save_tiny_checkpoint(tmp_path / "ckpt", num_layers=2)
    out = tmp_path / "mix"
    quotas = ["code-complete=30", "code-continue=10", "code-write=8", "code-explain=0", "stdlib-write=6",
              "stdlib-explain=0", "stdlib-tests=4", "self-chat=0"]
    proc = _cli("--target", str(target), "--output", str(out), "--self-prompts", "0", "--held-out", "5",
                "--max-prompt-tokens", "1500", "--no-progress", "--code-packages", "", *[f"--quota={q}" for q in quotas])
    assert proc.returncode == 0, proc.stderr
    train, held = read_prompts(out / "train.jsonl"), read_prompts(out / "heldout.jsonl")
    report = json.loads((out / "report.json").read_text())
    assert len(held) == 5 and len(train) + len(held) == sum(report["per_category"].values())
    # quotas are caps per category; the zero ones are empty
    for item in quotas:
        name, n = item.split("=")
        assert report["per_category"].get(name, 0) <= int(n)
    assert "code-explain" not in report["per_category"] and report["per_category"]["code-complete"] == 30
    # train and held-out are disjoint; code prompts are raw text, chat prompts went through the template
    assert not {p.ids for p in train} & {p.ids for p in held}
    assert {p.kind for p in train + held} == {"code", "chat"}
    from dflash_trt.runtime.factory import load_tokenizer

    tok = load_tokenizer(target)
    for p in train:
        text = tok.decode(list(p.ids))
        assert text.startswith("<|im_start|>") == (p.kind == "chat"), (p.id, text[:40])
        assert len(p.ids) <= 1500
    # nothing from the evaluation sets: no shared word 8-gram with HumanEval or MT-Bench
    banned = set().union(*(ngrams(e.text, 8) for e in load_humaneval() + load_mtbench()))
    assert all(ngrams(tok.decode(list(p.ids)), 8).isdisjoint(banned) for p in train + held)


def test_build_mix_keeps_one_copy_of_a_prompt_two_sources_share():
    from dflash_trt.models.tiny import build_tiny_tokenizer
    from dflash_trt.prompts import Prompt
    from dflash_trt.train.mix import build_mix

    same = "Write a small parser for comma separated key value pairs in Python."
    sources = {"a": [Prompt(f"a/{i}", "code-write", f"{same} Variant {i}." if i else same, "chat") for i in range(6)],
               "b": [Prompt("b/0", "stdlib-write", same, "chat")]}
    train, held, report = build_mix(sources, {"code-write": 10, "stdlib-write": 10}, build_tiny_tokenizer(), seed=0,
                                    max_prompt_tokens=500, held_out=2)
    ids = [p.ids for p in train + held]
    assert len(ids) == len(set(ids)) == 6 and report["dropped_duplicates"] == 1


def test_train_prompts_refuses_bad_flags_before_loading(tmp_path):
    for extra, message in [(["--quota", "nope=3"], "CATEGORY one of"), (["--quota", "code-write=x"], "integer"),
                           (["--held-out", "0"], "--held-out >= 1"),
                           (["--target", str(tmp_path / "missing")], "does not exist")]:
        proc = _cli("--output", str(tmp_path / "o"), *extra)
        assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, (extra, proc.stderr)
