"""The replica's side of its engine process: starts it, posts commands, routes outputs to streams.

Outputs arrive on one reader thread (it waits on the socket without the GIL) and cross to each
stream's event loop in one `call_soon_threadsafe` per loop and step. If the engine process dies,
every open stream ends with `EngineDeadError` and `is_alive` turns false, so Serve restarts the
replica.
"""
from __future__ import annotations

import asyncio
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import replace
from multiprocessing.connection import Connection
from typing import AsyncIterator, Callable, Sequence

from models.native.cpu_features import apply_isa_cap
from server.engine.config import EngineConfig
from server.engine.errors import EngineDeadError, QueueFullError
from server.engine.sampling_params import SamplingParams
from server.wire import (
    AbortRequest,
    AddRequest,
    AttentionWeights,
    CachedBlocks,
    ComputeAttention,
    EngineReady,
    EngineStats,
    InjectStepFailures,
    LoadLora,
    LoraAnswer,
    LoraRef,
    ModelInfo,
    RequestOutput,
    SlowSteps,
    StepOutputs,
    UnloadLora,
)

logger = logging.getLogger(__name__)
START_TIMEOUT_S = 900.0  # a cold start compiles the model step


def ray_placement_env() -> dict[str, str]:
    """For a sharded model's engine process: the Ray cluster this replica is in, and the placement group
    Serve reserved for the replica's workers (server/engine/executor.py places them in it)."""
    ray = sys.modules.get("ray")  # NOTE: never imported here: a replica outside Ray has none
    if ray is None or not ray.is_initialized():
        return {}
    env = {"RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    group = ray.util.get_current_placement_group()
    if group is not None:
        env["ATTNSERVE_PLACEMENT_GROUP"] = group.id.hex()
    return env


class EngineCoreClient:
    def __init__(self, config: EngineConfig, on_outputs: Callable[[StepOutputs], None] | None = None) -> None:
        self.config = config
        self.on_outputs = on_outputs  # called on the reader thread, before outputs reach their streams
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        apply_isa_cap(env)  # NOTE: the engine process imports torch first thing: the cap must be in its env
        if config.world_size > 1:
            env.update(ray_placement_env())
        self.process = subprocess.Popen([sys.executable, "-m", "server.engine.core", str(theirs.fileno())],
                                        pass_fds=(theirs.fileno(),), env=env)
        theirs.close()
        self.conn = Connection(ours.detach())
        self.conn.send(config)
        ready = self._wait_ready()
        self.info: ModelInfo = ready.info
        self.pid: int = ready.pid
        self.stats: EngineStats = ready.stats  # the latest, replaced whole (never mutated)
        self.cached_blocks: frozenset[bytes] = frozenset()  # the latest prefix-cache summary
        # ComputeAttention, LoadLora and UnloadLora by request id: their answers' futures
        self._answers: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self.dead: str | None = None  # why the engine process is gone
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._send_lock = threading.Lock()
        self._adds_sent = 0
        self._reader = threading.Thread(target=self._read, name="attnserve-engine-reader", daemon=True)
        self._reader.start()

    def _wait_ready(self) -> EngineReady:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.conn.poll(1.0):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.process.kill()
                raise RuntimeError(f"engine process failed to start (exit code {self.process.poll()}); see its log")
        try:
            return self.conn.recv()
        except EOFError:
            self.process.wait(timeout=10)
            raise RuntimeError(f"engine process failed to start (exit code {self.process.returncode}); "
                               "see its log") from None

    @property
    def is_alive(self) -> bool:
        return self.dead is None and self.process.poll() is None

    def generate(self, prompt_token_ids: Sequence[int], params: SamplingParams, request_id: str | None = None,
                 coalesce: bool = False, final_only: bool = False, embed: bool = False,
                 lora: LoraRef | None = None) -> AsyncIterator[RequestOutput]:
        """Check capacity now (raising QueueFullError), then stream outputs as they come.

        The caller validated the request. Closing the iterator early (client gone, task
        cancelled) aborts the request. With `coalesce`, outputs that queued up while the consumer
        was busy arrive merged (one per sample): a slow consumer costs one message per read. With
        `final_only`, the engine sends each sample once, finished and whole. With `embed`, the prompt is
        only prefilled: its one output carries its embedding. With `lora`, it runs with that LoRA adapter
        (loaded on demand if it is not resident; an adapter that cannot be loaded fails the request).
        """
        if not self.is_alive:
            raise EngineDeadError(f"engine process is not running: {self.dead or 'exited'}")
        limit = self.config.max_waiting
        if limit is not None:
            # NOTE: checked here, before any byte is streamed, so an overload is a 429; adds the
            # engine has not seen yet count as waiting. Racy by a request or two, which a memory
            # bound tolerates.
            stats = self.stats
            waiting = stats.num_waiting + self._adds_sent - stats.num_adds_received
            if waiting >= limit:
                raise QueueFullError(f"waiting queue is full ({limit} requests); retry later")
        return self._stream(request_id or uuid.uuid4().hex, tuple(prompt_token_ids), params, coalesce, final_only,
                            embed, lora)

    async def _stream(self, request_id: str, prompt: tuple[int, ...], params: SamplingParams, coalesce: bool,
                      final_only: bool, embed: bool = False, lora: LoraRef | None = None) -> AsyncIterator[RequestOutput]:
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), q)
        remaining, done = params.n, False
        try:
            self._adds_sent += 1
            self._send(AddRequest(request_id, prompt, params, time.monotonic(), final_only, embed=embed, lora=lora))
            while remaining:
                items = [await q.get()]
                while coalesce and not q.empty():
                    items.append(q.get_nowait())
                for item in items:
                    if isinstance(item, BaseException):
                        raise item
                for item in merge_outputs(items) if coalesce else items:
                    remaining -= item.finished
                    yield item
            done = True
        finally:
            self._streams.pop(request_id, None)
            if not done:
                self.abort(request_id)

    async def attention(self, token_ids: Sequence[int], layers: Sequence[int] | None) -> AttentionWeights:
        """Attention weights of one prompt, computed by the engine process between steps."""
        return await self._ask(lambda rid: ComputeAttention(rid, tuple(token_ids), tuple(layers) if layers else None))

    async def load_lora(self, ref: LoraRef) -> LoraAnswer:
        """Make a LoRA adapter resident on the engine (read and checked there, between steps): its error
        (with an HTTP status) or how long the load took."""
        return await self._ask(lambda rid: LoadLora(rid, ref))

    async def unload_lora(self, name: str) -> LoraAnswer:
        """Drain a LoRA adapter: its requests in flight finish, new ones are refused; a 404 answer for one
        the engine does not hold."""
        return await self._ask(lambda rid: UnloadLora(rid, name))

    async def _ask(self, command: Callable[[str], object]):
        """Send `command(request_id)` and await the engine's answer to that request id."""
        if not self.is_alive:
            raise EngineDeadError(f"engine process is not running: {self.dead or 'exited'}")
        request_id = uuid.uuid4().hex
        future = asyncio.get_running_loop().create_future()
        self._answers[request_id] = (asyncio.get_running_loop(), future)
        try:
            self._send(command(request_id))
            return await future
        finally:
            self._answers.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        try:
            self._send(AbortRequest(request_id))
        except EngineDeadError:
            pass  # nothing left to free

    def inject_step_failures(self, count: int) -> None:
        self._send(InjectStepFailures(count))

    def slow_steps(self, delay_s: float) -> None:
        self._send(SlowSteps(delay_s))

    def _send(self, command) -> None:
        try:
            with self._send_lock:
                self.conn.send(command)
        except OSError as e:
            raise EngineDeadError(f"engine process is not running: {e}") from None

    def _read(self) -> None:
        while True:
            try:
                message: StepOutputs | CachedBlocks = self.conn.recv()
            except (EOFError, OSError) as e:
                self._on_dead(f"{type(e).__name__} on the engine socket (exit code {self.process.poll()})")
                return
            try:
                self._receive(message)
            except Exception as e:  # noqa: BLE001 - NOTE: a reader that stops must not leave streams hanging
                logger.exception("engine reader failed")
                self._on_dead(f"reading the engine's messages failed: {type(e).__name__}: {e}")
                self.process.kill()
                return

    def _receive(self, message: StepOutputs | CachedBlocks | AttentionWeights | LoraAnswer) -> None:
        if isinstance(message, CachedBlocks):
            self.cached_blocks = message.keys
            return
        if isinstance(message, (AttentionWeights, LoraAnswer)):
            waiter = self._answers.pop(message.request_id, None)
            if waiter is not None:
                waiter[0].call_soon_threadsafe(_resolve, waiter[1], message)
            return
        self.stats = message.stats
        if self.on_outputs is not None:
            try:
                self.on_outputs(message)
            except Exception:  # accounting must never take requests down
                logger.exception("on_outputs hook failed")
        self._dispatch(message.outputs)

    def _on_dead(self, why: str) -> None:
        if self.dead is None:  # not shut down on purpose
            self.dead = why
            logger.error("engine process died: %s", why)  # Serve's health check restarts the replica
        error = EngineDeadError(f"engine process stopped: {self.dead}")
        for loop, future in list(self._answers.values()):
            try:
                loop.call_soon_threadsafe(_resolve, future, error)
            except RuntimeError:  # that event loop is closed
                pass
        for loop, q in list(self._streams.values()):
            try:
                loop.call_soon_threadsafe(q.put_nowait, error)
            except RuntimeError:  # that event loop is closed
                pass

    def _dispatch(self, outputs: Sequence[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                by_loop.setdefault(stream[0], []).append((stream[1], out))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # that event loop is closed
                pass

    def shutdown(self) -> None:
        """Stop the engine process; the reader thread ends on the socket's EOF."""
        self.dead = self.dead or "shut down"
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._reader.join(timeout=5)
        self.conn.close()


def merge_outputs(outputs: list[RequestOutput]) -> list[RequestOutput]:
    """Outputs folded into one per sample, in order (tokens, text, logprobs joined)."""
    by_index: dict[int, list[RequestOutput]] = {}
    for out in outputs:
        by_index.setdefault(out.index, []).append(out)
    return [join_outputs(group) for group in by_index.values()]


def join_outputs(outputs: list[RequestOutput]) -> RequestOutput:
    """One sample's consecutive outputs as one; the last one's finish, stats and error."""
    if len(outputs) == 1:
        return outputs[0]
    return replace(outputs[-1], new_token_ids=tuple(t for o in outputs for t in o.new_token_ids),
                   new_text="".join(o.new_text for o in outputs),
                   new_logprobs=tuple(lp for o in outputs for lp in o.new_logprobs),
                   prompt_logprobs=outputs[0].prompt_logprobs)  # NOTE: only a sample's first output has them


def _resolve(future: asyncio.Future, value) -> None:
    if future.done():
        return
    if isinstance(value, BaseException):
        future.set_exception(value)
    else:
        future.set_result(value)


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for q, out in items:
        q.put_nowait(out)
