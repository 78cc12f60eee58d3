"""Offline prompt records, the standard-library prompt builders, and THE prompt encoder (floor 0).

- `Prompt`: one prompt (id, category, text, kind); "code" prompts are completed as raw text, "chat"
  prompts go through the target's chat template. Benchmarks (bench/datasets.py), training
  (train/data.py) and calibration (builder/calibration.py) all use this record.
- `stdlib_prompts`: instructions made from the Python standard library (write this function,
  explain this code, write tests for it), deterministic per seed. Offline, and never the
  evaluation sets (HumanEval, MT-Bench).
- `encode_prompt` / `chat_ids`: text -> token ids. The CLI (`generate --chat`), the OpenAI server
  (/v1/chat/completions) and the Triton model (`chat: true`) encode through these, so the same
  conversation gives the same ids everywhere: the template is rendered to text
  (`apply_chat_template(tokenize=False)`), then tokenized without adding special tokens again.
"""
from __future__ import annotations

import importlib
import inspect
import random
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from dflash_trt.errors import CheckpointError, ConfigError, InputError

PromptKind = Literal["code", "chat"]
PROMPT_KINDS: tuple[str, ...] = ("code", "chat")

@dataclass(frozen=True)
class Prompt:
    """One prompt: a stable id, a category for per-category reports, the text, and its kind
    ("code" prompts are completed as raw text, "chat" prompts go through the chat template)."""

    id: str
    category: str
    text: str
    kind: PromptKind

    def __post_init__(self) -> None:
        if self.kind not in PROMPT_KINDS:
            raise InputError(f"prompt {self.id!r}: kind must be one of {PROMPT_KINDS}, got {self.kind!r}")
        if not self.text.strip():
            raise InputError(f"prompt {self.id!r} has empty text")


# Pure-Python standard-library modules present on every supported Python (3.10+).
DEFAULT_STDLIB_MODULES: tuple[str, ...] = (
    "argparse", "ast", "base64", "calendar", "colorsys", "configparser", "contextlib", "copy",
    "csv", "dataclasses", "difflib", "email.utils", "enum", "filecmp", "fnmatch", "fractions",
    "functools", "getopt", "gettext", "glob", "graphlib", "heapq", "html", "ipaddress", "json",
    "linecache", "locale", "mimetypes", "pathlib", "plistlib", "pprint", "queue", "quopri",
    "random", "re", "reprlib", "secrets", "shlex", "shutil", "statistics", "string", "tarfile",
    "textwrap", "tokenize", "urllib.parse", "uuid", "zipfile")
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


# ---- the prompt encoder ------------------------------------------------------------------------
def chat_ids(tokenizer: Any, messages: Sequence[dict[str, str]], *, add_generation_prompt: bool = True,
             template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Token ids of a conversation rendered with the tokenizer's chat template (+ the assistant header)."""
    if tokenizer.chat_template is None:
        raise CheckpointError("the tokenizer has no chat template; use a chat/instruct model")
    text = tokenizer.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt, tokenize=False,
                                         **(template_kwargs or {}))
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def chat_prompt_ids(tokenizer: Any, user_text: str, system: str | None = None) -> list[int]:
    """Token ids of a one-turn chat prompt, ending with the assistant header.

    With `system=None` the tokenizer's template decides (SmolLM2 inserts its default system turn).
    """
    if not isinstance(user_text, str) or not user_text.strip():
        raise InputError("the user prompt is empty; pass some text")
    messages: list[dict[str, str]] = []
    if system is not None:
        messages.append({"role": "system", "content": system})
    messages.append({"role": "user", "content": user_text})
    return chat_ids(tokenizer, messages)


def encode_prompt(tokenizer: Any, text: str, *, chat: bool) -> list[int]:
    """A text prompt as ids: one user turn through the chat template, or the raw text."""
    if chat:
        return chat_prompt_ids(tokenizer, text)
    return list(tokenizer.encode(text))


__all__ = ["DEFAULT_STDLIB_MODULES", "PROMPT_KINDS", "Prompt", "PromptKind", "StdlibItem", "chat_ids",
           "chat_prompt_ids", "encode_prompt", "stdlib_items", "stdlib_prompts"]
