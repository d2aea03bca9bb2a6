"""When drafts pay: measured per batch size, not predicted.

Whether verifying k more rows per sequence costs more than the accepted drafts save depends on the
kernels (on the quantized CPU path up to 8 rows share one read of the codes, more take the prefill
path), the machine, the batch size and how often drafts are right for today's requests. So the
engine measures it. Per batch-size bucket it runs one mode (drafts on or off) and, now and then,
one step of the other (after 16 steps, then 32, 64, ... while the mode keeps winning); the ratio
of that step's tokens per second to the running mode's recent average is the evidence. Both
figures are recent, so a change of workload (longer contexts, drafts that stop matching) cannot be
mistaken for a gain or a loss. No clock is read here: the engine reports each step's duration.
"""
from __future__ import annotations

from dataclasses import dataclass, field

EXPLORE_EVERY = 16  # steps of a bucket's mode before a step of the other; doubled each time it is confirmed
MAX_EXPLORE_EVERY = 256  # (a draft model's exploring step first catches up on every token since the last)
START_ON_UP_TO = 2  # buckets that start with drafts on (chat loses from batch 4 on the default model); the rest
# start off and explore at their fourth step
SMOOTHING = 0.3  # of a mode's recent tokens/s
GAIN_SMOOTHING = 0.5  # of the gain over explorations: one noisy step does not flip the mode, two agreeing do


def bucket(batch_size: int) -> int:
    """1, 2, 4, 8, ...: the power of two at or above the batch size."""
    return 1 << max(batch_size - 1, 0).bit_length()


def _ema(old: float | None, value: float, smoothing: float = SMOOTHING) -> float:
    return value if old is None else (1 - smoothing) * old + smoothing * value


@dataclass
class _Bucket:
    speculate: bool  # the mode it runs
    rate: dict[bool, float | None] = field(default_factory=lambda: {True: None, False: None})  # tokens/s, recent
    gain: float | None = None  # tokens/s with drafts over without, from exploring steps
    interval: int = EXPLORE_EVERY
    steps_left: int = 4  # to the next exploring step


class SpeculationGate:
    def __init__(self) -> None:
        self.buckets: dict[int, _Bucket] = {}

    def use(self, batch_size: int) -> bool:
        """Draft for the next step of `batch_size` decodes?"""
        key = bucket(batch_size)
        b = self.buckets.setdefault(key, _Bucket(speculate=key <= START_ON_UP_TO))
        b.steps_left -= 1
        exploring = b.steps_left <= 0 and b.rate[b.speculate] is not None
        return b.speculate != exploring

    def record(self, batch_size: int, speculated: bool, num_tokens: int, seconds: float) -> None:
        """A decode-only step: its batch, whether it verified drafts, tokens emitted, duration."""
        b = self.buckets.get(bucket(batch_size))
        if b is None or seconds <= 0:
            return
        rate = num_tokens / seconds
        if speculated != b.speculate and b.rate[b.speculate] is not None:  # an exploring step
            on, off = (rate, b.rate[False]) if speculated else (b.rate[True], rate)
            agrees = (on >= off) == b.speculate
            b.gain = _ema(b.gain, on / off, GAIN_SMOOTHING)
            # backing off: each exploration that confirms the mode doubles the wait for the next;
            # one that does not brings the next one close
            b.interval = min(2 * b.interval, MAX_EXPLORE_EVERY) if agrees else EXPLORE_EVERY
            b.speculate, b.steps_left = b.gain >= 1.0, b.interval
        b.rate[speculated] = _ema(b.rate[speculated], rate)

    def summary(self) -> dict[int, float | None]:
        """bucket -> measured gain of drafting (tokens/s with / without), for logs and benchmarks."""
        return {k: b.gain for k, b in sorted(self.buckets.items())}
