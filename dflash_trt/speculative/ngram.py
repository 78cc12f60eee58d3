"""N-gram lookup drafts inside the DFlash loop (`EngineConfig.ngram_lookup`).

Prompt-lookup decoding (Saxena 2023, github.com/apoorvumang/prompt-lookup-decoding) drafts by
copying: find an earlier occurrence of the sequence's last few tokens and propose what followed it.
It costs no model forward and, on inputs that repeat themselves (code that re-uses its prompt's
names, edits, quotes), its drafts are accepted far more often than a small drafter's. Where there is
no match it proposes nothing. DFlash is the opposite: a draft every step, at the price of a drafter
forward, good on text that is new.

With `ngram_lookup = n` the engine uses both: a row whose history (prompt + generated tokens, the
pending token last) ends with a match of at least n tokens verifies the lookup's continuation in
place of the drafter's block; every other row verifies the drafter's block as usual. When every row
of a step has a match, the drafter forward is skipped (its context features wait for the next
one, as with a `draft_len_schedule` step of 0 drafts). Verification is the target's, as for any draft,
so greedy output is unchanged; rows sampled with `acceptance="rejection"` keep the drafter's
proposal (their acceptance test needs the drafter's distribution q).
"""
from __future__ import annotations

from typing import Sequence

from dflash_trt.engine import NGRAM_MAX_MATCH as MAX_MATCH  # longer matches rank equal


def lookup_continuation(history: Sequence[int], min_match: int, max_tokens: int) -> list[int]:
    """The tokens that followed the best earlier occurrence of `history`'s suffix, at most `max_tokens`.

    Every earlier position holding the last token is a candidate; its match length is how many tokens
    (capped at MAX_MATCH) agree walking backwards from it and from the end of `history`. The longest
    match wins, the most recent one among equals; below `min_match` tokens there is no match and the
    result is []. The continuation may run into the matched suffix itself (a repeating pattern)."""
    if min_match < 1:
        raise ValueError(f"min_match must be >= 1, got {min_match}")
    end = len(history) - 1
    if end < 1 or max_tokens < 1:
        return []
    last = history[end]
    best, best_at = 0, -1
    for j in range(end - 1, -1, -1):  # most recent first: a tie keeps the later occurrence
        if history[j] != last:
            continue
        m = 1
        while m < MAX_MATCH and j - m >= 0 and history[j - m] == history[end - m]:
            m += 1
        if m > best:
            best, best_at = m, j
            if m == MAX_MATCH:
                break
    if best < min_match:
        return []
    return list(history[best_at + 1 : best_at + 1 + max_tokens])
