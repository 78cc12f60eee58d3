"""`dflash-trt train`: fit a DFlash drafter to a target (paper recipe; FACTS.md "Training").

The run, as numbered in `Trainer.run`:
  1. data: the target regenerates greedy responses to the prompts on our batched engine, taps
     recorded on the way (regen.py; cached in shards under `data_dir`);
  2. drafter: fresh (Qwen3-style layers at the target's width) or `drafter_init`; the target,
     its embedding and lm_head stay frozen and are not part of the drafter checkpoint;
  3. steps: random anchors in the responses -> block-sparse forward -> position-weighted CE
     (features.py, loss.py); AdamW, cosine LR with warmup (or warmup-stable-decay, `lr_schedule`
     "wsd", which also keeps the last full-LR state as `work_dir/stable` for a later run to
     `continue_from` without re-warming), grad-norm clip; with `bf16`, the
     forward and backward run under bf16 autocast (mixed precision: fp32 master weights and
     optimizer state; held-out metrics and eval stay fp32);
  4. a progress bar with loss, the in-batch acceptance length and a periodic eval tau (the real
     engine, greedy, on held-out prompts); checkpoints every `save_every` steps, written
     atomically (a new step directory, then the `latest.json` pointer), with model, optimizer,
     scheduler, step, RNG states and the data recipe; `resume` continues from the latest one;
     `continue_from` starts a NEW run (new data, steps, schedule) from another run's checkpoint,
     carrying its float32 weights and AdamW moments (`drafter_init` starts from a shipped drafter
     with fresh moments);
     Ctrl-C saves when the state is consistent and never damages the last good checkpoint;
  5. output: the standard DFlash drafter directory (DFlashDrafter.save_pretrained) plus
     training_config.yaml.
"""
from __future__ import annotations

import copy
import json
import logging
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Callable

import torch
from tqdm.auto import tqdm

from dflash_trt.config import (DRAFTER_ARCHITECTURE, DrafterConfig, check_drafter_matches_target,
                               default_target_layer_ids)
from dflash_trt.errors import CheckpointError, ConfigError
from dflash_trt.models.drafter import DRAFT_VOCAB_FILE, DTYPES, DFlashDrafter
from dflash_trt.models.target import load_hf_config, load_native_target
from dflash_trt.models.transformer import head_dim_of
from dflash_trt.engine import EngineConfig, SamplingParams
from dflash_trt.runtime.factory import torch_engine
from dflash_trt.train.features import make_batch
from dflash_trt.train.grow import grow_drafter, grown_config
from dflash_trt.train.loss import WEIGHTINGS, TrainVocab, block_loss, cosine_schedule, default_gamma, wsd_schedule
from dflash_trt.train.regen import Sample, data_key, regenerate
from dflash_trt.train.state import carry_adam_moments, load_checkpoint, load_continuation, read_latest, save_checkpoint
from dflash_trt.train.warm_start import warm_start_from_target

log = logging.getLogger(__name__)

# settings a resumed run must share with the run that wrote the checkpoint
RESUME_FIELDS = ("target", "drafter_init", "continue_from", "grow_layers", "num_layers", "target_layer_ids", "block_size", "intermediate_size",
                 "mask_token_id", "steps", "lr", "lr_schedule", "decay_ratio", "warmup_ratio", "batch_size", "anchors_per_seq", "seed",
                 "init", "kd_weight", "topk", "train_vocab", "train_vocab_from", "loss_weighting")


