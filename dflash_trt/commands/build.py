"""`dflash-trt build CONFIG.yaml --output DIR [--dry-run] [--force]`: one build config in, one
self-contained deployment directory out (target/, drafter/, llm_api_options.yaml, triton/, launch/,
manifest.json; shards/ for the torch backend with tp > 1).

The config is validated before any work. The directory is written next to DIR and renamed into
place at the end; finished stages are cached in DIR.build-cache/ and reused by a re-run with the
same inputs (an existing DIR needs --force, which replaces it and still reuses finished stages).
Sources are copied (reflinked where the filesystem can), never hard-linked. --dry-run prints the
plan (stages, commands, per tensor group what it becomes and its size) and writes nothing.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dflash_trt.errors import ConfigError


def register(sub) -> None:
    p = sub.add_parser("build", help="build a deployment directory from a build config", description=__doc__)
    p.add_argument("config", type=Path, help="build config YAML (see build_configs/)")
    p.add_argument("--output", "-o", type=Path, required=True, help="output directory to create")
    p.add_argument("--dry-run", action="store_true", help="print the plan and write nothing")
    p.add_argument("--force", action="store_true",
                   help="replace an existing output directory (finished stages in DIR.build-cache/ are reused)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--cache-dir", type=Path, default=None,
                   help="where the embedded default target (@default) is converted and the tiny gpt-oss "
                        "stand-in (@tiny-gpt-oss) written, once (default: $DFLASH_TRT_CACHE or ~/.cache/dflash_trt)")
    p.add_argument("--test-stage-delay", action="append", default=[], metavar="STAGE=SECONDS",
                   help=argparse.SUPPRESS)  # tests: sleep inside a stage so it can be killed mid-stage
    p.set_defaults(func=run)


def _delays(items: list[str]) -> dict[str, float]:
    out = {}
    for item in items:
        name, sep, seconds = item.partition("=")
        try:
            out[name] = float(seconds)
        except ValueError:
            raise ConfigError(f"--test-stage-delay takes STAGE=SECONDS, got '{item}'") from None
        if not sep:
            raise ConfigError(f"--test-stage-delay takes STAGE=SECONDS, got '{item}'")
    return out


def _alias_dirs(args: argparse.Namespace) -> tuple[Path | None, Path | None]:
    """(the embedded SmolLM2 directory for `@default`, the tiny gpt-oss stand-in root for
    `@tiny-gpt-oss*`), each only when the config names it; written once into the cache dir (a dry
    run only points at where they would be)."""
    from dflash_trt.builder.config import load_build_config
    from dflash_trt.commands.common import cache_dir
    from dflash_trt.models.smollm2 import DEFAULT_CACHE_SUBDIR, ensure_default_target
    from dflash_trt.models.tiny import TINY_GPT_OSS_RELEASE, ensure_tiny_gpt_oss

    cfg = load_build_config(args.config)
    root = cache_dir(args)
    paths = (cfg.target.path, cfg.drafter.path)
    default = None
    if "@default" in paths:
        default = root / DEFAULT_CACHE_SUBDIR if args.dry_run else ensure_default_target(root)
    tiny = None
    if any(p.startswith("@tiny-gpt-oss") for p in paths):
        tiny = root / TINY_GPT_OSS_RELEASE if args.dry_run else ensure_tiny_gpt_oss(root)
    return default, tiny


def run(args: argparse.Namespace) -> int:
    from dflash_trt.builder.builder import BuildOptions, build
    from dflash_trt.builder.plan import format_plan

    default_target, tiny_gpt_oss = _alias_dirs(args)
    options = BuildOptions(output=args.output.resolve(), dry_run=args.dry_run, force=args.force,
                           progress=not args.no_progress and sys.stderr.isatty(), default_target=default_target,
                           tiny_gpt_oss=tiny_gpt_oss, stage_delay_s=_delays(args.test_stage_delay))
    report = build(args.config, options)
    if args.dry_run:
        print(format_plan(report.plan))
        print("dry run: nothing was written")
        return 0
    print(report.summary())
    print(f"built {report.output}")
    missing = [r for r in report.results if r.status == "missing"]
    for r in missing:
        print(f"warning: stage {r.name} was not produced: {r.facts.get('reason', '')}", file=sys.stderr)
    return 0
