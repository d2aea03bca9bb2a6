"""Incremental detokenisation with stop strings, for streaming text deltas."""
from __future__ import annotations

from typing import Any, Sequence

CONTEXT_TOKENS = 6  # prompt tokens decoded alongside, so word-initial spaces survive


class IncrementalDetokenizer:
    """Turns appended token ids into stable text deltas.

    Text is released only when it no longer ends in a partial UTF-8 character, and, with
    stop strings, only once it cannot be the start of a stop string.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], stop: Sequence[str] = (),
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = tuple(stop)
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""  # output text so far (stop string and after removed)
        self.num_emitted = 0
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def append(self, token_id: int) -> str | None:
        """Add a token; returns the stop string matched, if any."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None  # nothing printable yet (partial character or special token)
        delta = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        start = max(0, len(self.text) - self.holdback)
        self.text += delta
        hits = [(i, s) for s in self.stop if (i := self.text.find(s, start)) >= 0]
        if not hits:
            return None
        i, s = min(hits)
        self.text = self.text[:i]
        self.stopped, self.matched = True, s
        return s

    def flush(self, finished: bool) -> str:
        """Text not yet released; while running, keep back what could begin a stop string.

        On finish, bytes of an incomplete character are released too, as decode() would show them.
        """
        if finished and not self.stopped and self.read_offset < len(self.ids):
            prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
            self.text += self._decode(self.ids[self.prefix_offset:])[len(prefix):]
            self.read_offset = len(self.ids)
        end = len(self.text) if finished or not self.stop else max(self.num_emitted, len(self.text) - self.holdback)
        out = self.text[self.num_emitted:end]
        self.num_emitted = end
        return out
