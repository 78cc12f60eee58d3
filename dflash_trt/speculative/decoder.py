"""The DFlash decode loop over a ragged batch (the torch backend's engine core).

One step for the whole batch, as numbered in `DFlashEngine.step`:
  1. build each row's block [pending token, mask, ...] at its own absolute positions;
  2. ONE drafter forward for all rows (new context features + block) -> draft tokens; with n-gram
     lookup on (speculative/ngram.py), rows whose history repeats itself take the lookup's draft
     instead, and a step where every row does skips the drafter forward;
  3. ONE target forward for all rows over the blocks -> logits and tapped hidden states;
  4. acceptance per row (speculative/verify.py): longest prefix equal to the target's choices + bonus;
  5. commit: emit tokens with stop checks, crop both caches to each row's committed length,
     keep the accepted positions' target hidden states as the drafter's next context.
With the drafter disabled (`speculative=False`) the same loop is plain autoregressive decoding on the
same target engine (block of one token), the fair baseline.
Rows join (prefill) and leave (finish or cancel) between steps; caches stay compact.
"""
from __future__ import annotations

import logging
import time
from typing import Callable, Sequence as Seq

import torch

from dflash_trt.config import check_drafter_matches_target
from dflash_trt.engine import (EngineConfig, GenerationResult, SamplingParams, Sequence, StepOutput, StepStat, Target,
                               check_request, run_to_completion, stamp_finished)
from dflash_trt.errors import ConfigError, InputError
from dflash_trt.models.drafter import DFlashDrafter
from dflash_trt.speculative.draft_head import DraftHead
from dflash_trt.speculative.draft_len import check_schedule, confident_lengths, scheduled_drafts
from dflash_trt.speculative.ngram import lookup_continuation
from dflash_trt.speculative.sampling import inverse_cdf, new_generator, processed_probs
from dflash_trt.speculative.verify import accept_rejection, accept_tokens

log = logging.getLogger(__name__)


