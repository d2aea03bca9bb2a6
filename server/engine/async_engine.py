"""asyncio front of the engine: the step loop runs in its own thread, off the event loop.

Only the engine thread touches the scheduler; callers post adds and aborts to an inbox and
receive outputs through per-request asyncio queues.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from dataclasses import replace
from typing import AsyncIterator, Sequence

import torch

from server.engine.engine import LLMEngine, QueueFullError
from server.engine.request import RequestOutput
from server.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread is gone; the replica must be restarted."""


class AsyncEngine:
    def __init__(self, engine: LLMEngine, num_threads: int | None = None) -> None:
        self.engine = engine
        self.num_threads = num_threads
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopped = False
        self._adds_posted = 0  # written by the event loop only
        self._adds_drained = 0  # written by the engine thread only
        self._thread = threading.Thread(target=self._run, name="attnserve-engine", daemon=True)
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and not self._stopped

    def generate(self, prompt_token_ids: Sequence[int], params: SamplingParams,
                 request_id: str | None = None, coalesce: bool = False) -> AsyncIterator[RequestOutput]:
        """Validate now (raising InvalidRequestError), then stream outputs as they come.

        Closing the iterator early (client gone, task cancelled) aborts the request. With
        `coalesce`, outputs that queued up while the consumer was busy arrive merged (one per
        sample), so a slow consumer costs one message per read, not one per token.
        """
        if not self.is_alive:
            raise EngineDeadError("engine thread is not running")
        self.engine.validate(prompt_token_ids, params)
        limit = self.engine.config.max_waiting
        # NOTE: checked here, before any byte is streamed, so an overloaded server answers 429;
        # the count is racy by a request or two, which a bound on memory tolerates.
        pending = self._adds_posted - self._adds_drained
        if limit is not None and len(self.engine.scheduler.waiting) + pending >= limit:
            raise QueueFullError(f"waiting queue is full ({limit} requests); retry later")
        return self._stream(request_id or uuid.uuid4().hex, list(prompt_token_ids), params, coalesce)

    async def _stream(self, request_id: str, prompt: list[int], params: SamplingParams,
                      coalesce: bool) -> AsyncIterator[RequestOutput]:
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), q)
        self._adds_posted += 1
        self._post(("add", request_id, prompt, params, time.monotonic()))
        remaining, done = params.n, False
        try:
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

    def abort(self, request_id: str) -> None:
        self._post(("abort", request_id))

    def _post(self, command: tuple) -> None:
        self._inbox.put(command)
        self._wake.set()

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=10)

    # ---- engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        if self.num_threads:
            torch.set_num_threads(self.num_threads)
        while not self._stopped:
            self._drain_inbox()
            if not self.engine.has_unfinished():
                self._wake.wait()
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:  # a bug outside the model step: fail everyone, keep serving
                logger.exception("engine step crashed")
                outputs = []
                for rid in list(self.engine.groups):
                    self._deliver_error(rid, e)
                    self.engine.abort(rid)
            self._dispatch(outputs)
        for rid in list(self.engine.groups):
            self._dispatch(self.engine.abort(rid))

    def _drain_inbox(self) -> None:
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            if command[0] == "abort":
                self._dispatch(self.engine.abort(command[1]))
                continue
            _, request_id, prompt, params, arrival = command
            self._adds_drained += 1
            if request_id not in self._streams:  # cancelled before it was admitted
                continue
            try:
                self.engine.add_request(request_id, prompt, params, arrival)
            except Exception as e:
                self._deliver_error(request_id, e)

    def _deliver_error(self, request_id: str, error: BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream[0].call_soon_threadsafe(stream[1].put_nowait, error)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
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


def merge_outputs(outputs: list[RequestOutput]) -> list[RequestOutput]:
    """Consecutive outputs of the same sample folded into one (tokens, text, logprobs joined)."""
    merged: dict[int, RequestOutput] = {}
    for out in outputs:
        prev = merged.get(out.index)
        merged[out.index] = out if prev is None else replace(
            out, new_token_ids=prev.new_token_ids + out.new_token_ids, new_text=prev.new_text + out.new_text,
            new_logprobs=prev.new_logprobs + out.new_logprobs)
    return list(merged.values())


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for q, out in items:
        q.put_nowait(out)
