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
    seen: set[tuple[int, ...]] = set()  # two sources can give the same text: one copy, so the split stays disjoint
    too_long = duplicates = 0
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
        if tuple(ids) in seen:
            duplicates += 1
            continue
        seen.add(tuple(ids))
        taken[p.category] = taken.get(p.category, 0) + 1
        chosen.append(EncodedPrompt(p.id, p.category, p.kind, tuple(ids)))
    if len(chosen) <= held_out:
        raise ConfigError(f"only {len(chosen)} prompts survived the filters; need more than {held_out}")
    report = {"per_category": dict(sorted(taken.items())), "dropped_too_long": too_long, "dropped_duplicates": duplicates,
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


DEFAULT_QUOTAS: dict[str, int] = {
    "code-complete": 2400, "code-continue": 800, "code-write": 700, "code-explain": 500,
    "stdlib-write": 350, "stdlib-explain": 350, "stdlib-tests": 100, "self-chat": 1200,
}


def prompt_sources(tokenizer, target, *, seed: int, self_prompts: int, code_packages: tuple[str, ...] | None = None,
                   progress: bool = True) -> dict[str, list[Prompt]]:
    """Every offline prompt source, by name: installed code (train/corpus.py), the standard library
    (prompts.stdlib_prompts) and, when `self_prompts` > 0, chat turns the target writes itself
    (train/selfprompt.py, batched on our engine). `code_packages`: the site-packages to read (None:
    corpus.DEFAULT_SITE_PACKAGES; the standard library is always read). The eval filter is `build_mix`'s job."""
    from dflash_trt.prompts import stdlib_prompts
    from dflash_trt.train.corpus import CodeCorpusRecipe, code_prompts

    recipe = CodeCorpusRecipe(seed=seed) if code_packages is None else CodeCorpusRecipe(seed=seed, packages=code_packages)
    sources = {"code": code_prompts(recipe),
               "stdlib": stdlib_prompts(seed, exclude_names=humaneval_entry_points())}
    if self_prompts:
        from dflash_trt.engine import EngineConfig
        from dflash_trt.runtime.factory import torch_engine
        from dflash_trt.train.selfprompt import SelfPromptRecipe, self_prompts_batched

        self_recipe = SelfPromptRecipe(count=self_prompts, seed=seed)
        engine = torch_engine(target, None, EngineConfig(speculative=False, max_batch_size=self_recipe.batch_size,
                                                         max_seq_len=512))
        sources["self"] = self_prompts_batched(engine, tokenizer, self_recipe, progress=progress)
    return sources
