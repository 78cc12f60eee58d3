"""What one decode step costs: a K-token target verify against a 1-token step, and the draft.

DFlash's speedup at batch 1 is about tau * t(1) / (t_verify(K + 1) + t_draft): the acceptance
length times a plain step, over the cost of one drafter forward plus one target forward over the
block. On a GPU a 16-token forward costs nearly what a 1-token forward does; on a CPU it does not
(the forward turns compute-bound), which is why block size, drafter depth and draft truncation are
chosen by measured speed on the machine at hand. `measure_step_costs` times, on the loaded target
and drafter and with a real KV cache of `context` tokens, the target forward over T = 1..block
tokens and the drafter forward (context K/V of one accepted span + the block + its lm_head);
each time is a median over `repeats` runs after a warm-up, and the table is reported as ratios to
the 1-token step (measured side by side in one process). A drafter with a draft vocabulary is
timed both ways: its lm_head over the whole vocabulary and over the draft vocabulary's rows.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch

from dflash_trt.errors import InputError
from dflash_trt.speculative.draft_head import DraftHead


@dataclass(frozen=True)
class StepCosts:
    threads: int
    context: int  # tokens already in the KV cache
    one_token_s: float  # median time of a 1-token target forward
    verify_ratio: dict[int, float]  # T -> t(T tokens) / t(1 token)
    draft_ratio: float | None  # drafter forward (block, lm_head over the whole vocabulary) / t(1 token); None without a drafter
    # the same with the lm_head over the drafter's draft vocabulary (speculative/draft_head.py), as the
    # engine drafts by default; None when the drafter ships none
    draft_vocab_ratio: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def _median_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@torch.inference_mode()
def measure_step_costs(target, drafter, *, context: int = 200, sizes: tuple[int, ...] = (1, 2, 4, 8, 16),
                       repeats: int = 7, threads: int | None = None, seed: int = 0) -> StepCosts:
    """Median forward times on random token ids (speed does not depend on the values)."""
    if context < 1 or repeats < 1 or not sizes or min(sizes) < 1:
        raise InputError("need context >= 1, repeats >= 1 and sizes >= 1")
    if threads is not None:
        torch.set_num_threads(threads)
    info = target.info
    if context + max(sizes) > info.max_position_embeddings:
        raise InputError(f"context {context} + {max(sizes)} tokens exceeds the target's {info.max_position_embeddings}")
    g = torch.Generator().manual_seed(seed)
    dev = target.device
    prompt = torch.randint(0, info.vocab_size, (1, context), generator=g).to(dev)
    cache = target.new_cache(1, context + max(sizes) + 1)
    rows = cache.add_rows(1)
    row = slice(rows.start, rows.stop)
    layer_ids = tuple(drafter.cfg.target_layer_ids) if drafter is not None else ()
    out = target.forward(cache, row, prompt, torch.arange(context, device=dev)[None], layer_ids,
                         logit_index=torch.tensor([[context - 1]], device=dev))
    start = torch.tensor([context], device=dev)

    def verify(t: int):
        def run():
            ids = torch.randint(0, info.vocab_size, (1, t), generator=g).to(dev)
            target.forward(cache, row, ids, (context + torch.arange(t, device=dev))[None], layer_ids)
            cache.crop(start, row)
        return run

    times = {t: _median_time(verify(t), repeats) for t in sorted(set(sizes) | {1})}
    draft_ratio = draft_vocab_ratio = None
    if drafter is not None:
        bs = drafter.block_size
        dcache = drafter.new_cache(1, context + bs + 1)
        drows = dcache.add_rows(1)
        drow = slice(drows.start, drows.stop)
        hidden = out.target_hidden[:, :context]  # [1, C, n_ids * H]
        drafter(dcache, drow, hidden[:, : context - 4], torch.arange(context - 4, device=dev)[None],
                target.embed(prompt[:, :bs]), (context - 4 + torch.arange(bs, device=dev))[None])
        dcache.crop(torch.tensor([context - 4], device=dev), drow)

        def draft(head):
            def run():
                # one step's work: write 4 accepted positions' context, run the block, the lm_head on its slots
                h = drafter(dcache, drow, hidden[:, context - 4:], (context - 4 + torch.arange(4, device=dev))[None],
                            target.embed(prompt[:, :bs]), (context + torch.arange(bs, device=dev))[None])
                head(h[:, 1:]).argmax(-1)
                dcache.crop(torch.tensor([context - 4], device=dev), drow)
            return run

        draft_ratio = _median_time(draft(target.head), repeats) / times[1]
        vocab_head = DraftHead(target, drafter.draft_vocab)
        if vocab_head.restricted:
            draft_vocab_ratio = _median_time(draft(vocab_head), repeats) / times[1]
    one = times[1]
    return StepCosts(threads=torch.get_num_threads(), context=context, one_token_s=one,
                     verify_ratio={t: times[t] / one for t in sorted(times)}, draft_ratio=draft_ratio,
                     draft_vocab_ratio=draft_vocab_ratio)
