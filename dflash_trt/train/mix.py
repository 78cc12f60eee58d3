"""The training prompt mix: code completions, code chat, standard-library chat and self-prompts.

`build_mix` draws from every offline source (train/corpus.py, train/data.py, train/selfprompt.py),
applies the eval-overlap filter once to the union (8-gram and HumanEval entry points: the
benchmarks stay held out), encodes each prompt the way the benchmarks do (chat prompts through
the chat template, code prompts as raw text), drops long ones and splits off a held-out set for
checkpoint selection. The result is written as JSON lines (`id`, `category`, `kind`, `ids`) so
that regeneration and training read exactly the same prompts in later sessions.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_trt.bench.datasets import humaneval_entry_points, load_humaneval, load_mtbench
from dflash_trt.prompts import Prompt, encode_prompt
from dflash_trt.errors import ConfigError, InputError
from dflash_trt.train.data import exclude_eval_overlap


@dataclass(frozen=True)
class EncodedPrompt:
    id: str
    category: str
    kind: str
    ids: tuple[int, ...]

    def to_json(self) -> str:
        return json.dumps({"id": self.id, "category": self.category, "kind": self.kind, "ids": list(self.ids)})


def build_mix(sources: dict[str, list[Prompt]], quotas: dict[str, int], tokenizer, *, seed: int,
              max_prompt_tokens: int, held_out: int) -> tuple[list[EncodedPrompt], list[EncodedPrompt], dict[str, Any]]:
    """(train, held_out, report). `quotas[category]` caps prompts per category (after filters)."""
    pool = [p for prompts in sources.values() for p in prompts]
    if not pool:
        raise ConfigError("no training prompts from any source")
    kept, exclusion = exclude_eval_overlap(pool, load_humaneval() + load_mtbench(), 8, humaneval_entry_points())
    rng = random.Random(seed)
    rng.shuffle(kept)
    taken: dict[str, int] = {}
    chosen: list[EncodedPrompt] = []
    too_long = 0
    for p in kept:
        if taken.get(p.category, 0) >= quotas.get(p.category, 0):
            continue
        try:
            ids = encode_prompt(tokenizer, p.text, chat=p.kind == "chat")
        except InputError:
            continue
        if len(ids) > max_prompt_tokens or len(ids) < 2:
            too_long += 1
            continue
        taken[p.category] = taken.get(p.category, 0) + 1
        chosen.append(EncodedPrompt(p.id, p.category, p.kind, tuple(ids)))
    if len(chosen) <= held_out:
        raise ConfigError(f"only {len(chosen)} prompts survived the filters; need more than {held_out}")
    report = {"per_category": dict(sorted(taken.items())), "dropped_too_long": too_long,
              "exclusion": {k: v for k, v in exclusion.to_dict().items() if k != "dropped_ids"},
              "held_out": held_out, "max_prompt_tokens": max_prompt_tokens, "seed": seed}
    return chosen[held_out:], chosen[:held_out], report


def write_prompts(path: Path, prompts: list[EncodedPrompt]) -> None:
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(p.to_json() + "\n" for p in prompts))
    tmp.replace(path)


def read_prompts(path: Path) -> list[EncodedPrompt]:
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            out.append(EncodedPrompt(str(d["id"]), str(d["category"]), str(d["kind"]), tuple(int(x) for x in d["ids"])))
        except (KeyError, TypeError, ValueError) as exc:
            raise InputError(f"{path}:{n}: not a prompt record ({exc})") from exc
    return out