@dataclass(frozen=True)
class TrainConfig:
    target: Path
    output: Path
    work_dir: Path  # checkpoints/ and (by default) data/
    data_dir: Path | None = None  # regeneration cache (default work_dir/data); may be shared by runs
    drafter_init: Path | None = None  # start from this drafter (its architecture wins)
    grow_layers: int = 0  # with drafter_init: append this many identity-initialized layers (train/grow.py)
    # a previous run's checkpoint (its work dir or a step dir): its float32 weights and AdamW moments carry
    # over; the step count, schedule and data are this run's (architecture from the checkpoint)
    continue_from: Path | None = None
    num_layers: int = 1
    target_layer_ids: tuple[int, ...] | None = None  # None: 3 taps evenly spaced from layer 1 to N-3
    block_size: int = 16
    intermediate_size: int | None = None  # None: the target's
    mask_token_id: int | None = None  # None: vocab_size - 1
    steps: int = 1000
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    lr_schedule: str = "cosine"  # "cosine" | "wsd" (warmup, constant, (1 - sqrt) cooldown: loss.wsd_schedule)
    decay_ratio: float = 0.2  # wsd: share of the steps in the final cooldown
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    gamma: float | None = None  # None: the paper's value for the block size
    batch_size: int = 4  # sequences per step
    anchors_per_seq: int = 16
    max_new_tokens: int = 256  # regenerated response length cap
    regen_batch_size: int = 32
    max_seq_len: int = 1024
    eval_every: int = 200  # 0 = no periodic eval
    eval_tokens: int = 64
    save_every: int = 200
    keep_checkpoints: int = 2
    save_dtype: str = "float32"  # dtype of the output drafter tensors
    seed: int = 0
    resume: bool = False
    progress: bool = True
    init: str = "random"  # "random" | "target": drafter layers copied from the target (train/warm_start.py)
    kd_weight: float = 0.0  # share of the distillation loss (needs topk > 0)
    topk: int = 0  # teacher log-probs recorded per response token during regeneration
    heldout_every: int = 0  # steps between held-out block metrics (0: off)
    train_vocab: int = 0  # >0: the loss runs over the most frequent `train_vocab` data tokens only (speed)
    # "init": the loss runs over the starting drafter's draft vocabulary (drafter_init / continue_from), so a
    # run on a small new data set keeps the vocabulary counted on all earlier data instead of recounting
    train_vocab_from: str = "data"
    loss_weighting: str = "paper"  # slot weights: "paper" exp(-(k-1)/gamma), "prefix" also x P(earlier slots hit) (train/loss.py)
    bf16: bool = False  # bf16 autocast of the training forward/backward; weights and AdamW state stay fp32

    def __post_init__(self) -> None:
        positive = {"num_layers": self.num_layers, "block_size": self.block_size, "steps": self.steps,
                    "batch_size": self.batch_size, "anchors_per_seq": self.anchors_per_seq,
                    "max_new_tokens": self.max_new_tokens, "regen_batch_size": self.regen_batch_size,
                    "save_every": self.save_every, "eval_tokens": self.eval_tokens,
                    "keep_checkpoints": self.keep_checkpoints}
        for name, value in positive.items():
            if value < 1:
                raise ConfigError(f"{name} must be >= 1, got {value}")
        if not 2 <= self.block_size <= 64:
            raise ConfigError(f"block_size must be in [2, 64], got {self.block_size}")
        if not self.lr > 0 or not 0 <= self.warmup_ratio < 1 or self.grad_clip <= 0 or self.weight_decay < 0:
            raise ConfigError("need lr > 0, 0 <= warmup_ratio < 1, grad_clip > 0 and weight_decay >= 0")
        if self.lr_schedule not in ("cosine", "wsd"):
            raise ConfigError(f"lr_schedule must be 'cosine' or 'wsd', got '{self.lr_schedule}'")
        if self.lr_schedule == "wsd" and not (0 < self.decay_ratio <= 1 and self.warmup_ratio + self.decay_ratio <= 1):
            raise ConfigError(f"wsd needs 0 < decay_ratio <= 1 and warmup_ratio + decay_ratio <= 1, got "
                              f"{self.decay_ratio} and {self.warmup_ratio}")
        if self.eval_every < 0:
            raise ConfigError(f"eval_every must be >= 0, got {self.eval_every}")
        if self.init not in ("random", "target"):
            raise ConfigError(f"init must be 'random' or 'target', got '{self.init}'")
        if not 0 <= self.kd_weight <= 1 or self.topk < 0 or self.heldout_every < 0 or self.train_vocab < 0:
            raise ConfigError("need 0 <= kd_weight <= 1, topk >= 0 and heldout_every >= 0")
        if self.loss_weighting not in WEIGHTINGS:
            raise ConfigError(f"loss_weighting must be one of {', '.join(WEIGHTINGS)}, got '{self.loss_weighting}'")
        if self.train_vocab_from not in ("data", "init"):
            raise ConfigError(f"train_vocab_from must be 'data' or 'init', got '{self.train_vocab_from}'")
        if self.train_vocab_from == "init":
            if self.drafter_init is None and self.continue_from is None:
                raise ConfigError("train_vocab_from 'init' keeps the starting drafter's draft vocabulary: set "
                                  "drafter_init or continue_from")
            if self.train_vocab:
                raise ConfigError("train_vocab (a recount on the data) and train_vocab_from 'init' (the starting "
                                  "drafter's vocabulary) both choose the loss vocabulary: give one")
        if self.kd_weight > 0 and self.topk == 0:
            raise ConfigError("kd_weight > 0 distills the target's distribution: set topk (e.g. 16)")
        if self.continue_from is not None and self.drafter_init is not None:
            raise ConfigError("continue_from and drafter_init both choose the starting drafter: give one")
        if self.grow_layers and self.continue_from is not None:
            raise ConfigError("grow_layers adds layers the checkpoint has no optimizer state for: "
                              "grow with drafter_init (fresh moments) instead of continue_from")
        if self.grow_layers and self.drafter_init is None:
            raise ConfigError("grow_layers adds layers to a trained drafter: set drafter_init")
        if self.grow_layers < 0:
            raise ConfigError(f"grow_layers must be >= 0, got {self.grow_layers}")
        if self.save_dtype not in DTYPES:
            raise ConfigError(f"save_dtype must be one of {sorted(DTYPES)}, got '{self.save_dtype}'")

    @property
    def stable_step(self) -> int | None:
        """wsd: the last step at the full learning rate (its state is kept in work_dir/stable)."""
        if self.lr_schedule != "wsd":
            return None
        stable = self.steps - max(1, round(self.decay_ratio * self.steps))
        return stable if stable >= 1 else None  # decay_ratio 1: the cooldown is the whole run

    @property
    def data_root(self) -> Path:
        return self.data_dir if self.data_dir is not None else self.work_dir / "data"

    def to_dict(self) -> dict:
        return {f.name: (str(v) if isinstance(v, Path) else list(v) if isinstance(v, tuple) else v)
                for f in fields(self) for v in [getattr(self, f.name)]}


