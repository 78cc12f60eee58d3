"""Offline training-prompt recipe: stdlib prompts, self-instruct prompts, eval-overlap filter."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from dflash_trt.bench.datasets import humaneval_entry_points, load_humaneval, load_mtbench
from dflash_trt.prompts import Prompt
from dflash_trt.errors import ConfigError
from dflash_trt.train.data import (
    CHATML_USER_HEADER, DataRecipe, build_training_prompts, clean_generated_prompt,
    exclude_eval_overlap, hf_generate_fn, ngrams, self_prompts, stdlib_prompts)


@pytest.fixture(scope="module")
def eval_prompts():
    return load_humaneval() + load_mtbench()


@pytest.fixture(scope="module")
def entry_points():
    return humaneval_entry_points()


def _chat(prompt_id: str, text: str) -> Prompt:
    return Prompt(prompt_id, "test", text, "chat")


# ---- exclusion filter -------------------------------------------------------------------------

def test_filter_drops_copied_and_reworded_eval_prompts(eval_prompts):
    mtbench = next(p for p in eval_prompts if p.id == "mtbench/81")
    humaneval = next(p for p in eval_prompts if p.id == "HumanEval/0")
    reworded_chat = ("Write an ENGAGING travel-blog post about a recent trip to Hawaii; highlight "
                     "the culture and the attractions nobody should miss.")
    reworded_code = humaneval.text.replace("has_close_elements", "any_two_close").replace(
        "numbers", "values")
    candidates = [
        _chat("copy-chat", mtbench.text),
        _chat("reworded-chat", reworded_chat),
        _chat("copy-code", humaneval.text),
        _chat("reworded-code", "Please complete this:\n" + reworded_code),
        _chat("keep-1", "Explain how a hash map handles collisions, with a short example."),
        _chat("keep-2", "Write a limerick about a cat who learns to play the violin at night."),
    ]
    kept, report = exclude_eval_overlap(candidates, eval_prompts, n=8)
    assert [p.id for p in kept] == ["keep-1", "keep-2"]
    assert report.total == 6 and report.kept == 2 and report.dropped_ngram == 4
    assert set(report.dropped_ids) == {"copy-chat", "reworded-chat", "copy-code", "reworded-code"}


def test_filter_drops_humaneval_function_names(eval_prompts, entry_points):
    candidates = [
        _chat("asks", "Write a Python function `has_close_elements(xs, eps)` for me."),
        _chat("defines", "Explain this:\n```python\ndef median(xs):\n    return sorted(xs)[0]\n```"),
        _chat("mentions", "How would you implement is_palindrome without slicing?"),
        _chat("helper", "What does poly do in numerical code?\ndef poly(xs, x): ..."),
        _chat("prose", "What is the median salary of a nurse? Add two numbers for me."),
    ]
    kept, report = exclude_eval_overlap(candidates, eval_prompts, n=8, entry_points=entry_points)
    assert [p.id for p in kept] == ["prose"]
    assert report.dropped_entry_point == 4 and report.dropped_ngram == 0


def test_filter_normalizes_case_and_whitespace():
    evals = [_chat("e", "one two three four five six seven eight nine")]
    shouted = _chat("t", "ONE   two\nthree\tfour five SIX seven eight -- and more")
    short = _chat("s", "One two three")
    kept, report = exclude_eval_overlap([shouted, short], evals, n=8)
    assert kept == [short] and report.dropped_ngram == 1
    with pytest.raises(ConfigError):
        exclude_eval_overlap([short], evals, n=0)


# ---- stdlib prompts ---------------------------------------------------------------------------

def test_stdlib_prompts_are_deterministic_per_seed():
    first = stdlib_prompts(seed=3)
    again = stdlib_prompts(seed=3)
    other = stdlib_prompts(seed=4)
    assert first == again
    assert len(first) > 500
    assert [p.id for p in first] != [p.id for p in other]
    assert {p.category for p in first} == {"stdlib-write", "stdlib-explain", "stdlib-tests"}
    assert all(p.text.strip() and p.kind == "chat" for p in first)
    assert len({p.id for p in first}) == len(first)
    assert stdlib_prompts(seed=3, limit=10) == first[:10]


def test_stdlib_prompt_shapes_and_snippet_cap():
    prompts = stdlib_prompts(seed=0, modules=("textwrap", "statistics"), max_snippet_lines=12,
                             max_snippet_chars=500)
    write = [p for p in prompts if p.category == "stdlib-write"]
    explain = [p for p in prompts if p.category == "stdlib-explain"]
    assert any("`dedent(text)`" in p.text for p in write)
    assert all("```python\n" in p.text for p in explain)
    for prompt in explain:
        snippet = prompt.text.split("```python\n", 1)[1].rsplit("\n```", 1)[0]
        assert len(snippet.splitlines()) <= 13 and len(snippet) <= 500 + 8
    assert " at 0x" not in "".join(p.text for p in prompts)


def test_stdlib_unknown_module_is_a_config_error():
    with pytest.raises(ConfigError, match="no_such_module"):
        stdlib_prompts(seed=0, modules=("no_such_module",))


def test_training_prompts_do_not_overlap_eval_sets(eval_prompts, entry_points):
    raw = stdlib_prompts(seed=0, exclude_names=entry_points)
    assert not any(p.id.rsplit("/", 1)[0].rsplit(".", 1)[1] in entry_points for p in raw)
    assert not any(p.id.startswith("stdlib/statistics.median/") for p in raw)
    prompt_set = build_training_prompts(DataRecipe(seed=0), eval_prompts, entry_points)
    assert prompt_set.prompts and prompt_set.exclusion.kept == len(prompt_set.prompts)
    assert prompt_set.exclusion.total - prompt_set.exclusion.kept < 0.05 * len(raw)
    eval_grams = set().union(*(ngrams(p.text, 8) for p in eval_prompts))
    for prompt in prompt_set.prompts:
        assert ngrams(prompt.text, 8).isdisjoint(eval_grams), prompt.id
    card = json.loads(prompt_set.to_json())
    assert card["recipe"]["seed"] == 0 and card["recipe"]["ngram_n"] == 8
    assert sum(card["counts"].values()) == len(prompt_set.prompts)
    assert card["exclusion"]["kept"] == len(prompt_set.prompts)


def test_recipe_is_frozen_and_validated():
    recipe = DataRecipe(seed=5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        recipe.seed = 6  # type: ignore[misc]
    with pytest.raises(ConfigError):
        DataRecipe(ngram_n=0)
    with pytest.raises(ConfigError, match="generate_fn"):
        build_training_prompts(DataRecipe(self_prompt_count=2, stdlib_modules=("textwrap",)), [])


# ---- self-instruct prompts --------------------------------------------------------------------

class CharTokenizer:
    """Character tokenizer with two ChatML specials: 0 = <|im_end|>, 1 = <|im_start|>."""

    specials = ("<|im_end|>", "<|im_start|>")
    chars = "\nabcdefghijklmnopqrstuvwxyz.?" + " " * 8

    def encode(self, text, add_special_tokens=False):
        ids, i = [], 0
        while i < len(text):
            special = next((k for k, s in enumerate(self.specials) if text.startswith(s, i)), None)
            if special is not None:
                ids.append(special)
                i += len(self.specials[special])
            else:
                ids.append(2 + self.chars.index(text[i]))
                i += 1
        return ids

    def decode(self, ids):
        return "".join(self.specials[i] if i < 2 else self.chars[i - 2] for i in ids)

    @property
    def vocab_size(self):
        return 2 + len(self.chars)


def test_self_prompts_with_a_deterministic_callable():
    tokenizer = CharTokenizer()
    canned = ["write a poem about the sea.<|im_end|>",
              "write a poem   about the sea.<|im_end|>",  # duplicate once normalized
              "no end marker so it was cut off",
              "two words<|im_end|>",
              "how do magnets work in simple terms?<|im_end|>junk",
              "what is a prime number and why do they matter?<|im_end|>"]
    seen_prefixes = []

    def generate(prefix, call_seed):
        seen_prefixes.append(prefix)
        return tokenizer.encode(canned[len(seen_prefixes) - 1])

    prompts = self_prompts(generate, n=3, seed=0, tokenizer=tokenizer, max_attempts=len(canned))
    assert [p.text for p in prompts] == ["write a poem about the sea.",
                                         "how do magnets work in simple terms?",
                                         "what is a prime number and why do they matter?"]
    assert all(prefix == tokenizer.encode(CHATML_USER_HEADER) for prefix in seen_prefixes)
    assert [p.id for p in prompts] == ["self/0", "self/1", "self/2"]
    assert {p.category for p in prompts} == {"self-instruct"}


def test_clean_generated_prompt_rules():
    assert clean_generated_prompt("  Explain recursion to a child.  <|im_end|>") == \
        "Explain recursion to a child."
    assert clean_generated_prompt("Explain recursion to a child.") is None  # unfinished turn
    assert clean_generated_prompt("1 2 3 4 5 6 7 ???<|im_end|>") is None  # not words
    assert clean_generated_prompt("a b c <|x|> d<|im_end|>") is None


def test_self_prompts_with_a_tiny_random_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = CharTokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=256, bos_token_id=1, eos_token_id=0,
                         pad_token_id=0)
    model = LlamaForCausalLM(config).eval()
    generate = hf_generate_fn(model, max_new_tokens=32)
    header = tokenizer.encode(CHATML_USER_HEADER)
    state = torch.random.get_rng_state()
    assert generate(header, 123) == generate(header, 123)  # seeded per call
    prompts = self_prompts(generate, n=2, seed=11, tokenizer=tokenizer, max_attempts=16,
                           min_words=2)
    assert torch.equal(state, torch.random.get_rng_state()), "global RNG was touched"
    assert prompts, "the random model never finished a usable turn"
    assert len({p.text for p in prompts}) == len(prompts)
    assert all("<|" not in p.text and p.text.strip() for p in prompts)
