"""`dflash-trt train-prompts`: write the offline training prompt mix that `train --prompts` reads.

Sources (all offline): documented functions of the installed Python sources as raw HumanEval-style
completions and as chat requests (train/corpus.py), standard-library chat instructions
(prompts.stdlib_prompts), and chat turns the target writes itself from its chat template
(Magpie-style, batched on our engine; --self-prompts). The union passes the eval-overlap filter
(word 8-grams and HumanEval entry points: HumanEval and MT-Bench never become training data), is
encoded as the benchmarks encode (chat prompts through the template, code as raw text), capped per
category and split into OUTPUT/train.jsonl and OUTPUT/heldout.jsonl (checkpoint selection), with
OUTPUT/report.json saying what came from where.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dflash_trt.errors import ConfigError


def register(sub) -> None:
    from dflash_trt.train.mix import DEFAULT_QUOTAS

    p = sub.add_parser("train-prompts", help="write the offline training prompt mix for `train --prompts`",
                       description=__doc__)
    p.add_argument("--output", type=Path, required=True, help="directory for train.jsonl, heldout.jsonl, report.json")
    p.add_argument("--target", type=Path, default=None, help="target HF directory (default: embedded SmolLM2-135M)")
    p.add_argument("--cache-dir", type=Path, default=None, help="where the embedded default is converted")
    p.add_argument("--quota", action="append", default=[], metavar="CATEGORY=N",
                   help="prompts per category (repeatable); defaults: "
                        + ", ".join(f"{k}={v}" for k, v in DEFAULT_QUOTAS.items()))
    p.add_argument("--self-prompts", type=int, default=None,
                   help="chat turns the target writes itself (default: the self-chat quota plus 25%% for the filters)")
    p.add_argument("--code-packages", default=None, metavar="PKG,...",
                   help="installed packages whose documented functions become code prompts, besides the standard "
                        "library ('' = the standard library only; default: train/corpus.py DEFAULT_SITE_PACKAGES)")
    p.add_argument("--held-out", type=int, default=64, help="prompts kept out of training for checkpoint selection")
    p.add_argument("--max-prompt-tokens", type=int, default=384, help="drop longer prompts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run)


def parse_quotas(items: list[str]) -> dict[str, int]:
    from dflash_trt.train.mix import DEFAULT_QUOTAS

    quotas = dict(DEFAULT_QUOTAS)
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or name not in DEFAULT_QUOTAS:
            raise ConfigError(f"--quota takes CATEGORY=N with CATEGORY one of {', '.join(DEFAULT_QUOTAS)}; got '{item}'")
        try:
            quotas[name] = int(value)
        except ValueError as exc:
            raise ConfigError(f"--quota {item}: N must be an integer") from exc
        if quotas[name] < 0:
            raise ConfigError(f"--quota {item}: N must be >= 0")
    return quotas


def run(args: argparse.Namespace) -> int:
    quotas = parse_quotas(args.quota)
    self_count = args.self_prompts if args.self_prompts is not None else (quotas["self-chat"] * 5 + 3) // 4
    if self_count < 0 or args.held_out < 1 or args.max_prompt_tokens < 2:
        raise ConfigError("need --self-prompts >= 0, --held-out >= 1 and --max-prompt-tokens >= 2")
    if args.output.exists() and not args.output.is_dir():
        raise ConfigError(f"--output {args.output} is not a directory")
    import torch

    from dflash_trt.commands.common import cache_dir
    from dflash_trt.config import require_dir
    from dflash_trt.fileio import write_json
    from dflash_trt.runtime.factory import load_tokenizer
    from dflash_trt.train.mix import build_mix, prompt_sources, write_prompts

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.target is None:
        from dflash_trt.models.smollm2 import ensure_default_target

        target_dir = ensure_default_target(cache_dir(args))
    else:
        target_dir = require_dir(args.target, "target directory")
    tokenizer = load_tokenizer(target_dir)
    if tokenizer is None or tokenizer.chat_template is None:
        raise ConfigError(f"{target_dir} has no tokenizer with a chat template; the prompt mix needs one")
    target = None
    if self_count:
        from dflash_trt.models.target import load_native_target

        # F.linear, not the prepacked CPU kernels (models/cpu_linear.py): self-prompts are sampled, and a
        # seed reproduces an earlier mix (its held-out split) only with the kernels that wrote it
        target = load_native_target(Path(target_dir), torch.float32)
    packages = None if args.code_packages is None else tuple(x for x in args.code_packages.split(",") if x.strip())
    sources = prompt_sources(tokenizer, target, seed=args.seed, self_prompts=self_count, code_packages=packages,
                             progress=not args.no_progress)
    train, held, report = build_mix(sources, quotas, tokenizer, seed=args.seed,
                                    max_prompt_tokens=args.max_prompt_tokens, held_out=args.held_out)
    report["sources"] = {name: len(prompts) for name, prompts in sources.items()}
    report["quotas"] = quotas
    report["train"], report["target"] = len(train), str(target_dir)
    args.output.mkdir(parents=True, exist_ok=True)
    write_prompts(args.output / "train.jsonl", train)
    write_prompts(args.output / "heldout.jsonl", held)
    write_json(args.output / "report.json", report)
    print(json.dumps({"train": len(train), "heldout": len(held), "per_category": report["per_category"]}),
          file=sys.stderr)
    print(str(args.output))
    return 0
