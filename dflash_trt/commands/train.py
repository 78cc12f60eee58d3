"""`dflash-trt train`: fit a DFlash drafter to a target (the paper's recipe, offline data).

Prompts come from offline sources only (train/data.py): instructions made from the Python
standard library and, with --self-prompts, prompts the target writes itself from its chat
template's user header; every prompt overlapping HumanEval or MT-Bench is dropped. The target
regenerates the responses (greedy), then the drafter is trained on random anchored blocks.
Checkpoints go to --work-dir (default OUTPUT.work); --resume continues from the latest one;
Ctrl-C saves a checkpoint and exits. The result in --output is a standard DFlash drafter
directory plus training_config.yaml.
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from dflash_trt.errors import ConfigError, InputError

log = logging.getLogger(__name__)


def register(sub) -> None:
    p = sub.add_parser("train", help="train a DFlash drafter for a target", description=__doc__)
    p.add_argument("--target", type=Path, default=None, help="target HF directory (default: embedded SmolLM2-135M)")
    p.add_argument("--cache-dir", type=Path, default=None, help="where the embedded default is converted")
    p.add_argument("--output", type=Path, required=True, help="directory for the trained drafter")
    p.add_argument("--work-dir", type=Path, default=None, help="checkpoints and data cache (default: OUTPUT.work)")
    p.add_argument("--data-dir", type=Path, default=None, help="regenerated-data cache (default: WORK_DIR/data)")
    p.add_argument("--drafter-init", type=Path, default=None, help="start from this drafter (its architecture wins)")
    p.add_argument("--continue-from", type=Path, default=None, metavar="CHECKPOINT",
                   help="start a new run from another run's checkpoint (its --work-dir, its WORK_DIR/stable, or one "
                        "checkpoints/step-* directory): its float32 weights and AdamW moments carry over; steps, learning-rate "
                        "schedule and data are this run's; the architecture is the checkpoint's")
    p.add_argument("--grow-layers", type=int, default=0,
                   help="with --drafter-init: append N decoder layers that start as the identity, so the grown "
                        "drafter first drafts exactly as the given one (train/grow.py)")
    a = p.add_argument_group("drafter")
    a.add_argument("--layers", type=int, default=1, help="drafter decoder layers")
    a.add_argument("--target-layer-ids", default=None,
                   help="target layers whose hidden states the drafter reads, e.g. 1,14,27 (default: 3 evenly spaced)")
    a.add_argument("--block-size", type=int, default=16)
    a.add_argument("--intermediate-size", type=int, default=None, help="MLP width (default: the target's)")
    a.add_argument("--mask-token-id", type=int, default=None, help="default: the last vocabulary id")
    a.add_argument("--save-dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    o = p.add_argument_group("optimization")
    o.add_argument("--steps", type=int, default=1000)
    o.add_argument("--lr", type=float, default=6e-4)
    o.add_argument("--warmup-ratio", type=float, default=0.04)
    o.add_argument("--lr-schedule", choices=("cosine", "wsd"), default="cosine",
                   help="cosine decay to 0, or wsd: constant after the warmup, then a (1 - sqrt) cooldown over the "
                        "last --decay-ratio of the steps; wsd keeps the last full-LR state in WORK_DIR/stable, "
                        "which a later run continues with --continue-from WORK_DIR/stable --warmup-ratio 0 "
                        "(no re-warming)")
    o.add_argument("--decay-ratio", type=float, default=0.2, help="wsd: share of the steps in the cooldown")
    o.add_argument("--weight-decay", type=float, default=0.0)
    o.add_argument("--grad-clip", type=float, default=1.0)
    o.add_argument("--gamma", type=float, default=None, help="loss decay (default: 7 @16, 5 @10, 4 @8)")
    o.add_argument("--batch-size", type=int, default=4, help="sequences per step")
    o.add_argument("--anchors", type=int, default=16, help="anchored blocks per sequence")
    o.add_argument("--init", choices=("random", "target"), default="random",
                   help="drafter layers: random, or copied from the target layers after the deepest tap "
                        "(train/warm_start.py; needs the drafter at the target's width)")
    o.add_argument("--kd-weight", type=float, default=0.0,
                   help="share of the loss that distills the target's top-k distribution (needs --topk)")
    o.add_argument("--topk", type=int, default=0, help="target log-probs recorded per regenerated token (0: none)")
    o.add_argument("--train-vocab", type=int, default=0,
                   help="train the loss over the N most frequent data tokens only (0: full vocabulary; speed)")
    o.add_argument("--train-vocab-from", choices=("data", "init"), default="data",
                   help="init: train the loss over the starting drafter's draft vocabulary (--drafter-init / "
                        "--continue-from) instead of recounting one on this run's data with --train-vocab N")
    o.add_argument("--loss-weighting", choices=("paper", "prefix"), default="paper",
                   help="slot weights of the loss: paper, exp(-(k-1)/gamma); prefix, that times the drafter's own "
                        "probability of hitting every earlier slot of the block (default: paper)")
    o.add_argument("--bf16", action="store_true",
                   help="bf16 mixed precision (autocast) for the training forward/backward; weights and "
                        "optimizer state stay fp32 (about 1.5x faster on CPUs with AVX512-BF16/AMX)")
    o.add_argument("--seed", type=int, default=0)
    o.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --work-dir")
    d = p.add_argument_group("data")
    d.add_argument("--prompts", type=Path, action="append", default=None, metavar="JSONL",
                   help="encoded training prompts (train/mix.py records; repeatable) instead of the built-in recipe")
    d.add_argument("--heldout-prompts", type=Path, action="append", default=None, metavar="JSONL",
                   help="held-out split for --heldout-every (never the evaluation sets)")
    d.add_argument("--num-prompts", type=int, default=1000, help="standard-library prompts to use")
    d.add_argument("--self-prompts", type=int, default=0, help="prompts the target writes itself (slow: batch 1)")
    d.add_argument("--max-prompt-tokens", type=int, default=384, help="drop longer prompts")
    d.add_argument("--max-new-tokens", type=int, default=256, help="regenerated response length cap")
    d.add_argument("--regen-batch-size", type=int, default=32)
    d.add_argument("--max-seq-len", type=int, default=1024)
    d.add_argument("--eval-prompts", type=int, default=4, help="held-out training-distribution prompts for tau")
    m = p.add_argument_group("monitoring")
    m.add_argument("--eval-every", type=int, default=200, help="steps between eval tau (0: off)")
    m.add_argument("--eval-tokens", type=int, default=64)
    m.add_argument("--heldout-every", type=int, default=0,
                   help="steps between held-out CE / block accept length (needs --heldout-prompts); "
                        "the best drafter so far is kept in WORK_DIR/best")
    m.add_argument("--save-every", type=int, default=200)
    m.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    m.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run)


def parse_target_layer_ids(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        ids = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as exc:
        raise ConfigError(f"--target-layer-ids must be comma-separated layer ids, got '{text}'") from exc
    if not ids:
        raise ConfigError("--target-layer-ids is empty")
    return ids


def training_prompts(tokenizer, recipe, target=None, max_prompt_tokens: int = 384):
    """(prompt token ids, PromptSet) after the eval-overlap filter; long prompts dropped."""
    from dflash_trt.bench.datasets import humaneval_entry_points, load_humaneval, load_mtbench
    from dflash_trt.prompts import chat_prompt_ids
    from dflash_trt.train.data import build_training_prompts

    generate_fn = engine_generate_fn(target) if recipe.self_prompt_count else None
    prompt_set = build_training_prompts(recipe, load_humaneval() + load_mtbench(), humaneval_entry_points(),
                                        generate_fn=generate_fn, tokenizer=tokenizer)
    ids = [chat_prompt_ids(tokenizer, p.text) for p in prompt_set.prompts]
    kept = [x for x in ids if len(x) <= max_prompt_tokens]
    if len(kept) < len(ids):
        log.info("dropped %d prompts longer than %d tokens", len(ids) - len(kept), max_prompt_tokens)
    return kept, prompt_set


def engine_generate_fn(target, max_new_tokens: int = 96):
    """A train/data.py GenerateFn on our engine: seeded sampling (T=1, top-p 0.95), batch 1."""
    from dflash_trt.engine import EngineConfig, SamplingParams
    from dflash_trt.runtime.factory import torch_engine

    engine = torch_engine(target, None, EngineConfig(speculative=False, max_batch_size=1, max_seq_len=512))

    def generate(prefix: list[int], seed: int) -> list[int]:
        params = SamplingParams(temperature=1.0, top_p=0.95, seed=seed, max_new_tokens=max_new_tokens)
        return engine.generate([prefix], params)[0].tokens

    return generate


def run(args: argparse.Namespace) -> int:
    import torch

    from dflash_trt.runtime.factory import load_tokenizer
    from dflash_trt.train.data import DataRecipe
    from dflash_trt.train.trainer import TrainConfig, Trainer

    prompt_files = _prompt_files(args)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    target_dir = args.target
    if target_dir is None:
        from dflash_trt.commands.common import cache_dir
        from dflash_trt.models.smollm2 import ensure_default_target

        target_dir = ensure_default_target(cache_dir(args))
    if prompt_files is None:
        tokenizer = load_tokenizer(target_dir)
        if tokenizer is None or tokenizer.chat_template is None:
            raise InputError(f"{target_dir} has no tokenizer with a chat template; training prompts need one")
    work = args.work_dir or args.output.with_name(args.output.name + ".work")
    config = TrainConfig(
        target=Path(target_dir), output=args.output, work_dir=work, data_dir=args.data_dir,
        drafter_init=args.drafter_init, continue_from=args.continue_from, grow_layers=args.grow_layers, num_layers=args.layers, target_layer_ids=parse_target_layer_ids(args.target_layer_ids),
        block_size=args.block_size, intermediate_size=args.intermediate_size, mask_token_id=args.mask_token_id,
        steps=args.steps, lr=args.lr, warmup_ratio=args.warmup_ratio,
        lr_schedule=args.lr_schedule, decay_ratio=args.decay_ratio, weight_decay=args.weight_decay,
        grad_clip=args.grad_clip, gamma=args.gamma, batch_size=args.batch_size, anchors_per_seq=args.anchors,
        max_new_tokens=args.max_new_tokens, regen_batch_size=args.regen_batch_size, max_seq_len=args.max_seq_len,
        eval_every=args.eval_every, eval_tokens=args.eval_tokens, save_every=args.save_every,
        save_dtype=args.save_dtype, seed=args.seed, resume=args.resume, progress=not args.no_progress,
        init=args.init, kd_weight=args.kd_weight, topk=args.topk, heldout_every=args.heldout_every,
        train_vocab=args.train_vocab, train_vocab_from=args.train_vocab_from,
        loss_weighting=args.loss_weighting, bf16=args.bf16)
    if prompt_files is not None:
        return _run_on_prompt_files(config, prompt_files, args)
    recipe = DataRecipe(seed=args.seed, stdlib_limit=args.num_prompts, self_prompt_count=args.self_prompts)
    target = None
    if args.self_prompts:
        from dflash_trt.models.target import load_native_target

        target = load_native_target(Path(target_dir))
    ids, prompt_set = training_prompts(tokenizer, recipe, target, args.max_prompt_tokens)
    if len(ids) <= args.eval_prompts:
        raise ConfigError(f"only {len(ids)} usable prompts; raise --num-prompts or --max-prompt-tokens")
    held_out, train_ids = ids[: args.eval_prompts], ids[args.eval_prompts:]
    recipe_doc = {"recipe": prompt_set.recipe.to_dict(), "counts": prompt_set.counts,
                  "exclusion": {k: v for k, v in prompt_set.exclusion.to_dict().items() if k != "dropped_ids"},
                  "max_prompt_tokens": args.max_prompt_tokens, "train_prompts": len(train_ids),
                  "eval_prompts_held_out": len(held_out)}
    trainer = Trainer(config, train_ids, held_out, recipe_doc)
    trainer.run()
    evals = trainer.state.evals
    print(f"trained {trainer.state.step} steps in {trainer.state.wall_s:.0f} s; "
          f"eval tau {evals[-1][1]:.2f}" if evals else f"trained {trainer.state.step} steps", file=sys.stderr)
    print(str(config.output))
    return 0


def _prompt_files(args: argparse.Namespace) -> tuple[list[Path], list[Path]] | None:
    """(train files, held-out files) when --prompts is used; every cheap check before a model loads."""
    held = args.heldout_prompts or []
    if args.heldout_every and not held:
        raise ConfigError("--heldout-every needs --heldout-prompts (a split of the training prompts)")
    if not args.prompts:
        if held:
            raise ConfigError("--heldout-prompts goes with --prompts")
        return None
    if args.self_prompts:
        raise ConfigError("--self-prompts builds the built-in recipe; with --prompts, put self-prompts in a prompt file")
    for f in [*args.prompts, *held]:
        if not f.is_file():
            raise InputError(f"prompt file {f} does not exist" if not f.exists() else f"{f} is not a file")
    return list(args.prompts), list(held)


def _run_on_prompt_files(config, files: tuple[list[Path], list[Path]], args: argparse.Namespace) -> int:
    from dflash_trt.train.mix import read_prompts
    from dflash_trt.train.trainer import Trainer

    train_files, held_files = files
    train = [list(p.ids) for f in train_files for p in read_prompts(f)]
    held = [list(p.ids) for f in held_files for p in read_prompts(f)]
    if not train:
        raise InputError(f"no prompts in {', '.join(map(str, train_files))}")
    overlap = {tuple(x) for x in train} & {tuple(x) for x in held}
    if overlap:
        raise ConfigError(f"{len(overlap)} held-out prompts are also training prompts: the split must be disjoint")
    recipe_doc = {"prompt_files": [str(f) for f in train_files], "heldout_files": [str(f) for f in held_files],
                  "train_prompts": len(train), "heldout_prompts": len(held)}
    trainer = Trainer(config, train, held[: args.eval_prompts], recipe_doc, heldout_prompts=held)
    trainer.run()
    best = trainer.state.best
    print(f"trained {trainer.state.step} steps in {trainer.state.wall_s:.0f} s"
          + (f"; best held-out accept length {best[1]:.3f} at step {best[0]} ({config.work_dir / 'best'})"
             if best else ""), file=sys.stderr)
    print(str(config.output))
    return 0