class DFlashEngine:
    """The torch backend's `Engine` (dflash_trt/engine.py) over a `Target` and a DFlash drafter."""

    def __init__(self, target: Target, drafter: DFlashDrafter | None, config: EngineConfig = EngineConfig(),
                 detokenize: Callable[[list[int]], str] | None = None) -> None:
        config = config.on_device(target.device.type)
        self.target, self.drafter, self.config = target, drafter, config
        self.info = target.info
        self.speculative = config.speculative and drafter is not None and config.block_size != 1
        if config.speculative and drafter is None and config.block_size not in (None, 1):
            raise ConfigError("speculative decoding needs a drafter (or run with speculative=False)")
        if drafter is not None:
            check_drafter_matches_target(drafter.cfg, self.info)
        self.block_size = (config.block_size or drafter.block_size) if self.speculative else 1
        if self.speculative and config.draft_len_schedule is not None:
            check_schedule(config.draft_len_schedule, self.block_size - 1)
        if config.max_seq_len > self.info.max_position_embeddings:
            raise ConfigError(
                f"max_seq_len {config.max_seq_len} exceeds the target's context "
                f"({self.info.max_position_embeddings} positions)"
            )
        self.detokenize = detokenize
        self.device = target.device
        capacity = config.max_seq_len + self.block_size
        self.tcache = target.new_cache(config.max_batch_size, capacity)
        self.dcache = drafter.new_cache(config.max_batch_size, capacity) if self.speculative else None
        vocab = drafter.draft_vocab if self.speculative and config.draft_vocab else None
        self.draft_head = DraftHead(target, vocab)
        self.active: list[Sequence] = []
        self._ids = 0

    # ---- admission ------------------------------------------------------------------------
    def make_sequence(self, prompt: Seq[int], params: SamplingParams, request_id: str | None = None) -> Sequence:
        """Validate a request and resolve its limits (does not schedule it)."""
        prompt, max_new = check_request(prompt, params, self.info.vocab_size, self.config.max_seq_len,
                                        self.detokenize is not None)
        self._ids += 1
        return Sequence(request_id=request_id or f"req-{self._ids}", prompt=prompt, params=params,
                        max_new_tokens=max_new, generator=new_generator(params.seed))

    @property
    def free_rows(self) -> int:
        return self.config.max_batch_size - len(self.active)

    @torch.inference_mode()
    def add(self, seqs: list[Sequence]) -> list[StepOutput]:
        """Prefill new sequences in one target forward; each emits its first token."""
        if not seqs:
            return []
        if len(seqs) > self.free_rows:
            raise InputError(f"{len(seqs)} sequences do not fit: {self.free_rows} free rows")
        rows = self.tcache.add_rows(len(seqs))
        if self.dcache is not None:
            self.dcache.add_rows(len(seqs))
        lens = torch.tensor([len(s.prompt) for s in seqs])
        width = int(lens.max())
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        pos = torch.full((len(seqs), width), self.tcache.dead_slot, dtype=torch.long)
        for i, s in enumerate(seqs):
            s.row = rows[i]
            ids[i, : len(s.prompt)] = torch.tensor(s.prompt)
            pos[i, : len(s.prompt)] = torch.arange(len(s.prompt))
        ids, pos, lens = ids.to(self.device), pos.to(self.device), lens.to(self.device)
        row_slice = slice(rows.start, rows.stop)
        layer_ids = self.drafter.cfg.target_layer_ids if self.speculative else ()
        out = self.target.forward(self.tcache, row_slice, ids, pos, layer_ids, logit_index=(lens - 1)[:, None])
        self.tcache.crop(lens, row_slice)
        first = self._choose(out.logits, seqs)[:, 0].tolist()  # [B]
        outputs = []
        now = time.perf_counter()
        for i, s in enumerate(seqs):
            s.start, s.pending, s.first_token_s = len(s.prompt), first[i], now
            if self.speculative:
                s.ctx_hidden, s.ctx_pos = out.target_hidden[i, : len(s.prompt)], 0
            self.active.append(s)
            outputs.append(StepOutput(s, self._emit(s, [first[i]])))
        self._retire()
        return outputs

    # ---- one decode step -------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        seqs = list(self.active)
        if not seqs:
            return []
        n, t = len(seqs), self.block_size
        rows = slice(0, n)
        # 1. blocks at each row's positions
        start = torch.tensor([s.start for s in seqs])  # [B]
        block_pos = start[:, None] + torch.arange(t)[None, :]  # [B, T]
        mask_id = self.drafter.mask_token_id if self.speculative else 0
        block = torch.full((n, t), mask_id, dtype=torch.long)
        block[:, 0] = torch.tensor([s.pending for s in seqs])
        start, block_pos, block = start.to(self.device), block_pos.to(self.device), block.to(self.device)
        draft_probs = None
        lens = torch.zeros(n, dtype=torch.long, device=self.device)  # drafts verified per row
        # 2. one drafter forward (skipped when the batch-size schedule allows no drafts, or when every
        #    row drafts by n-gram lookup)
        drafts = scheduled_drafts(self.config.draft_len_schedule, n, t - 1) if self.speculative else 0
        lookups = self._lookups(seqs, drafts)  # per row: n-gram continuation, [] where none
        drafted = bool(drafts) and not all(lookups)
        if drafted:
            hidden = self._draft_forward(seqs, block, block_pos, rows)
            draft_logits = self.draft_head(hidden[:, 1:])  # [B, K, V]
            block[:, 1:], draft_probs = self._propose(draft_logits, seqs)
            lens = self._draft_lengths(draft_logits, drafts)
        for i, cont in enumerate(lookups):
            if cont:
                block[i, 1 : 1 + len(cont)] = torch.tensor(cont, device=self.device)
                lens[i] = len(cont)
        if drafts:
            t = int(lens.max()) + 1  # verify only as far as the longest kept draft
            block, block_pos = block[:, :t], block_pos[:, :t]
            draft_probs = draft_probs[:, : t - 1] if draft_probs is not None else None
        else:
            block, block_pos = block[:, :1], block_pos[:, :1]
        # 3. one target forward
        layer_ids = self.drafter.cfg.target_layer_ids if self.speculative else ()
        out = self.target.forward(self.tcache, rows, block, block_pos, layer_ids)
        # 4. acceptance
        accepted, bonus = self._accept(block, start, out.logits, draft_probs, seqs, lens)
        # 5. commit
        self.tcache.crop(start + accepted + 1)
        outputs = []
        accepted_l, bonus_l, block_l, lens_l = accepted.tolist(), bonus.tolist(), block.tolist(), lens.tolist()
        for i, s in enumerate(seqs):
            a = accepted_l[i]
            s.steps.append(StepStat(draft_tokens=lens_l[i], accepted=a, lookup=bool(lookups[i])))
            if self.speculative:
                new_ctx = out.target_hidden[i, : a + 1]
                if drafted:  # the drafter consumed the pending context this step
                    s.ctx_hidden, s.ctx_pos = new_ctx, s.start
                else:  # no drafter forward: the context waits for the next one
                    s.ctx_hidden = torch.cat([s.ctx_hidden, new_ctx])
            s.start += a + 1
            s.pending = bonus_l[i]
            outputs.append(StepOutput(s, self._emit(s, block_l[i][1 : a + 1] + [s.pending])))
        self._retire()
        return outputs

    def _lookups(self, seqs, drafts: int) -> list[list[int]]:
        """Per row, the n-gram lookup's draft (speculative/ngram.py), at most `drafts` tokens; [] where
        lookup is off, finds no match, or the row samples with rejection acceptance (which needs q)."""
        min_match = self.config.ngram_lookup
        if not (drafts and min_match):
            return [[] for _ in seqs]
        rejection = self.config.acceptance == "rejection"
        return [[] if rejection and not s.params.greedy else
                lookup_continuation(s.prompt + s.tokens, min_match, drafts)  # s.tokens ends with s.pending
                for s in seqs]

    def _draft_forward(self, seqs, block, block_pos, rows) -> torch.Tensor:
        width = max(s.ctx_hidden.shape[0] for s in seqs)
        feat = seqs[0].ctx_hidden.shape[-1]
        ctx = torch.zeros(len(seqs), width, feat, dtype=seqs[0].ctx_hidden.dtype, device=self.device)
        slots = torch.full((len(seqs), width), self.dcache.dead_slot, dtype=torch.long)
        for i, s in enumerate(seqs):
            c = s.ctx_hidden.shape[0]
            ctx[i, :c] = s.ctx_hidden
            slots[i, :c] = torch.arange(s.ctx_pos, s.ctx_pos + c)
        hidden = self.drafter(self.dcache, rows, ctx, slots.to(self.device), self.target.embed(block), block_pos)
        self.dcache.crop(block_pos[:, 0].clone())  # keep context only: block K/V are dropped
        return hidden

    def _sampled_rows(self, seqs) -> list[int]:
        return [i for i, s in enumerate(seqs) if not s.params.greedy]

    def _params(self, seqs, idx):
        sel = [seqs[i].params for i in idx]
        dev = self.device
        return (torch.tensor([p.temperature for p in sel], dtype=torch.float64, device=dev),
                torch.tensor([p.top_k for p in sel], device=dev),
                torch.tensor([p.top_p for p in sel], dtype=torch.float64, device=dev))

    def _uniforms(self, seqs, idx, count: int, width: int | None = None) -> torch.Tensor:
        """[len(idx), count] uniforms, each row's from its own generator. Each row draws `width` (default
        `count`) and uses the first `count`: a fixed width keeps a row's random stream, and so a seeded
        row's tokens, independent of how far the other rows of the batch verify this step (the verify
        width is the batch's longest kept draft, EngineConfig.draft_confidence / ngram_lookup)."""
        width = count if width is None else max(width, count)
        draws = [torch.rand(width, generator=seqs[i].generator, dtype=torch.float64)[:count] for i in idx]  # CPU generators
        return torch.stack(draws).to(self.device)

    def _choose(self, logits: torch.Tensor, seqs, width: int | None = None) -> torch.Tensor:
        """The target's choice at every position: argmax, or a sample for sampled rows. [B, T].
        `width`: uniforms each sampled row draws (see _uniforms; default T)."""
        tokens = logits.argmax(-1)
        idx = self._sampled_rows(seqs)
        if idx:
            probs = processed_probs(logits[idx], *self._params(seqs, idx))
            tokens[idx] = inverse_cdf(probs, self._uniforms(seqs, idx, logits.shape[1], width))
        return tokens

    def _propose(self, draft_logits, seqs):
        """Draft tokens: the drafter's argmax; in 'rejection' mode sampled rows draw from q."""
        drafts = draft_logits.argmax(-1)
        idx = self._sampled_rows(seqs)
        if self.config.acceptance != "rejection" or not idx:
            return drafts, None
        q = processed_probs(draft_logits[idx], *self._params(seqs, idx))
        drafts[idx] = inverse_cdf(q, self._uniforms(seqs, idx, draft_logits.shape[1]))
        return drafts, q

    def _draft_lengths(self, draft_logits, cap: int) -> torch.Tensor:
        """[B] drafts to verify per row (speculative/draft_len.py), from the proposal's logits."""
        return confident_lengths(draft_logits, self.config.draft_confidence, cap)

    def _accept(self, block, start, logits, draft_probs, seqs, lens):
        """Greedy / exact-sampling rows go through the batched acceptance kernel (Triton on CUDA,
        its torch reference, speculative.verify.accept_prefix, elsewhere); rejection-mode rows through
        speculative.verify.accept_rejection."""
        n, k = block.shape[0], block.shape[1] - 1
        if draft_probs is None:
            acc = accept_tokens(block[:, 1:], self._choose(logits, seqs, width=self.block_size), lens, start)
            return acc.accepted, acc.bonus
        idx = self._sampled_rows(seqs)
        greedy = [i for i in range(n) if i not in idx]
        accepted = torch.zeros(n, dtype=torch.long, device=self.device)
        bonus = torch.zeros(n, dtype=torch.long, device=self.device)
        if greedy:
            acc = accept_tokens(block[greedy, 1:], logits[greedy].argmax(-1), lens[greedy], start[greedy])
            accepted[greedy], bonus[greedy] = acc.accepted, acc.bonus
        p = processed_probs(logits[idx], *self._params(seqs, idx))
        acc = accept_rejection(block[idx, 1:], draft_probs, p, lens[idx],
                               self._uniforms(seqs, idx, k, width=self.block_size - 1), self._uniforms(seqs, idx, 1)[:, 0])
        accepted[idx], bonus[idx] = acc.accepted, acc.bonus
        return accepted, bonus

    # ---- stopping and retirement -------------------------------------------------------------
    def _emit(self, s: Sequence, new: list[int]) -> list[int]:
        """Append tokens to a sequence, cutting at EOS / stop ids / stop strings / the limit."""
        stops = set(s.params.stop_token_ids)
        if not s.params.ignore_eos:
            stops.update(self.info.eos_token_ids)
        emitted = []
        for tok in new:
            if len(s.tokens) >= s.max_new_tokens:
                break
            s.tokens.append(tok)
            emitted.append(tok)
            if tok in stops:
                s.finish_reason = "stop"
                break
        if s.params.stop and s.finish_reason is None:
            cut = self._stop_string_cut(s)
            if cut is not None:
                drop = len(s.tokens) - cut
                del s.tokens[cut:]
                emitted = emitted[: max(len(emitted) - drop, 0)]
                s.finish_reason = "stop"
        if s.finish_reason is None and len(s.tokens) >= s.max_new_tokens:
            s.finish_reason = "length"
        return emitted

    def _stop_string_cut(self, s: Sequence) -> int | None:
        text = self.detokenize(s.tokens)
        if not any(stop in text for stop in s.params.stop):
            return None
        for k in range(1, len(s.tokens) + 1):  # shortest prefix that contains a stop string
            if any(stop in self.detokenize(s.tokens[:k]) for stop in s.params.stop):
                return k
        return len(s.tokens)

    def cancel(self, s: Sequence) -> None:
        """Stop a sequence now and free its cache rows."""
        if s.finished:
            return
        s.finish_reason = "cancelled"
        self._retire()

    def _retire(self) -> None:
        for s in stamp_finished(self.active):
            row = s.row  # its index in self.active (list.index would compare dataclass fields)
            moved = self.tcache.remove_row(row)
            if self.dcache is not None:
                self.dcache.remove_row(row)
            last = self.active.pop()
            if moved is not None:
                self.active[row] = last
                last.row = row
        for i, s in enumerate(self.active):
            assert s.row == i, "cache rows and active sequences out of sync"

    # ---- convenience: run requests to completion ---------------------------------------------
    def generate(self, prompts: Seq[Seq[int]], params: SamplingParams | Seq[SamplingParams] = SamplingParams(),
                 progress: Callable[[int], None] | None = None) -> list[GenerationResult]:
        return run_to_completion(self, prompts, params, progress)

    def shutdown(self) -> None:
        """Nothing to release: the caches go with the engine."""
