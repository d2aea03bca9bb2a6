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
from typing import AsyncIterator, Sequence

import torch

from server.engine.engine import LLMEngine
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
        self._thread = threading.Thread(target=self._run, name="attnserve-engine", daemon=True)
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and not self._stopped

    def generate(self, prompt_token_ids: Sequence[int], params: SamplingParams,
                 request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Validate now (raising InvalidRequestError), then stream outputs as they come.

        Closing the iterator early (client gone, task cancelled) aborts the request.
        """
        if not self.is_alive:
            raise EngineDeadError("engine thread is not running")
        self.engine.validate(prompt_token_ids, params)
        return self._stream(request_id or uuid.uuid4().hex, list(prompt_token_ids), params)

    async def _stream(self, request_id: str, prompt: list[int], params: SamplingParams) -> AsyncIterator[RequestOutput]:
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), q)
        self._post(("add", request_id, prompt, params, time.monotonic()))
        remaining, done = params.n, False
        try:
            while remaining:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
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


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for q, out in items:
        q.put_nowait(out)
