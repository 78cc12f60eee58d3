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

import importlib
import inspect
import json
import logging
import platform
import random
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from dflash_trt.bench.datasets import Prompt
from dflash_trt.errors import ConfigError, InputError

logger = logging.getLogger(__name__)

# Pure-Python standard-library modules present on every supported Python (3.10+).
DEFAULT_STDLIB_MODULES: tuple[str, ...] = (
    "argparse", "ast", "base64", "calendar", "colorsys", "configparser", "contextlib", "copy",
    "csv", "dataclasses", "difflib", "email.utils", "enum", "filecmp", "fnmatch", "fractions",
    "functools", "getopt", "gettext", "glob", "graphlib", "heapq", "html", "ipaddress", "json",
    "linecache", "locale", "mimetypes", "pathlib", "plistlib", "pprint", "queue", "quopri",
    "random", "re", "reprlib", "secrets", "shlex", "shutil", "statistics", "string", "tarfile",
    "textwrap", "tokenize", "urllib.parse", "uuid", "zipfile")
CHATML_USER_HEADER = "<|im_start|>user\n"
END_MARKERS: tuple[str, ...] = ("<|im_end|>", "<|im_start|>", "<|endoftext|>", "</s>")

_WRITE_FUNCTION = (
    "Write a Python function `{name}{sig}`. Its docstring summary is: \"{summary}\"",
    "Implement `{name}{sig}` in Python. Specification: {summary}",
    "Write a Python function `{name}{sig}` that matches this description: {summary} "
    "Include a docstring and a short usage example.",
)
_WRITE_CLASS = (
    "Write a Python class `{name}`. Its docstring summary is: \"{summary}\"",
    "Implement a small Python class `{name}` matching this description: {summary}",
)
_EXPLAIN = (
    "Explain what this code does:\n```python\n{snippet}\n```",
    "Explain, step by step, what the following Python code from the `{module}` module does:\n"
    "```python\n{snippet}\n```",
    "What are the inputs and outputs of this function, and what does it do?\n"
    "```python\n{snippet}\n```",
)
_TESTS = (
    "Write pytest unit tests for `{module}.{name}{sig}`, whose documentation says: {summary}",
)


@dataclass(frozen=True)
class StdlibItem:
    """One public function, method or class of a standard-library module."""

    module: str
    qualname: str  # "name" or "Class.method"
    is_class: bool
    signature: str  # "(a, b=1)"; "" when unknown or not reproducible
    summary: str  # first docstring sentence; "" when none
    source: str  # "" for classes (their source is too long to quote)


def _first_sentence(doc: str | None, max_chars: int = 300) -> str:
    if not doc:
        return ""
    paragraph = inspect.cleandoc(doc).split("\n\n")[0]
    text = " ".join(paragraph.split())
    match = re.match(r"(.+?[.!?])(\s|$)", text)
    sentence = match.group(1) if match else text
    return sentence if 8 <= len(sentence) <= max_chars else ""


def _signature(obj: Any) -> str:
    try:
        sig = str(inspect.signature(obj))
    except (TypeError, ValueError):
        return ""
    # Default values whose repr holds a memory address would make prompts differ between runs.
    return "" if " at 0x" in sig or len(sig) > 160 else sig


def _cap_snippet(source: str, max_lines: int, max_chars: int) -> str:
    lines = inspect.cleandoc("\n" + source).splitlines() if source else []
    kept: list[str] = []
    size = 0
    for line in lines:
        if len(kept) >= max_lines or size + len(line) + 1 > max_chars:
            kept.append("    ...")
            break
        kept.append(line.rstrip())
        size += len(line) + 1
    return "\n".join(kept)


def _source(obj: Any) -> str:
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return ""


def stdlib_items(modules: Sequence[str] = DEFAULT_STDLIB_MODULES, include_methods: bool = True,
                 exclude_names: Iterable[str] = ()) -> list[StdlibItem]:
    """Public functions, classes and (optionally) methods defined in `modules`, sorted.

    Items whose name (or method name) is in `exclude_names` are left out: pass HumanEval's
    entry points so no training prompt asks for a benchmark function.
    """
    excluded = frozenset(exclude_names)
    items: list[StdlibItem] = []
    for module_name in modules:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            raise ConfigError(f"standard-library module {module_name!r} is not importable here; "
                              "remove it from the data recipe's stdlib_modules") from err
        for name in sorted(vars(module)):
            obj = vars(module)[name]
            if name.startswith("_") or name in excluded or inspect.getmodule(obj) is not module:
                continue
            if inspect.isfunction(obj):
                items.append(StdlibItem(module_name, name, False, _signature(obj),
                                        _first_sentence(obj.__doc__), _source(obj)))
            elif inspect.isclass(obj):
                items.append(StdlibItem(module_name, name, True, "", _first_sentence(obj.__doc__), ""))
                if include_methods:
                    items.extend(_methods(module_name, obj, excluded))
    return items


def _methods(module_name: str, cls: type, excluded: frozenset[str]) -> list[StdlibItem]:
    methods = []
    for name in sorted(vars(cls)):
        obj = vars(cls)[name]
        if name.startswith("_") or name in excluded or not inspect.isfunction(obj):
            continue
        methods.append(StdlibItem(module_name, f"{cls.__name__}.{name}", False, _signature(obj),
                                  _first_sentence(obj.__doc__), _source(obj)))
    return methods


def stdlib_prompts(seed: int, modules: Sequence[str] = DEFAULT_STDLIB_MODULES, *,
                   include_methods: bool = True, exclude_names: Iterable[str] = (),
                   max_snippet_lines: int = 40, max_snippet_chars: int = 1600,
                   limit: int | None = None) -> list[Prompt]:
    """Chat prompts built from the standard library, shuffled deterministically by `seed`."""
    if max_snippet_lines < 3 or max_snippet_chars < 80:
        raise ConfigError("max_snippet_lines must be >= 3 and max_snippet_chars >= 80")
    if (limit or 0) < 0:
        raise ConfigError(f"limit must be >= 0 or None, got {limit}")
    rng = random.Random(seed)
    prompts: list[Prompt] = []
    for item in stdlib_items(modules, include_methods, exclude_names):
        base = f"stdlib/{item.module}.{item.qualname}"
        fields = {"name": item.qualname, "sig": item.signature, "summary": item.summary,
                  "module": item.module}
        if item.summary and (item.is_class or item.signature):
            templates = _WRITE_CLASS if item.is_class else _WRITE_FUNCTION
            prompts.append(Prompt(f"{base}/write", "stdlib-write",
                                  rng.choice(templates).format(**fields), "chat"))
        if item.source:
            snippet = _cap_snippet(item.source, max_snippet_lines, max_snippet_chars)
            prompts.append(Prompt(f"{base}/explain", "stdlib-explain",
                                  rng.choice(_EXPLAIN).format(snippet=snippet, **fields), "chat"))
        if item.summary and item.signature and "." not in item.qualname and rng.random() < 0.25:
            prompts.append(Prompt(f"{base}/tests", "stdlib-tests",
                                  rng.choice(_TESTS).format(**fields), "chat"))
    rng.shuffle(prompts)
    return prompts if limit is None else prompts[:limit]


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
