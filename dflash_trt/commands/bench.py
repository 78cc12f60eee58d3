"""`dflash-trt bench`: acceptance, speed and Pareto curves, side by side with peers.

Batch 1: every mode (dflash, ar on the --backend engine, torch by default; hf-generate, hf-prompt-lookup, dflash-reference
on the same target where installed) decodes every prompt greedily, interleaved prompt by prompt
with the mode order rotated; outputs must be token-identical (a mismatch is an error and the
command exits 1). Then a concurrency sweep of dflash and ar on that engine (continuous batching,
c requests in flight). With --endpoint the sweep runs against a running OpenAI-compatible server
instead (ours, trtllm-serve, vLLM) and no model is loaded here.
Writes DIR/report.json, DIR/report.md, DIR/pareto.png and DIR/acceptance.png.
"""
from __future__ import annotations

import argparse
import shlex
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path

from dflash_trt.bench.runner import DEFAULT_SWEEP
from dflash_trt.commands.common import (add_backend_flag, add_model_flags, check_model_flags, format_draft_len_schedule,
                                       load)
from dflash_trt.errors import InputError
from dflash_trt.models.cpu_linear import any_packed


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got '{text}'") from exc
    return values


def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmark DFlash against autoregressive decoding and peers",
                       description=__doc__)
    p.add_argument("--dataset", action="append", default=None, metavar="NAME|FILE.jsonl",
                   help="humaneval, mtbench or a JSONL prompt file; repeatable (default: humaneval)")
    p.add_argument("--limit", type=int, default=None, help="prompts per dataset (spread over categories)")
    p.add_argument("--modes", default="dflash,ar,hf-generate,hf-prompt-lookup,dflash-reference",
                   help="comma-separated modes for the batch-1 comparison: dflash (as configured), dflash-full (whole "
                        "blocks), dflash-full-vocab (no draft vocabulary), dflash@C (draft confidence C: a threshold sweep), "
                        "dflash-ngram@N (n-gram lookup drafts on repeats of >= N tokens), ar, "
                        "hf-generate, hf-prompt-lookup, "
                        "dflash-reference")
    p.add_argument("--concurrency", type=_ints, default=None,
                   help="comma-separated concurrency sweep for dflash and ar (empty string: no sweep; default: "
                        f"{','.join(map(str, DEFAULT_SWEEP))} up to the number of prompts)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--prompt-lookup-tokens", type=int, default=None,
                   help="hf-prompt-lookup draft length (default: block size - 1, the DFlash draft length; 10 without a drafter)")
    p.add_argument("--endpoint", default=None, metavar="URL",
                   help="sweep a running OpenAI-compatible server instead of the local engine")
    p.add_argument("--api-key", default=None, help="bearer token for --endpoint")
    p.add_argument("--model", default=None, help="model name for --endpoint (default: the first it lists)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="with --endpoint: every request generates exactly --max-new-tokens (server extension)")
    p.add_argument("--output", type=Path, required=True, metavar="DIR", help="where report.json/.md and plots go")
    p.add_argument("--step-costs", action="store_true",
                   help="also time a T-token target forward and the draft against a 1-token step (torch backend)")
    p.add_argument("--no-warmup", action="store_true", help="skip the unrecorded warm-up generation per mode")
    p.add_argument("--no-plots", action="store_true", help="do not write PNG plots")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's choice; 1 is fastest on a loaded machine)")
    add_backend_flag(p)
    add_model_flags(p)
    p.set_defaults(func=run, _bench_parser=p)


def command_line(args: argparse.Namespace) -> str:
    """The flags that differ from their defaults, as a command a user can rerun."""
    parts = ["dflash-trt", "bench"]
    for action in args._bench_parser._actions:
        if not action.option_strings or action.dest in ("help", "api_key"):
            continue
        value = getattr(args, action.dest)
        if value == action.default:
            continue
        flag = action.option_strings[0]
        if isinstance(action, argparse._StoreTrueAction):
            parts.append(flag)
        elif isinstance(action, argparse._AppendAction):
            for v in value:
                parts += [flag, str(v)]
        elif action.dest == "concurrency":
            parts += [flag, ",".join(map(str, value))]
        elif action.dest == "draft_len_schedule":
            parts += [flag, format_draft_len_schedule(value)]
        else:
            parts += [flag, str(value)]
    return shlex.join(parts)


def _config(args):
    from dflash_trt.bench.modes import parse_modes
    from dflash_trt.bench.runner import BenchConfig

    return BenchConfig(datasets=tuple(args.dataset or ("humaneval",)), limit=args.limit,
                       modes=tuple(parse_modes(args.modes)),
                       concurrency=None if args.concurrency is None else tuple(args.concurrency),
                       max_new_tokens=args.max_new_tokens, warmup=not args.no_warmup, progress=not args.no_progress)


def _run_endpoint(args, cfg, prompts) -> tuple[dict, dict]:
    from dflash_trt.bench.endpoint import EndpointConfig, run_endpoint_sweep
    from dflash_trt.bench.runner import _progress

    ecfg = EndpointConfig(url=args.endpoint, api_key=args.api_key, model=args.model, ignore_eos=args.ignore_eos)
    if not cfg.concurrency:
        raise InputError("--endpoint runs the concurrency sweep: give --concurrency values")
    total = sum(max(len(prompts), c) for c in cfg.concurrency)
    with _progress(total, cfg.progress) as bar:
        points, errors, model = run_endpoint_sweep(ecfg, [bp.prompt for bp in prompts], list(cfg.concurrency),
                                                   cfg.max_new_tokens, bar.update)
    body = {"modes": {"measured": [f"endpoint:{model}"], "skipped": {}, "reference_mode": None, "sweep": []},
            "records": [], "aggregates": {"by_dataset": [], "by_category": []}, "ratios": {},
            "per_position_acceptance": {}, "sweep": points, "errors": errors}
    return body, {"endpoint": ecfg.base, "model": model, "target_name": model, "block_size": None}


def _device_type(models) -> str:
    """Where the engines run: the torch target's device; TensorRT-LLM always runs on a GPU."""
    target = getattr(models, "target", None)
    return "cuda" if target is None else target.device.type


def _run_local(args, cfg, prompts, ecfg) -> tuple[dict, dict]:
    from dataclasses import replace

    from dflash_trt.bench.modes import ModeContext
    from dflash_trt.bench.runner import run_local, tokenize
    from dflash_trt.config import DrafterConfig
    from dflash_trt.models.drafter import DTYPES

    if args.step_costs and args.backend != "torch":
        raise InputError("--step-costs times our own engine's forwards: use --backend torch")
    models = load(args)
    prompts = tokenize(prompts, models.tokenizer)
    longest = max(len(bp.ids) for bp in prompts)
    limit = args.max_seq_len if args.max_seq_len is not None else models.info.max_position_embeddings
    ecfg = replace(ecfg, max_seq_len=min(limit, longest + cfg.max_new_tokens))  # no larger cache than needed
    drafter_dir = models.load.drafter
    block = (args.block_size or DrafterConfig.load(drafter_dir).block_size) if drafter_dir is not None else 1
    ctx = ModeContext(models=models, engine_config=ecfg, target_dir=Path(models.load.target),
                      drafter_dir=None if drafter_dir is None else Path(drafter_dir),
                      dtype=DTYPES[args.dtype], block_size=block,
                      prompt_lookup_tokens=args.prompt_lookup_tokens or (block - 1 if block > 1 else 10))
    body = run_local(cfg, ctx, prompts)
    if args.step_costs:
        from dflash_trt.bench.step_cost import measure_step_costs

        sizes = tuple(sorted({1, 2, 4, 8, block}))
        body["step_costs"] = measure_step_costs(models.target, models.drafter, sizes=sizes).to_dict()
    extra = {"backend": models.backend, "target": str(models.load.target),
             "drafter": None if drafter_dir is None else str(drafter_dir),
             "target_name": Path(models.load.target).name, "dtype": args.dtype, "target_backend": args.target_backend,
             "cpu_kernels": "onednn" if any_packed(getattr(models, "target", None)) else "torch",
             # the `dflash` mode's threshold, with the device default filled in (EngineConfig.on_device)
             "draft_confidence": ecfg.on_device(_device_type(models)).draft_confidence,
             "block_size": block, "max_seq_len": ecfg.max_seq_len, "prompt_lookup_tokens": ctx.prompt_lookup_tokens,
             "prompts": [{"dataset": bp.dataset, "prompt_id": bp.prompt.id, "category": bp.prompt.category,
                          "kind": bp.prompt.kind, "prompt_tokens": len(bp.ids)} for bp in prompts]}
    return body, extra


def run(args: argparse.Namespace) -> int:
    from dflash_trt.bench import report as rep
    from dflash_trt.bench.runner import assemble, load_prompts

    cfg = _config(args)
    if args.threads is not None:
        if args.threads < 1:
            raise InputError(f"--threads must be >= 1, got {args.threads}")
        import torch

        torch.set_num_threads(args.threads)
    if args.prompt_lookup_tokens is not None and args.prompt_lookup_tokens < 1:
        raise InputError(f"--prompt-lookup-tokens must be >= 1, got {args.prompt_lookup_tokens}")
    ecfg = None if args.endpoint else check_model_flags(args)  # before any model is loaded
    prompts = load_prompts(cfg.datasets, cfg.limit)
    cfg = replace(cfg, concurrency=cfg.sweep_levels(len(prompts)))
    if args.endpoint:
        body, extra = _run_endpoint(args, cfg, prompts)
    else:
        body, extra = _run_local(args, cfg, prompts, ecfg)
    report = assemble(cfg, body, {"command": command_line(args), **extra})
    report["warnings"] = rep.noise_warnings(report["records"], dict(Counter(bp.dataset for bp in prompts)))
    out = Path(args.output)
    if not args.no_plots:
        from dflash_trt.bench.plots import write_plots

        report["plots"] = write_plots(report, out)
    rep.write_json(out / "report.json", report)
    md = rep.markdown(report)
    rep.atomic_write_bytes(out / "report.md", md.encode())
    print(md)
    print(f"wrote {out / 'report.json'} and {out / 'report.md'}", file=sys.stderr)
    for warning in report["warnings"]:
        print(f"dflash-trt bench: warning: {warning}", file=sys.stderr)
    for err in report["errors"]:
        print(f"dflash-trt bench: error: {err['message']}", file=sys.stderr)
    return 1 if report["errors"] else 0
