"""The engine process: one per model replica, running `LLMEngine` steps back to back.

It owns the model, the KV cache and the scheduler, away from the replica's GIL (asyncio,
streaming, Ray's threads). It speaks over one local socket (`multiprocessing.connection`,
pickled values from `server/wire.py`):

    replica -> engine   EngineConfig, then AddRequest | AbortRequest | ComputeAttention | LoadLora | UnloadLora
                        (| InjectStepFailures | SlowSteps)
    engine  -> replica  EngineReady, then StepOutputs after every loop that changed anything, and
                        CachedBlocks (a prefix-cache summary) about once a second after steps ran,
                        AttentionWeights in answer to ComputeAttention, LoraAnswer to LoadLora / UnloadLora

Detokenization and stop strings stay here, in the step that produced the token: a stop string
ends its sequence (and frees its blocks) at once, with no extra steps, and offline and served
generation share one code path. It exits when the replica's end of the socket closes.

    python -m server.engine.core FD
"""
from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import replace
from multiprocessing.connection import Connection

import torch

from models.attention_maps import attention_weights
from server.engine.config import EngineConfig
from server.engine.engine import LLMEngine
from server.engine.executor import WorkerDiedError
from server.wire import (
    AbortRequest,
    AddRequest,
    AttentionWeights,
    CachedBlocks,
    ComputeAttention,
    EngineReady,
    InjectStepFailures,
    LoadLora,
    RequestOutput,
    SlowSteps,
    StepOutputs,
    UnloadLora,
)

logger = logging.getLogger(__name__)
STATS_EVERY_S = 0.1  # the longest a replica's view of the engine's stats goes stale while it runs
SUMMARY_EVERY_S = 1.0  # how often the prefix-cache summary (for the router) goes out, after steps ran
SUMMARY_MAX_KEYS = 4096  # the newest cached blocks it lists (32 KiB)
GRAMMAR_POLL_S = 0.002  # while every request waits for its grammar: how often to look again


