"""Tokens -> text for streaming responses (the OpenAI server and the Triton model).

`TextStream`: incremental detokenization for streaming. Text is re-decoded from all tokens and
only the stable part is sent: a trailing U+FFFD (an incomplete UTF-8 sequence at a byte-level
token boundary) and the last `len(longest stop) - 1` characters (a stop string may be starting)
are held back until more tokens or the end arrive. Stop strings are cut from the text (OpenAI
semantics: the stop sequence is not returned), so the concatenated deltas equal the full text.
The Triton model sends the running sum of the deltas (its responses carry the whole text so far).
"""
from __future__ import annotations

from typing import Callable


class TextStream:
    def __init__(self, detokenize: Callable[[list[int]], str] | None, stops: tuple[str, ...] = ()) -> None:
        self.detokenize, self.stops = detokenize, stops
        self.tokens: list[int] = []
        self.sent = 0  # characters already sent
        self.stopped = False  # a stop string was found: nothing after it is ever sent
        self._holdback = max((len(s) for s in stops), default=1) - 1

    def _text(self) -> str:
        if self.detokenize is None:
            return ""
        text = self.detokenize(self.tokens)
        cuts = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if cuts:
            self.stopped = True
            return text[: min(cuts)]
        return text

    def push(self, new_tokens: list[int]) -> str:
        """Add tokens; return the text that is now safe to send."""
        if self.stopped:
            return ""
        self.tokens.extend(new_tokens)
        return self._advance(final=False)

    def finish(self) -> str:
        """The rest of the text at the end of the request."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        text = self._text()
        end = len(text)
        if not final and not self.stopped:
            end = max(end - self._holdback, 0)
            while end > self.sent and text[end - 1] == "\ufffd":
                end -= 1
        if end <= self.sent:
            return ""
        delta, self.sent = text[self.sent: end], end
        return delta

    @property
    def text(self) -> str:
        return self._text()
