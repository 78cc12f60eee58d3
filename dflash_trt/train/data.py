"""Offline training prompts for drafter training.

DFlash trains the drafter on prompts whose responses the target regenerates, so only prompts are
needed. Nothing can be downloaded; they come from offline sources:
1. `stdlib_prompts`: instructions made from the Python standard library (public functions,
   methods, classes of a fixed module list): write this function, explain this code, write tests.
   Deterministic per seed (and per Python version, which the recipe records).
2. `self_prompts`: the target writes prompts itself from only the chat template's user-turn
   header; results are cleaned and de-duplicated.
3. `exclude_eval_overlap`: drops every training prompt sharing a word n-gram with an evaluation
   prompt (HumanEval, MT-Bench) or naming a HumanEval function, so benchmarks stay held out.
`build_training_prompts` applies a `DataRecipe`; `PromptSet.to_json` goes into the model card.
"""
from __future__ import annotations

import json
import logging
import platform
import random
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from dflash_trt.prompts import DEFAULT_STDLIB_MODULES, Prompt, stdlib_prompts
from dflash_trt.errors import ConfigError, InputError

logger = logging.getLogger(__name__)

CHATML_USER_HEADER = "<|im_start|>user\n"
END_MARKERS: tuple[str, ...] = ("<|im_end|>", "<|im_start|>", "<|endoftext|>", "</s>")

class TokenizerLike(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...


# (prefix token ids, per-call seed) -> continuation token ids (without the prefix).
GenerateFn = Callable[[list[int], int], list[int]]


def clean_generated_prompt(text: str, min_words: int = 4, max_chars: int = 1500) -> str | None:
    """The user turn a model wrote after the header, or None when it is unusable.

    The turn must be finished (an end marker seen), have `min_words` words, fit `max_chars`,
    hold no leftover special tokens and be mostly letters (not garbage).
    """
    cuts = [text.find(marker) for marker in END_MARKERS if marker in text]
    if not cuts:
        return None
    body = text[:min(cuts)]
    lines = [line.rstrip() for line in body.strip().splitlines()]
    body = re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()
    if "<|" in body or len(body) > max_chars or len(body.split()) < min_words:
        return None
    visible = [char for char in body if not char.isspace()]
    letters = sum(char.isalpha() for char in visible)
    return body if letters >= 0.5 * len(visible) else None


def self_prompts(generate_fn: GenerateFn, n: int, seed: int, *, tokenizer: TokenizerLike,
                 header: str = CHATML_USER_HEADER, max_attempts: int | None = None,
                 min_words: int = 4, max_chars: int = 1500) -> list[Prompt]:
    """Prompts the target writes itself: `generate_fn` continues only the user-turn header.

    Calls are seeded from `seed` (so a seeded sampler makes the result reproducible); cleaned,
    unique prompts are collected until `n` or `max_attempts` (default 4 n) calls are spent.
    """
    if n < 0:
        raise ConfigError(f"n must be >= 0, got {n}")
    attempts = 4 * n if max_attempts is None else max_attempts
    prefix = list(tokenizer.encode(header, add_special_tokens=False))
    if not prefix:
        raise InputError("the user-turn header encodes to no tokens")
    rng = random.Random(seed)
    prompts: list[Prompt] = []
    seen: set[tuple[str, ...]] = set()
    for _ in range(attempts):
        if len(prompts) >= n:
            break
        continuation = generate_fn(list(prefix), rng.randrange(2**31))
        text = clean_generated_prompt(tokenizer.decode(list(continuation)), min_words, max_chars)
        key = tuple(words(text)) if text else ()
        if text is None or key in seen:
            continue
        seen.add(key)
        prompts.append(Prompt(f"self/{len(prompts)}", "self-instruct", text, "chat"))
    if len(prompts) < n:
        logger.warning("self-instruct produced %d of %d prompts in %d attempts",
                       len(prompts), n, attempts)
    return prompts


def hf_generate_fn(model: Any, *, max_new_tokens: int = 128, temperature: float = 1.0,
                   top_p: float = 0.95) -> GenerateFn:
    """A GenerateFn sampling from a transformers causal LM; each call is seeded and leaves the
    global torch RNG untouched."""
    import torch

    if max_new_tokens < 1 or temperature <= 0 or not 0 < top_p <= 1:
        raise ConfigError("need max_new_tokens >= 1, temperature > 0 and 0 < top_p <= 1")

    def generate(prefix: list[int], call_seed: int) -> list[int]:
        ids = torch.tensor([prefix], dtype=torch.long)
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(call_seed)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                 temperature=temperature, top_p=top_p, top_k=0,
                                 max_new_tokens=max_new_tokens)
        return out[0, len(prefix):].tolist()

    return generate


def words(text: str) -> list[str]:
    """Normalized words: lowercase, punctuation and whitespace runs act as separators."""
    return re.findall(r"\w+", text.lower())


def ngrams(text: str, n: int) -> set[tuple[str, ...]]:
    tokens = words(text)
    return {tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)}


_DEFINED = re.compile(r"\b(?:def|class)\s+([A-Za-z_]\w*)")
_REQUESTED = re.compile(r"`(?:[A-Za-z_]\w*\.)*([A-Za-z_]\w*)\s*[(`]")
_IDENTIFIER = re.compile(r"\b([A-Za-z_]\w*)\b")