class EngineCore:
    """The loop: drain commands, step, send outputs with a stats value."""

    def __init__(self, engine: LLMEngine, conn: Connection) -> None:
        self.engine, self.conn = engine, conn
        self.step_delay_s = 0.0
        self.last_sent = 0.0
        self.last_summary, self.summarized_steps = 0.0, 0

    def run(self) -> None:
        engine = self.engine
        while True:
            # blocks only when idle (at most until a summary is due); while requests run,
            # commands are picked up between steps
            summary_due = engine.num_steps != self.summarized_steps
            if engine.has_unfinished() and engine.last_step_empty:
                # nothing could run (requests wait for their grammars): wait for a command or a
                # moment, rather than spin on empty steps
                changed = self._drain(block=True, timeout=GRAMMAR_POLL_S)
            else:
                changed = self._drain(block=not engine.has_unfinished(),
                                      timeout=SUMMARY_EVERY_S if summary_due else None)
            if self.step_delay_s and engine.has_unfinished():
                time.sleep(self.step_delay_s)
            outputs = self._step() if engine.has_unfinished() else []
            # steps of final-only requests output nothing: their stats still go out, now and then
            now = time.monotonic()
            if changed or outputs or now - self.last_sent >= STATS_EVERY_S:
                self.conn.send(StepOutputs(tuple(outputs), engine.stats()))
                self.last_sent = now
            if summary_due and now - self.last_summary >= SUMMARY_EVERY_S:
                self.conn.send(CachedBlocks(engine.kv.pool.cache_summary(SUMMARY_MAX_KEYS)))
                self.last_summary, self.summarized_steps = now, engine.num_steps

    def _drain(self, block: bool, timeout: float | None = None) -> bool:
        changed = False
        while self.conn.poll(timeout if block and not changed else 0):
            self._handle(self.conn.recv())
            changed = True
        return changed

    def _handle(self, command) -> None:
        if isinstance(command, AddRequest):
            try:
                self.engine.add_validated(command.request_id, command.prompt_token_ids, command.params,
                                          command.arrival_time, command.final_only, embed=command.embed,
                                          lora=command.lora)
            except Exception as e:  # noqa: BLE001 - the request fails, the engine keeps serving
                failed = tuple(RequestOutput(command.request_id, i, (), "", True, "error", error=str(e))
                               for i in range(command.params.n))
                self.conn.send(StepOutputs(failed, self.engine.stats()))
        elif isinstance(command, AbortRequest):
            outputs = self.engine.abort(command.request_id)
            if outputs:
                self.conn.send(StepOutputs(tuple(outputs), self.engine.stats()))
        elif isinstance(command, ComputeAttention):
            self.conn.send(self._attention(command))
        elif isinstance(command, LoadLora):
            # NOTE: read, checked and installed here, between steps (as an AddRequest's adapter that is not
            # resident): a rank-16 adapter of the default model on all 7 modules, 19.5 MB, took ~45 ms
            # (~26 ms reading and hashing the file, ~20 ms installing it in fp32 slots), one thread
            self.conn.send(self.engine.load_lora(command.ref, command.request_id))
        elif isinstance(command, UnloadLora):
            self.conn.send(self.engine.unload_lora(command.name, command.request_id))
        elif isinstance(command, InjectStepFailures):
            self._inject_step_failures(command.count)
        elif isinstance(command, SlowSteps):
            self.step_delay_s = command.delay_s
        else:
            raise TypeError(f"unknown engine command {command!r}")

    def _attention(self, command: ComputeAttention) -> AttentionWeights:
        """Between steps, on the engine's own model: one eager forward with the reference attention."""

        if self.engine.model is None:
            return AttentionWeights(command.request_id, error="attention maps are not available for a model "
                                    "sharded over several workers (tensor or pipeline parallelism)")
        try:
            weights = attention_weights(self.engine.model, command.token_ids, command.layers)
        except ValueError as e:
            return AttentionWeights(command.request_id, error=str(e))
        config = self.engine.model.config  # weights come with windows and sinks applied: say which
        return AttentionWeights(command.request_id, tuple((i, w.numpy()) for i, w in weights.items()),
                                windows=tuple(config.window(i) for i in weights), sinks=config.attn_sinks)

    def _inject_step_failures(self, count: int) -> None:
        """Chaos testing: the next `count` model steps raise, as a real failure would."""
        runner, real = self.engine.runner, self.engine.runner.submit
        remaining = [count]

        def failing(batch):
            if remaining[0] > 0:
                remaining[0] -= 1
                raise RuntimeError("injected model step failure")
            runner.submit = real
            return real(batch)
        runner.submit = failing

    def _step(self) -> list[RequestOutput]:
        engine = self.engine
        try:
            return engine.step()
        except WorkerDiedError as e:
            # NOTE: a rank of a sharded model is gone: every request ends with the error, then this process
            # exits, so that the replica's health check fails and Serve starts a whole new group
            logger.error("%s: failing every request and exiting", e)
            outputs = [replace(o, finish_reason="error", error=str(e))
                       for rid in list(engine.groups) for o in engine.abort(rid)]
            self.conn.send(StepOutputs(tuple(outputs), engine.stats()))
            raise
        except Exception as e:  # a bug outside the model step: fail everyone, keep serving
            logger.exception("engine step crashed")
            message = f"{type(e).__name__}: {e}"
            return [replace(o, finish_reason="error", error=message)
                    for rid in list(engine.groups) for o in engine.abort(rid)]


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine[%(process)d] %(levelname)s %(message)s")
    conn = Connection(int(argv[0]))
    config: EngineConfig = conn.recv()
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    engine = LLMEngine(config)
    conn.send(EngineReady(engine.info, os.getpid(), engine.stats()))
    try:
        EngineCore(engine, conn).run()
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return 0  # the replica is gone
    except WorkerDiedError:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