@dataclass
class TrainState:
    step: int = 0
    losses: list[tuple[int, float]] = field(default_factory=list)  # (step, loss) of every step
    evals: list[tuple[int, float]] = field(default_factory=list)  # (step, eval tau)
    heldout: list[tuple[int, float, float]] = field(default_factory=list)  # (step, loss, block accept length)
    best: tuple[int, float] | None = None  # (step, held-out accept length) of the best checkpoint so far
    wall_s: float = 0.0  # training time so far, all sessions


def drafter_config_dict(target_config, target_layer_ids: tuple[int, ...], num_layers: int, block_size: int,
                        intermediate_size: int, mask_token_id: int, dtype: str) -> dict:
    """A DFlash drafter config.json at the target's width, heads and RoPE."""
    heads, kv = target_config.num_attention_heads, target_config.num_key_value_heads
    head_dim = head_dim_of(target_config)
    return {
        "architectures": [DRAFTER_ARCHITECTURE], "model_type": "qwen3", "block_size": block_size,
        "num_target_layers": target_config.num_hidden_layers,
        "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": list(target_layer_ids)},
        "hidden_size": target_config.hidden_size, "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers, "num_attention_heads": heads, "num_key_value_heads": kv,
        "head_dim": head_dim, "rms_norm_eps": target_config.rms_norm_eps,
        "vocab_size": target_config.vocab_size, "max_position_embeddings": target_config.max_position_embeddings,
        "attention_bias": False, "rope_theta": float(target_config.rope_parameters["rope_theta"]),
        "tie_word_embeddings": False, "torch_dtype": dtype,
    }


def new_drafter(cfg: DrafterConfig, seed: int) -> DFlashDrafter:
    """Random init: linear weights N(0, 0.02) (the Qwen3 initializer range), norms 1."""
    gen = torch.Generator().manual_seed(seed)
    model = DFlashDrafter(cfg).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
            else:
                p.fill_(1.0)
    return model