def function_names(text: str) -> set[str]:
    """Function/class names a prompt defines (`def f`), asks for (`` `f(...)` ``), or mentions
    when the name is distinctive (has an underscore, a digit or inner capitals)."""
    names = set(_DEFINED.findall(text)) | set(_REQUESTED.findall(text))
    for name in _IDENTIFIER.findall(text):
        if "_" in name.strip("_") or any(c.isdigit() for c in name) or any(c.isupper() for c in name[1:]):
            names.add(name)
    return names


@dataclass(frozen=True)
class ExclusionReport:
    """What `exclude_eval_overlap` dropped and why (one reason per prompt, n-gram first)."""

    total: int
    kept: int
    dropped_ngram: int
    dropped_entry_point: int
    ngram_n: int
    dropped_ids: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def exclude_eval_overlap(prompts: Sequence[Prompt], eval_prompts: Sequence[Prompt], n: int = 8,
                         entry_points: Iterable[str] = ()) -> tuple[list[Prompt], ExclusionReport]:
    """Drop training prompts sharing a word `n`-gram with any eval prompt (or equal to one once
    normalized), and prompts naming a HumanEval function: every name a code eval prompt
    defines (its entry point and helpers) plus `entry_points`."""
    if n < 1:
        raise ConfigError(f"n must be >= 1, got {n}")
    banned_grams: set[tuple[str, ...]] = set()
    banned_texts: set[tuple[str, ...]] = set()
    banned_names = set(entry_points)
    for prompt in eval_prompts:
        banned_grams |= ngrams(prompt.text, n)
        banned_texts.add(tuple(words(prompt.text)))
        if prompt.kind == "code":
            banned_names |= set(_DEFINED.findall(prompt.text))
    kept: list[Prompt] = []
    by_ngram: list[str] = []
    by_name: list[str] = []
    for prompt in prompts:
        if tuple(words(prompt.text)) in banned_texts or not ngrams(prompt.text, n).isdisjoint(banned_grams):
            by_ngram.append(prompt.id)
        elif not function_names(prompt.text).isdisjoint(banned_names):
            by_name.append(prompt.id)
        else:
            kept.append(prompt)
    report = ExclusionReport(total=len(prompts), kept=len(kept), dropped_ngram=len(by_ngram),
                             dropped_entry_point=len(by_name), ngram_n=n,
                             dropped_ids=tuple(by_ngram + by_name))
    return kept, report


@dataclass(frozen=True)
class DataRecipe:
    """How the training prompts were made; dumped to JSON for the model card."""

    seed: int = 0
    stdlib_modules: tuple[str, ...] = DEFAULT_STDLIB_MODULES
    include_methods: bool = True
    max_snippet_lines: int = 40
    max_snippet_chars: int = 1600
    stdlib_limit: int | None = None
    self_prompt_count: int = 0
    self_prompt_header: str = CHATML_USER_HEADER
    ngram_n: int = 8
    eval_sets: tuple[str, ...] = ("humaneval", "mtbench")
    python_version: str = field(default_factory=platform.python_version)

    def __post_init__(self) -> None:
        if self.ngram_n < 1 or self.self_prompt_count < 0 or (self.stdlib_limit or 0) < 0:
            raise ConfigError("need ngram_n >= 1, self_prompt_count >= 0, stdlib_limit >= 0 or null")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class PromptSet:
    """The training prompts with the recipe that made them and per-source counts."""

    prompts: tuple[Prompt, ...]
    recipe: DataRecipe
    counts: dict[str, int]  # prompts kept per category
    exclusion: ExclusionReport

    def to_json(self) -> str:
        """Recipe, counts and exclusion report (not the prompts) as JSON for the model card."""
        card = {"recipe": self.recipe.to_dict(), "counts": self.counts,
                "exclusion": {k: v for k, v in self.exclusion.to_dict().items() if k != "dropped_ids"}}
        return json.dumps(card, indent=2, sort_keys=True)


def build_training_prompts(recipe: DataRecipe, eval_prompts: Sequence[Prompt],
                           entry_points: Iterable[str] = (), *,
                           generate_fn: GenerateFn | None = None,
                           tokenizer: TokenizerLike | None = None) -> PromptSet:
    """Apply `recipe`: stdlib prompts (+ self-instruct prompts), then the eval-overlap filter."""
    names = frozenset(entry_points)
    prompts = stdlib_prompts(recipe.seed, recipe.stdlib_modules,
                             include_methods=recipe.include_methods, exclude_names=names,
                             max_snippet_lines=recipe.max_snippet_lines,
                             max_snippet_chars=recipe.max_snippet_chars, limit=recipe.stdlib_limit)
    if recipe.self_prompt_count:
        if generate_fn is None or tokenizer is None:
            raise ConfigError("the recipe asks for self-instruct prompts: pass generate_fn and tokenizer")
        prompts += self_prompts(generate_fn, recipe.self_prompt_count, recipe.seed,
                                tokenizer=tokenizer, header=recipe.self_prompt_header)
    kept, report = exclude_eval_overlap(prompts, eval_prompts, recipe.ngram_n, names)
    counts: dict[str, int] = {}
    for prompt in kept:
        counts[prompt.category] = counts.get(prompt.category, 0) + 1
    return PromptSet(tuple(kept), recipe, dict(sorted(counts.items())), report)
