"""Drives the (not thread-safe) `LLMEngine` from one thread for asyncio callers.

The engine thread is the only thread that touches the engine: it builds it,
loops `step()`, and runs every other engine call handed to it. Callers talk to
it through a thread-safe command queue; outputs come back on per-request
asyncio queues fed with `loop.call_soon_threadsafe`.
"""

import asyncio
import logging
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")


class EngineDeadError(RuntimeError):
    """The engine thread stopped; no request can make progress any more."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue

    def push(self, item: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.outputs.put_nowait, item)
        except RuntimeError:
            pass  # the caller's event loop is closed; nobody is listening


@dataclass
class _Add:
    request_id: str
    prompt: str | list[int]
    params: Any
    stream: _Stream


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    fn: Callable[[Any], Any]
    result: Future


class _Shutdown:
    pass


class AsyncEngine:
    """Owns one `LLMEngine` in a background thread."""

    def __init__(self, engine_factory: Callable[[], Any]):
        self._engine_factory = engine_factory
        self._engine: Any = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}  # engine thread only
        self._lock = threading.Lock()  # orders submissions against engine death
        self._dead_reason: str | None = None
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, name="atom-engine", daemon=True
        )
        self.model_name = ""
        self.max_model_len = 0
        self.vocab_size = 0
        self.has_tokenizer = True

    # ---- lifecycle (caller side) ----

    def start(self) -> "AsyncEngine":
        """Build the engine in its thread; re-raise whatever building raised."""
        self._thread.start()
        self._ready.wait()
        if self._startup_error is not None:
            raise self._startup_error
        return self

    def shutdown(self, timeout: float = 30.0) -> None:
        with self._lock:
            if self._dead_reason is None:
                self._commands.put(_Shutdown())
        self._thread.join(timeout)

    @property
    def is_healthy(self) -> bool:
        return self._dead_reason is None and self._thread.is_alive()

    @property
    def dead_reason(self) -> str | None:
        return self._dead_reason

    # ---- requests (caller side, inside an event loop) ----

    async def generate(
        self, prompt: str | list[int], params: Any, request_id: str | None = None
    ) -> AsyncIterator[Any]:
        """Yield `RequestOutput`s until the request finishes.

        An error from `add_request` (bad input) is raised here for this request
        only; `EngineDeadError` means the engine itself failed. Leaving the
        iteration early (client gone, task cancelled) aborts the request.
        """
        request_id = request_id or uuid.uuid4().hex
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._submit(_Add(request_id, prompt, params, stream))
        finished = False
        try:
            while not finished:
                item = await stream.outputs.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        try:
            self._submit(_Abort(request_id))
        except EngineDeadError:
            pass  # nothing left to abort

    async def call(self, fn: Callable[[Any], T]) -> T:
        """Run `fn(engine)` on the engine thread between steps."""
        result: Future = Future()
        self._submit(_Call(fn, result))
        return await asyncio.wrap_future(result)

    def _submit(self, command: Any) -> None:
        with self._lock:
            if self._dead_reason is not None:
                raise EngineDeadError(self._dead_reason)
            self._commands.put(command)

    # ---- engine thread ----

    def _run(self) -> None:
        try:
            self._engine = self._engine_factory()
            self.model_name = self._engine.model_name
            self.max_model_len = self._engine.max_model_len
            tokenizer = self._engine.tokenizer
            self.has_tokenizer = tokenizer is not None
            self.vocab_size = (
                len(tokenizer)
                if tokenizer is not None
                else int(self._engine.config.hf_config.text["vocab_size"])
            )
        except BaseException as error:  # reported to start()
            self._startup_error = error
            self._dead_reason = f"engine failed to start: {error!r}"
            self._ready.set()
            return
        self._ready.set()
        try:
            self._serve()
        except BaseException as error:
            logger.exception("engine thread died")
            self._fail_everything(f"engine error: {error!r}")
        finally:
            self._close_engine()

    def _serve(self) -> None:
        engine = self._engine
        while True:
            idle = not engine.has_unfinished_requests()
            if not self._handle_commands(block=idle):
                return
            if engine.has_unfinished_requests():
                for output in engine.step():
                    stream = self._streams.get(output.request_id)
                    if stream is None:
                        continue  # aborted while in flight
                    if output.finished:
                        del self._streams[output.request_id]
                    stream.push(output)

    def _handle_commands(self, block: bool) -> bool:
        """Apply queued commands; False once shutdown was requested."""
        try:
            command = self._commands.get(block=block)
        except queue.Empty:
            return True
        while True:
            if isinstance(command, _Shutdown):
                self._fail_everything("the server is shutting down")
                return False
            self._apply(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _apply(self, command: Any) -> None:
        engine = self._engine
        if isinstance(command, _Add):
            try:
                engine.add_request(command.prompt, command.params, command.request_id)
            except (ValueError, TypeError) as error:
                command.stream.push(error)  # bad input fails this request only
                return
            self._streams[command.request_id] = command.stream
        elif isinstance(command, _Abort):
            if self._streams.pop(command.request_id, None) is not None:
                engine.abort_request(command.request_id)
        elif isinstance(command, _Call):
            if not command.result.set_running_or_notify_cancel():
                return  # the caller stopped waiting
            try:
                command.result.set_result(command.fn(engine))
            except Exception as error:
                command.result.set_exception(error)

    def _fail_everything(self, reason: str) -> None:
        """Mark the engine dead and fail every pending request and call."""
        with self._lock:
            self._dead_reason = reason
            pending = []
            while True:
                try:
                    pending.append(self._commands.get_nowait())
                except queue.Empty:
                    break
        for command in pending:
            if isinstance(command, _Add):
                command.stream.push(EngineDeadError(reason))
            elif isinstance(command, _Call):
                if command.result.set_running_or_notify_cancel():
                    command.result.set_exception(EngineDeadError(reason))
        for stream in self._streams.values():
            stream.push(EngineDeadError(reason))
        self._streams.clear()

    def _close_engine(self) -> None:
        try:
            self._engine.close()
        except Exception:
            logger.exception("closing the engine failed")
