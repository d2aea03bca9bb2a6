"""Locust users for issue 38's priority workload: batch streams that keep the engine saturated, beside
interactive chat requests at priority 0 whose time to first content token is the figure.

    locust -f loadtests/priority_locustfile.py --headless --host http://127.0.0.1:8000 --users 28 \\
        --spawn-rate 28 --run-time 80s --stop-timeout 0 --batch-users 24 --interactive-users 4 \\
        --batch-priority 10 --warmup 20

loadtests/priority_ttft.py runs this against a priority and a fcfs server and prints the table.
Options of its own (added to locust's parser, so absent from its --help, which comes before this file
loads): --batch-users and --interactive-users (exact counts, `fixed_count`; --users should be their
sum), --batch-priority (0 against a fcfs server, which refuses any other), --batch-tokens, --interval
(one interactive user's pacing) and --warmup (seconds, after which the stats are reset: with
--stop-timeout 0 the CSVs hold the measured window only). Stats rows: TTFT `interactive` (the figure)
and `batch`; the batch requests ask for continuous usage stats, so their TTFT and ITL events carry the
tokens each chunk brought (locust's `Average Content Size` x `# Requests`, summed over the two rows:
the tokens streamed in the window).
ATTNSERVE_MODELS (its first name, default `default`) is the model requested.
"""
from __future__ import annotations

import random
import sys
import time
from pathlib import Path

import gevent
from locust import constant, events, task

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loadtests.locustfile import _OpenAIUser, models  # noqa: E402

BATCH_PROMPT = "Write a long story about a lighthouse keeper and the sea. " * 4
QUESTION = "What is the capital of France?"


@events.init_command_line_parser.add_listener
def _options(parser) -> None:
    parser.add_argument("--batch-users", type=int, default=24, help="batch streams (more than --max-num-seqs)")
    parser.add_argument("--interactive-users", type=int, default=4, help="interactive clients")
    parser.add_argument("--batch-priority", type=int, default=10, help="0 against a fcfs server")
    parser.add_argument("--batch-tokens", type=int, default=128, help="output tokens per batch request")
    parser.add_argument("--interval", type=float, default=8.0,
                        help="seconds between one interactive user's requests (later if its last one took longer)")
    parser.add_argument("--warmup", type=float, default=20.0, help="seconds of load before the stats are reset")


@events.init.add_listener
def _counts(environment, **_) -> None:
    options = environment.parsed_options
    if options is not None:  # None when locust runs as a library without a command line
        BatchUser.fixed_count = options.batch_users
        InteractiveUser.fixed_count = options.interactive_users


@events.test_start.add_listener
def _reset_after_warmup(environment, **_) -> None:
    gevent.spawn_later(environment.parsed_options.warmup, environment.stats.reset_all)


class BatchUser(_OpenAIUser):
    """Long streamed completions back to back; ignore_eos, so each decodes all --batch-tokens."""

    wait_time = constant(0)

    def on_start(self) -> None:  # NOTE: no workload file: every request is the same
        self.model = models()[0]

    @task
    def complete(self) -> None:
        options = self.environment.parsed_options
        body = {"model": self.model, "prompt": BATCH_PROMPT, "max_tokens": options.batch_tokens, "temperature": 0,
                "ignore_eos": True, "priority": options.batch_priority, "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        self.stream("/v1/completions", body, "batch")


class InteractiveUser(_OpenAIUser):
    """One short streamed chat request at priority 0 every --interval seconds."""

    def on_start(self) -> None:
        self.model = models()[0]
        # NOTE: users spawn together; a random phase spreads their requests over the interval
        gevent.sleep(random.uniform(0, self.environment.parsed_options.interval))
        self.next_at = time.perf_counter()

    def wait_time(self) -> float:
        """Constant pacing from this user's phase (locust's constant_pacing would restart it at spawn)."""
        now = time.perf_counter()
        self.next_at = max(self.next_at + self.environment.parsed_options.interval, now)
        return self.next_at - now

    @task
    def ask(self) -> None:
        body = {"model": self.model, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 8,
                "temperature": 0, "priority": 0, "stream": True, "stream_options": {"include_usage": True}}
        self.stream("/v1/chat/completions", body, "interactive")
