"""A reasoning model's thinking, followed token by token for one sequence: where it stands (inside the
thinking, answering, or not yet opened), the tokens it thought, and the end tag forced, one token per
step, once they reach the request's budget. The grammar of a constrained request starts after the end
tag (`constraint`), and drafts never run past a forced token (`max_drafts`).

Its state is a function of the sequence's output tokens, which preemption (by recompute) keeps:
nothing to roll back there. Tags are recognised as the tokens the tokenizer makes of them.
"""
from __future__ import annotations

from typing import Any

import torch

from server.engine.sampling_params import Reasoning
from server.reasoning import ANSWERING, PENDING, THINKING


def _bit(token_id: int) -> int:
    """The token's bit in its int32 mask word (bit 31 is the sign bit, as in xgrammar's words)."""
    bit = 1 << (token_id % 32)
    return bit - (1 << 32) if bit >= 1 << 31 else bit


class Forced:
    """A mask that allows one token."""

    def __init__(self, token_id: int) -> None:
        self.token_id = token_id

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = 0
        bitmask[row, self.token_id // 32] = _bit(self.token_id)


class GrammarOrToken:
    """The grammar's mask and one more token: the opening tag's first token, while the model may still open it."""

    def __init__(self, grammar: Any, token_id: int) -> None:
        self.grammar, self.token_id = grammar, token_id

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self.grammar.fill(bitmask, row)
        bitmask[row, self.token_id // 32] |= _bit(self.token_id)


class Thinking:
    def __init__(self, reasoning: Reasoning) -> None:
        self.reasoning = reasoning
        self.state = reasoning.start
        self.count = 0  # thinking tokens so far (after the opening tag, before a forced end)
        self.matched = 0  # pending: opening tokens taken; thinking: end-tag tokens at the thinking's tail
        self.forced = 0  # end-tag tokens forced so far

    @property
    def over_budget(self) -> bool:
        budget = self.reasoning.budget
        return self.state == THINKING and budget is not None and self.count >= budget

    def forced_token(self) -> int | None:
        """The next token, where it is not the model's to choose: the end tag once the budget is spent,
        the rest of a multi-token opening tag once it began."""
        if self.over_budget:
            return self.reasoning.end_token_ids[self.forced]
        if self.state == PENDING and self.matched:
            return self.reasoning.start_token_ids[self.matched]
        return None

    def max_drafts(self) -> int | None:
        """Drafts the next step may verify (None: any). NOTE: k drafts may bring k + 1 tokens: never past
        the budget, and none while a token is forced or the answer may start (a grammar's first token)."""
        if self.state == ANSWERING:
            return None
        if self.state == PENDING or self.over_budget:
            return 0
        budget = self.reasoning.budget
        return None if budget is None else budget - self.count - 1

    def take(self, token_id: int) -> bool:
        """Follow one output token; True when it belongs to the answer (what a grammar must accept)."""
        r = self.reasoning
        if self.state == ANSWERING:
            return True
        if self.state == PENDING:
            if token_id != r.start_token_ids[self.matched]:
                self.state = ANSWERING  # NOTE: matched is 0 here: an opening tag once begun is forced to its end
                return True
            self.matched += 1
            if self.matched == len(r.start_token_ids):
                self.state, self.matched = THINKING, 0
            return False
        if self.over_budget:
            self.forced += 1
            if self.forced == len(r.end_token_ids):
                self.state = ANSWERING
            return False
        self.count += 1
        end = r.end_token_ids
        self.matched = self.matched + 1 if token_id == end[self.matched] else int(token_id == end[0])
        if self.matched == len(end):
            self.state = ANSWERING
        return False


def constraint(thinking: Thinking | None, grammar: Any) -> Any:
    """What masks a sequence's next token (an object with `fill(bitmask, row)`), or None: a forced token,
    else the grammar once the thinking is over (with the opening tag's first token while it may open)."""
    if thinking is None:
        return grammar
    forced = thinking.forced_token()
    if forced is not None:
        return Forced(forced)
    if thinking.state == ANSWERING:
        return grammar
    if thinking.state == PENDING and grammar is not None:
        return GrammarOrToken(grammar, thinking.reasoning.start_token_ids[0])
    return None
