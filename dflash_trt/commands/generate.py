"""`dflash-trt generate`: decode one prompt with DFlash (or autoregressively with --no-spec).

--backend torch (default: this project's engine) or trtllm (TensorRT-LLM's LLM API; a CUDA GPU and
tensorrt_llm, else one error line and exit 2) picks the engine behind the same contract.
With --json it prints one object: tokens, text (when a tokenizer exists), steps
[{draft_tokens, accepted}], mean_acceptance_length, tokens_per_s, finish_reason, prompt_tokens,
block_size. Every flag is checked before a model is loaded.
"""
from __future__ import annotations

import argparse
import json
import sys

from dflash_trt.commands.common import add_backend_flag, add_model_flags, check_model_flags, load, load_config, tp_config
from dflash_trt.errors import InputError
from dflash_trt.engine import SamplingParams


def register(sub) -> None:
    p = sub.add_parser("generate", help="generate from one prompt", description=__doc__)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (needs the target's tokenizer)")
    src.add_argument("--prompt-ids", help="comma-separated prompt token ids, e.g. 1,2,3")
    p.add_argument("--chat", action="store_true", help="wrap --prompt in the target's chat template")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the EOS token")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel ranks; torch backend: launch as `mpirun -n N dflash-trt generate --tp N ...`; "
                        "trtllm backend: TensorRT-LLM starts its own N workers")
    p.add_argument("--moe-tp-size", type=int, default=1,
                   help="with --tp: ranks splitting each expert's intermediate dim (the rest split the experts)")
    p.add_argument("--tp-timeout", type=float, default=300.0, help="with --tp: seconds before a stuck collective fails the job")
    add_backend_flag(p)
    add_model_flags(p)
    p.set_defaults(func=run)


def parse_ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise InputError(f"--prompt-ids must be comma-separated integers, got '{text}'") from exc
    if not ids:
        raise InputError("--prompt-ids is empty: give at least one token id")
    return ids


def check_prompt(prompt: str | None, ids: str | None) -> list[int] | None:
    """The prompt flags, checked before any model is loaded: token ids parsed, text non-empty."""
    if ids is not None:
        return parse_ids(ids)
    if not prompt:
        raise InputError("the prompt is empty: give --prompt some text")
    return None


def prompt_ids(models, prompt: str | None, ids: str | None, chat: bool) -> list[int]:
    parsed = check_prompt(prompt, ids)
    if parsed is not None:
        return parsed
    tok = models.tokenizer
    if tok is None:
        raise InputError("this target has no tokenizer: use --prompt-ids")
    from dflash_trt.prompts import encode_prompt

    return encode_prompt(tok, prompt, chat=chat)


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                          max_new_tokens=args.max_new_tokens, ignore_eos=args.ignore_eos)


def run(args: argparse.Namespace) -> int:
    eng = check_model_flags(args)  # everything that needs no model first
    tp = tp_config(args)
    params = sampling_params(args)
    check_prompt(args.prompt, args.prompt_ids)
    if args.chat and args.prompt_ids is not None:
        raise InputError("--chat wraps --prompt text in the chat template and does nothing with --prompt-ids: "
                         "drop --chat, or pass the message as --prompt")
    if args.backend == "torch" and args.tp != 1:
        from dflash_trt.runtime.mpi import tp_main

        return tp_main(tp, lambda: load_config(args), eng, lambda m, e: decode(args, m, e, params))
    models = load(args, args.tp, args.moe_tp_size)
    engine = models.engine(eng)
    try:
        return decode(args, models, engine, params)
    finally:
        engine.shutdown()


def decode(args: argparse.Namespace, models, engine, params: SamplingParams) -> int:
    ids = prompt_ids(models, args.prompt, args.prompt_ids, args.chat)
    result = engine.generate([ids], params)[0]
    text = models.detokenize(result.tokens) if models.tokenizer is not None else None
    if args.json:
        out = {
            "tokens": result.tokens,
            "steps": [{"draft_tokens": s.draft_tokens, "accepted": s.accepted} for s in result.steps],
            "mean_acceptance_length": result.mean_acceptance_length,
            "tokens_per_s": result.tokens_per_s,
            "finish_reason": result.finish_reason,
            "prompt_tokens": result.prompt_tokens,
            "block_size": engine.block_size,
        }
        if text is not None:
            out["text"] = text
        json.dump(out, sys.stdout)
        sys.stdout.write("\n")
    else:
        print(text if text is not None else " ".join(map(str, result.tokens)))
        print(f"[{len(result.tokens)} tokens, {result.tokens_per_s:.1f} tok/s, "
              f"tau {result.mean_acceptance_length:.2f}, block {engine.block_size}]", file=sys.stderr)
    return 0
