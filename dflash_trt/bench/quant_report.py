"""Quantization quality report: FP8 / NVFP4 targets and an FP8 DFlash drafter vs the unquantized ones.

On the embedded default target (SmolLM2-135M-Instruct) or --target, over the MT-Bench first turns
(the benchmark prompts are only EVALUATED here; calibration uses the standard-library prompts):
- mean number of greedy tokens before the first divergence from the unquantized model;
- perplexity of the unquantized model's own greedy outputs under each model (and the change);
- with --drafter: DFlash tau (mean acceptance length) with the FP8 drafter vs the unquantized one,
  both drafting for the unquantized target (so only the drafter's quantization differs).

    python -m dflash_trt.bench.quant_report --limit 8 --max-new-tokens 64 [--drafter DIR] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

import torch

from dflash_trt.checkpoint import modelopt_hf
from dflash_trt.builder.calibration import calibrate_drafter, calibrate_target, calibration_prompts
from dflash_trt.engine import EngineConfig, SamplingParams
from dflash_trt.runtime.factory import torch_engine


def first_divergence(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@torch.inference_mode()
def nll_of(target, prompt: list[int], continuation: list[int]) -> tuple[float, int]:
    """Sum of -log p(continuation | prompt) under `target` (teacher forced), and the token count."""
    ids = torch.tensor([prompt + continuation])
    cache = target.new_cache(1, ids.shape[1])
    rows = cache.add_rows(1)
    logits = target.forward(cache, slice(rows.start, rows.stop), ids, torch.arange(ids.shape[1])[None]).logits
    logp = torch.log_softmax(logits[0, len(prompt) - 1:-1].float(), dim=-1)
    picked = logp.gather(1, torch.tensor(continuation)[:, None])
    return float(-picked.sum()), len(continuation)


def greedy(target, drafter, prompts, max_new: int):
    # whole blocks: the report compares tau with and without quantization, not the CPU's truncation default
    cfg = EngineConfig(max_seq_len=max(map(len, prompts)) + max_new + 64, max_batch_size=1, speculative=drafter is not None,
                       draft_confidence=0.0)
    engine = torch_engine(target, drafter, cfg)
    params = SamplingParams(max_new_tokens=max_new)
    return [engine.generate([p], params)[0] for p in prompts]


def perplexity(target, prompts, outputs) -> float:
    total, count = 0.0, 0
    for p, out in zip(prompts, outputs):
        if out.tokens:
            nll, n = nll_of(target, p, out.tokens)
            total, count = total + nll, count + n
    return math.exp(total / max(count, 1))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, default=None, help="target HF dir (default: embedded SmolLM2-135M)")
    ap.add_argument("--drafter", type=Path, default=None, help="DFlash drafter dir for the tau comparison")
    ap.add_argument("--cache-dir", type=Path, default=None)
    ap.add_argument("--limit", type=int, default=8, help="MT-Bench prompts to use (of 80)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--calib-prompts", type=int, default=16)
    ap.add_argument("--algos", default="fp8,nvfp4")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = ap.parse_args(argv)

    from dflash_trt.bench.datasets import load_mtbench
    from dflash_trt.models.smollm2 import default_cache_dir, ensure_default_target
    from dflash_trt.prompts import chat_prompt_ids
    from dflash_trt.models.drafter import DFlashDrafter
    from dflash_trt.models.target import load_native_target
    from dflash_trt.runtime.factory import load_tokenizer

    target_dir = args.target or ensure_default_target(args.cache_dir or default_cache_dir())
    target = load_native_target(target_dir)
    tok = load_tokenizer(target_dir)
    prompts = [chat_prompt_ids(tok, p.text) for p in load_mtbench()[: args.limit]]
    calib = calibration_prompts(args.calib_prompts, tokenizer=tok, vocab_size=target.config.vocab_size)
    ref = greedy(target, None, prompts, args.max_new_tokens)
    base_ppl = perplexity(target, prompts, ref)
    report: dict = {"target": str(target_dir), "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
                    "calib_prompts": len(calib), "unquantized_ppl": base_ppl, "algos": {}}
    tcal = calibrate_target(target, calib)
    with tempfile.TemporaryDirectory() as tmp:
        for name in [a for a in args.algos.split(",") if a.strip()]:  # --algos "" = drafter only
            algo = name.strip().upper()
            qt = modelopt_hf.load_target(modelopt_hf.write_target(target, Path(tmp) / algo, algo, tcal))
            outs = greedy(qt, None, prompts, args.max_new_tokens)
            div = [first_divergence(r.tokens, o.tokens) for r, o in zip(ref, outs)]
            ppl = perplexity(qt, prompts, ref)
            report["algos"][algo] = {"mean_tokens_before_divergence": sum(div) / len(div), "divergence": div,
                                     "ppl_on_unquantized_outputs": ppl, "ppl_change_pct": 100 * (ppl / base_ppl - 1)}
            print(f"{algo}: mean tokens before divergence {sum(div) / len(div):.1f} / {args.max_new_tokens}; "
                  f"ppl {base_ppl:.3f} -> {ppl:.3f} ({100 * (ppl / base_ppl - 1):+.2f}%)", flush=True)
        if args.drafter is not None:
            drafter = DFlashDrafter.from_pretrained(args.drafter)
            dcal = calibrate_drafter(target, drafter, calib[:4], max_new_tokens=32)
            qd = modelopt_hf.load_drafter(modelopt_hf.write_drafter(drafter, Path(tmp) / "drafter", "FP8", dcal))
            tau = [r.mean_acceptance_length for r in greedy(target, drafter, prompts, args.max_new_tokens)]
            qtau = [r.mean_acceptance_length for r in greedy(target, qd, prompts, args.max_new_tokens)]
            t, q = sum(tau) / len(tau), sum(qtau) / len(qtau)
            report["drafter"] = {"dir": str(args.drafter), "tau_unquantized": t, "tau_fp8": q,
                                 "tau_change_pct": 100 * (q / t - 1)}
            print(f"DFlash tau: unquantized drafter {t:.3f}, FP8 drafter {q:.3f} ({100 * (q / t - 1):+.2f}%)")
    json.dump(report, sys.stdout, indent=1)
    sys.stdout.write("\n")
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