def cpu_has_native_bf16() -> bool:
    """Whether this CPU runs bf16 matmuls natively (AVX512-BF16 or AMX), as oneDNN reports it."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch build without oneDNN
        return False


@torch.no_grad()
def evaluate_tau(target, drafter: DFlashDrafter, prompts: list[list[int]], max_new_tokens: int) -> float:
    """Mean acceptance length (committed tokens per verify step) of greedy DFlash on `prompts`, verifying
    whole blocks (tau as the paper counts it, whatever the device's draft-confidence default)."""
    longest = max(len(p) for p in prompts) + max_new_tokens
    engine = torch_engine(target, drafter, EngineConfig(max_batch_size=len(prompts), max_seq_len=longest,
                                                        draft_confidence=0.0))
    results = engine.generate(prompts, SamplingParams(max_new_tokens=max_new_tokens))
    steps = [st for r in results for st in r.steps]
    return sum(st.accepted + 1 for st in steps) / max(len(steps), 1)


class Trainer:
    def __init__(self, config: TrainConfig, prompts: list[list[int]], eval_prompts: list[list[int]],
                 data_recipe: dict | None = None, heldout_prompts: list[list[int]] | None = None) -> None:
        if not prompts:
            raise ConfigError("no training prompts")
        self.config, self.prompts, self.eval_prompts = config, prompts, eval_prompts
        self.heldout_prompts = heldout_prompts or []
        self.heldout: list = []
        self.data_recipe = json.loads(json.dumps(data_recipe or {}))  # plain lists/dicts (YAML, torch.load)
        self.ckpt_root = config.work_dir / "checkpoints"
        self.target = load_native_target(config.target, torch.float32)
        self.target.requires_grad_(False)
        # continue_from: the checkpoint is read and checked now, before any slow data work
        self.carried = load_continuation(config.continue_from) if config.continue_from is not None else None
        self.drafter_cfg = self._drafter_config()
        check_drafter_matches_target(self.drafter_cfg, self.target.info)
        if config.train_vocab_from == "init":  # checked now, before any slow data work
            has_vocab = (self.carried.drafter.draft_vocab is not None if self.carried is not None
                         else (Path(config.drafter_init) / DRAFT_VOCAB_FILE).is_file())
            if not has_vocab:
                raise ConfigError("train_vocab_from 'init': the starting drafter has no draft vocabulary "
                                  f"({DRAFT_VOCAB_FILE}); use train_vocab N to count one on the data")
        self.state = TrainState()
        self.samples: list[Sample] = []

    # ---- setup -------------------------------------------------------------------------------
    def _drafter_config(self) -> DrafterConfig:
        c, tcfg = self.config, load_hf_config(self.config.target)
        if self.carried is not None:
            log.info("architecture from --continue-from %s (layer/tap/block flags are not used)", self.carried.path)
            return self.carried.drafter.cfg
        if c.drafter_init is not None:
            log.info("architecture from --drafter-init %s (layer/tap/block flags are not used)", c.drafter_init)
            cfg = DrafterConfig.load(c.drafter_init)
            return grown_config(cfg, c.grow_layers) if c.grow_layers else cfg
        layer_ids = c.target_layer_ids or tuple(default_target_layer_ids(tcfg.num_hidden_layers, 3))
        mask = c.mask_token_id if c.mask_token_id is not None else tcfg.vocab_size - 1
        raw = drafter_config_dict(tcfg, layer_ids, c.num_layers, c.block_size,
                                  c.intermediate_size or tcfg.intermediate_size, mask, c.save_dtype)
        return DrafterConfig.from_dict(raw, where="training drafter config")

    def prepare_data(self) -> list[Sample]:
        c, layer_ids = self.config, self.drafter_cfg.target_layer_ids
        key = data_key(c.target, c.max_new_tokens, layer_ids)
        kw = dict(key=key, max_new_tokens=c.max_new_tokens, batch_size=c.regen_batch_size,
                  max_seq_len=c.max_seq_len, progress=c.progress, topk=c.topk, lazy=True)
        samples = regenerate(self.target, self.prompts, layer_ids, c.data_root / f"regen-{key[:16]}", **kw)
        usable = [s for s in samples if s.response_len >= 2]
        if not usable:
            raise ConfigError("no regenerated response has 2 or more tokens: raise max_new_tokens")
        self.samples = usable
        if self.heldout_prompts:
            held = regenerate(self.target, self.heldout_prompts, layer_ids, c.data_root / f"regen-{key[:16]}", **kw)
            self.heldout = [s for s in held if s.response_len >= 2]
        return usable

    def _build(self):
        c = self.config
        if self.carried is not None:
            drafter = copy.deepcopy(self.carried.drafter).train()
        elif c.drafter_init is not None:
            drafter = DFlashDrafter.from_pretrained(c.drafter_init, torch.float32).train()
            if c.grow_layers:
                drafter = grow_drafter(drafter, c.grow_layers)
                log.info("grew the drafter to %d layers (new layers start as the identity)", len(drafter.layers))
        else:
            drafter = new_drafter(self.drafter_cfg, c.seed).train()
            if c.init == "target":
                used = warm_start_from_target(drafter, self.target)
                log.info("drafter layers initialized from target layers %s", used)
        opt = torch.optim.AdamW(drafter.parameters(), lr=c.lr, betas=(0.9, 0.95), weight_decay=c.weight_decay)
        warmup = max(1, round(c.warmup_ratio * c.steps))
        if c.stable_step is None:
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: cosine_schedule(s, c.steps, warmup))
        else:
            decay = c.steps - c.stable_step
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: wsd_schedule(s, c.steps, warmup, decay))
        if self.carried is not None:
            carry_adam_moments(opt, self.carried)
        gen = torch.Generator().manual_seed(c.seed)
        return drafter, opt, sched, gen

    # ---- checkpoints ---------------------------------------------------------------------------
    def latest_checkpoint(self) -> Path | None:
        return read_latest(self.ckpt_root)

    @property
    def stable_root(self) -> Path:
        return self.config.work_dir / "stable"

    def save_checkpoint(self, drafter, opt, sched, gen, stable: bool = False) -> Path:
        root, keep = (self.stable_root, 1) if stable else (self.ckpt_root, self.config.keep_checkpoints)
        return save_checkpoint(root, self.state.step, drafter, {
            "optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "generator": gen.get_state(),
            "torch_rng": torch.get_rng_state(), "state": asdict(self.state), "config": self.config.to_dict(),
            "data_recipe": self.data_recipe}, keep)

    def _restore(self, drafter, opt, sched, gen) -> None:
        path = self.latest_checkpoint()
        if path is None:
            raise CheckpointError(f"--resume: no checkpoint in {self.ckpt_root}; start without --resume")
        weights, extra = load_checkpoint(path)
        saved = extra["config"]
        now = self.config.to_dict()
        defaults = {f.name: f.default for f in fields(TrainConfig)}  # fields newer than the checkpoint
        diff = [k for k in RESUME_FIELDS if saved.get(k, defaults[k]) != now[k]]
        if diff:
            raise ConfigError(f"--resume: the checkpoint in {path} was made with different {diff}: "
                              "use the same settings or a fresh --work-dir")
        drafter.load_state_dict(weights, strict=True)
        opt.load_state_dict(extra["optimizer"])
        sched.load_state_dict(extra["scheduler"])
        gen.set_state(extra["generator"])
        torch.set_rng_state(extra["torch_rng"])
        s = extra["state"]
        self.state = TrainState(step=s["step"], losses=[tuple(x) for x in s["losses"]],
                                evals=[tuple(x) for x in s["evals"]], wall_s=s["wall_s"],
                                heldout=[tuple(x) for x in s.get("heldout", [])],
                                best=tuple(s["best"]) if s.get("best") else None)

    # ---- the run -------------------------------------------------------------------------------
    def run(self, on_step: Callable[[int, float], None] | None = None) -> DFlashDrafter:
        """Train to `steps` and write the output; returns the trained drafter (float32).

        on_step(step, loss) is called after every completed step (progress hooks, tests)."""
        c = self.config
        if c.bf16 and self.target.device.type == "cpu" and not cpu_has_native_bf16():
            log.warning("--bf16 on a CPU without native bf16 matmul (oneDNN reports none; AVX2 without "
                        "AVX512-BF16 or AMX): autocast then runs emulated bf16 kernels, measured 25x slower per step "
                        "than float32 on a 2-core AVX2 machine; drop --bf16 here")
        # 1. data
        if not self.samples:
            self.prepare_data()
        # 2. drafter, optimizer, schedule (restored on resume)
        drafter, opt, sched, gen = self._build()
        if c.resume:
            self._restore(drafter, opt, sched, gen)
        elif self.latest_checkpoint() is not None:
            raise ConfigError(f"{self.ckpt_root} already holds checkpoints: pass --resume to continue, "
                              "or use a fresh --work-dir")
        gamma = c.gamma or default_gamma(self.drafter_cfg.block_size)
        if c.train_vocab_from == "init":
            vocab = TrainVocab.build(self.target.lm_head.weight, drafter.draft_vocab)
            log.info("training loss over the starting drafter's draft vocabulary (%d tokens)", vocab.ids.numel())
        else:
            vocab = self.train_vocab() if c.train_vocab else None
        # the drafter proposes what it was trained on: its draft vocabulary is the loss's (None: all tokens)
        drafter.set_draft_vocab(vocab.ids if vocab is not None else None)
        bar = tqdm(total=c.steps, initial=self.state.step, desc="train", unit="step", disable=not c.progress,
                   mininterval=1.0)
        consistent, start = True, time.perf_counter()
        eval_tau = self.state.evals[-1][1] if self.state.evals else None
        try:
            if c.eval_every and self.eval_prompts and self.state.step == 0:
                eval_tau = self._eval(drafter)
            if c.heldout_every and self.heldout and self.state.step == 0:
                self._heldout_eval(drafter, gamma)  # the starting point (a --drafter-init run's baseline)
            # 3. steps
            while self.state.step < c.steps:
                idx = torch.randint(len(self.samples), (c.batch_size,), generator=gen).tolist()
                batch = make_batch([self.samples[i].load() for i in idx], c.anchors_per_seq,
                                   self.drafter_cfg.block_size, self.drafter_cfg.mask_token_id, gen)
                with torch.autocast(self.target.device.type, dtype=torch.bfloat16, enabled=c.bf16):
                    out = block_loss(drafter, self.target, batch, gamma, c.kd_weight, vocab, c.loss_weighting)
                opt.zero_grad(set_to_none=True)
                out.loss.backward()
                torch.nn.utils.clip_grad_norm_(drafter.parameters(), c.grad_clip)
                consistent = False
                opt.step()
                sched.step()
                self.state.step += 1
                self.state.losses.append((self.state.step, float(out.loss.detach())))
                consistent = True
                # 4. progress, eval, checkpoints
                step = self.state.step
                if c.eval_every and self.eval_prompts and (step % c.eval_every == 0 or step == c.steps):
                    eval_tau = self._eval(drafter)
                if self.heldout and (c.heldout_every and (step % c.heldout_every == 0 or step == c.steps)
                                     or step == c.stable_step):
                    self._heldout_eval(drafter, gamma)
                post = {"loss": f"{float(out.loss.detach()):.3f}", "acc_len": f"{out.accept_len:.2f}",
                        "lr": f"{sched.get_last_lr()[0]:.1e}"}
                if eval_tau is not None:
                    post["tau"] = f"{eval_tau:.2f}"
                bar.set_postfix(post)
                bar.update(1)
                regular = step % c.save_every == 0 or step == c.steps
                if regular or step == c.stable_step:  # every saved state carries the time spent so far
                    self.state.wall_s += time.perf_counter() - start
                    start = time.perf_counter()
                if regular:
                    self.save_checkpoint(drafter, opt, sched, gen)
                if step == c.stable_step:
                    path = self.save_checkpoint(drafter, opt, sched, gen, stable=True)
                    log.info("step %d, the last at the full learning rate: kept in %s (a later run can "
                             "--continue-from it without re-warming)", step, path)
                if on_step is not None:
                    on_step(step, float(out.loss.detach()))
        except KeyboardInterrupt:
            bar.close()
            if consistent and self.state.step > 0:
                self.state.wall_s += time.perf_counter() - start
                path = self.save_checkpoint(drafter, opt, sched, gen)
                log.warning("interrupted at step %d; saved %s (continue with --resume)", self.state.step, path)
            raise
        bar.close()
        # 5. output
        self.write_output(drafter)
        return drafter

    def train_vocab(self) -> TrainVocab:
        """The `train_vocab` most frequent token ids of the training sequences (prompts and responses)."""
        counts = torch.zeros(self.target.info.vocab_size, dtype=torch.long)
        for s in self.samples:
            counts += torch.bincount(s.tokens, minlength=counts.numel())
        ids = counts.argsort(descending=True)[: self.config.train_vocab]
        ids = ids[counts[ids] > 0]
        covered = float(counts[ids].sum()) / max(int(counts.sum()), 1)
        log.info("training loss over %d tokens covering %.4f of the data's tokens", ids.numel(), covered)
        return TrainVocab.build(self.target.lm_head.weight, ids)

    @torch.no_grad()
    def heldout_metrics(self, drafter: DFlashDrafter, gamma: float, anchors: int = 64) -> tuple[float, float]:
        """(CE loss, block accept length) on the held-out samples over the full vocabulary; fixed
        anchors, so comparable across steps and runs."""
        gen = torch.Generator().manual_seed(1234)
        bs, mask = self.drafter_cfg.block_size, self.drafter_cfg.mask_token_id
        loss_sum = acc_sum = weight = 0.0
        was_training = drafter.training
        drafter.eval()
        for i in range(0, len(self.heldout), 4):
            batch = make_batch([s.load() for s in self.heldout[i:i + 4]], anchors, bs, mask, gen)
            out = block_loss(drafter, self.target, batch, gamma)  # plain CE, full vocabulary: comparable across runs
            n = int(batch.anchor_valid.sum())
            loss_sum += float(out.loss) * n
            acc_sum += out.accept_len * n
            weight += n
        drafter.train(was_training)
        return loss_sum / max(weight, 1), acc_sum / max(weight, 1)

    def _heldout_eval(self, drafter: DFlashDrafter, gamma: float) -> None:
        loss, acc = self.heldout_metrics(drafter, gamma)
        step = self.state.step
        self.state.heldout.append((step, loss, acc))
        log.info("step %d: held-out loss %.4f, block accept length %.3f", step, loss, acc)
        if self.state.best is None or acc > self.state.best[1]:
            self.state.best = (step, acc)
            drafter.save_pretrained(self.config.work_dir / "best", dtype=DTYPES[self.config.save_dtype])

    def _eval(self, drafter: DFlashDrafter) -> float:
        drafter.eval()
        tau = evaluate_tau(self.target, drafter, self.eval_prompts, self.config.eval_tokens)
        drafter.train()
        self.state.evals.append((self.state.step, tau))
        return tau

    def write_output(self, drafter: DFlashDrafter) -> Path:
        import yaml

        c = self.config
        drafter.save_pretrained(c.output, dtype=DTYPES[c.save_dtype])
        tokens = sum(s.tokens.shape[0] for s in self.samples)
        doc = {
            "train_config": c.to_dict(),
            **({"continued_from": {"checkpoint": str(self.carried.path), "step": self.carried.step}}
               if self.carried is not None else {}),
            "drafter": {"num_layers": self.drafter_cfg.num_hidden_layers, "block_size": self.drafter_cfg.block_size,
                        "target_layer_ids": list(self.drafter_cfg.target_layer_ids),
                        "mask_token_id": self.drafter_cfg.mask_token_id,
                        "gamma": c.gamma or default_gamma(self.drafter_cfg.block_size)},
            "data": {"recipe": self.data_recipe, "sequences": len(self.samples), "tokens": tokens,
                     "response_tokens": sum(s.response_len for s in self.samples)},
            "results": {"steps": self.state.step, "wall_s": round(self.state.wall_s, 1),
                        "heldout": [[st, round(lo, 4), round(ac, 4)] for st, lo, ac in self.state.heldout],
                        "best": list(self.state.best) if self.state.best else None,
                        **({"stable_checkpoint": {"dir": str(self.stable_root), "step": c.stable_step}}
                           if c.stable_step is not None and self.state.step >= c.stable_step else {}),
                        "final_loss": self.state.losses[-1][1] if self.state.losses else None,
                        "eval_tau": [[s, round(t, 3)] for s, t in self.state.evals]},
        }
        tmp = c.output / ".training_config.yaml.tmp"
        tmp.write_text(yaml.safe_dump(doc, sort_keys=False))
        tmp.replace(c.output / "training_config.yaml")
        return c.output


