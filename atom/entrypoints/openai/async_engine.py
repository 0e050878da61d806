"""Drives the (not thread-safe) `LLMEngine` from one thread for asyncio callers.

The engine thread is the only thread that touches the engine: it builds it,
loops `step()`, and runs every other engine call handed to it. Callers talk to
it through a thread-safe command queue; outputs come back on per-request
asyncio queues fed with `loop.call_soon_threadsafe`.

Work that concerns one request only (tokenizing its prompt, rendering its chat
template) runs in a small pool of preparation threads instead, so a huge prompt
delays itself and not everyone else's tokens. Texts over LARGE_TEXT_CHARS are
tokenized one at a time in a lane of their own, so that big prompts wait for each
other and never hold every preparation thread (which parse and tokenize the small
requests too). The tokenizer is shared read-only.

An exception caused by one request fails that request; the engine is dead only
when the engine itself fails: a step raises, or a rank process ends. A monitor
thread watches the rank processes, so a death is noticed even while the engine
idles. Then every pending request fails with `EngineDeadError` naming the cause,
and `on_dead` is called once, so that the server can exit and be restarted.
"""

import asyncio
import functools
import logging
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from atom.utils.tokenizer import TEXT_NEEDS_TOKENIZER

logger = logging.getLogger(__name__)

T = TypeVar("T")

PREPARE_THREADS = 2
# Far above any chat turn, far below the megabytes that take seconds to tokenize.
LARGE_TEXT_CHARS = 256 * 1024
# How often the rank monitor looks up from its wait to see whether to stop.
RANK_POLL_S = 0.5
# How often an idle engine wakes to end overdue P/D leases (LLMEngine.step).
IDLE_HOUSEKEEPING_S = 1.0
# After a rank died: how long the engine thread gets to fail its requests before
# the death is reported anyway (a stuck engine thread must not keep the server).
ENGINE_EXIT_GRACE_S = 10.0


class EngineDeadError(RuntimeError):
    """The engine stopped; no request can make progress any more."""


class RequestFailedError(RuntimeError):
    """The engine could not finish this request; it goes on with the others."""


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
    kv_transfer_params: dict | None = None


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    fn: Callable[[Any], Any]
    result: Future


class _Shutdown:
    pass


@dataclass
class _RankExited:
    reason: str


def first_line(error: BaseException) -> str:
    """A one-line account of `error` (rank failures carry whole tracebacks)."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


class AsyncEngine:
    """Owns one `LLMEngine` in a background thread."""

    def __init__(
        self,
        engine_factory: Callable[[], Any],
        on_dead: Callable[[str], None] | None = None,
    ):
        self._engine_factory = engine_factory
        self._on_dead = on_dead
        self._engine: Any = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}  # engine thread only
        self._lock = threading.Lock()  # orders submissions against engine death
        self._dead_reason: str | None = None
        self._death_reported = False
        self._stopping = threading.Event()
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, name="atom-engine", daemon=True
        )
        self._prepare_pool = ThreadPoolExecutor(
            PREPARE_THREADS, thread_name_prefix="atom-prepare"
        )
        self._large_text_lane = ThreadPoolExecutor(
            1, thread_name_prefix="atom-tokenize-large"
        )
        self.model_name = ""
        self.max_model_len = 0
        self.vocab_size = 0
        self.tokenizer: Any = None
        self.has_tokenizer = True

    # ---- lifecycle (caller side) ----

    def start(self) -> "AsyncEngine":
        """Build the engine in its thread; re-raise whatever building raised."""
        self._thread.start()
        self._ready.wait()
        if self._startup_error is not None:
            raise self._startup_error
        # With one rank the model runs in this process: no rank process to watch.
        if self._engine.config.parallel_config.world_size > 1:
            threading.Thread(
                target=self._watch_ranks,
                args=(self._engine.workers.wait_for_rank_exit,),
                name="atom-rank-monitor",
                daemon=True,
            ).start()
        return self

    def shutdown(self, timeout: float = 30.0) -> None:
        self._stopping.set()
        with self._lock:
            if self._dead_reason is None:
                self._commands.put(_Shutdown())
        self._thread.join(timeout)
        self._prepare_pool.shutdown(wait=False, cancel_futures=True)
        self._large_text_lane.shutdown(wait=False, cancel_futures=True)

    @property
    def is_healthy(self) -> bool:
        return self._dead_reason is None and self._thread.is_alive()

    @property
    def dead_reason(self) -> str | None:
        return self._dead_reason

    # ---- requests (caller side, inside an event loop) ----

    async def prepare(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` in a preparation thread: per-request CPU work."""
        return await self._run_in(self._prepare_pool, fn, *args, **kwargs)

    async def encode(self, text: str) -> list[int]:
        """Token ids of a prompt, as the engine would tokenize it."""
        if self.tokenizer is None:
            raise ValueError(TEXT_NEEDS_TOKENIZER)
        large = len(text) > LARGE_TEXT_CHARS
        pool = self._large_text_lane if large else self._prepare_pool
        return await self._run_in(
            pool, self.tokenizer.encode, text, add_special_tokens=False
        )

    @staticmethod
    async def _run_in(
        pool: ThreadPoolExecutor, fn: Callable[..., T], *args: Any, **kwargs: Any
    ) -> T:
        call = functools.partial(fn, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(pool, call)

    async def generate(
        self,
        prompt: str | list[int],
        params: Any,
        request_id: str | None = None,
        kv_transfer_params: dict | None = None,
    ) -> AsyncIterator[Any]:
        """Yield `RequestOutput`s until the request finishes.

        An error from `add_request` (bad input) or from this request's processing
        is raised here for this request only; `EngineDeadError` means the engine
        itself failed. Leaving the iteration early (client gone, task cancelled)
        aborts the request.
        """
        if isinstance(prompt, str):
            prompt = await self.encode(prompt)
        request_id = request_id or uuid.uuid4().hex
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._submit(_Add(request_id, prompt, params, stream, kv_transfer_params))
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
            self.tokenizer = self._engine.tokenizer
            self.has_tokenizer = self.tokenizer is not None
            self.vocab_size = (
                len(self.tokenizer)
                if self.tokenizer is not None
                else int(self._engine.config.hf_config.text["vocab_size"])
            )
        except BaseException as error:  # reported to start()
            self._startup_error = error
            self._dead_reason = f"engine failed to start: {first_line(error)}"
            self._ready.set()
            return
        self._ready.set()
        try:
            self._serve()
        except BaseException as error:
            logger.exception("engine thread died")
            self._fail_everything(f"engine error: {first_line(error)}")
        if not self._stopping.is_set():
            self._report_death()
        self._close_engine()

    def _serve(self) -> None:
        engine = self._engine
        # A P/D producer holds blocks for consumers even while idle: its lease
        # timeouts need the engine to step now and then.
        holds = engine.kv_connector is not None
        while True:
            idle = not engine.has_unfinished_requests()
            if not self._handle_commands(block=idle, timed=holds):
                return
            if holds or engine.has_unfinished_requests():
                for output in engine.step():
                    self._deliver(output)

    def _deliver(self, output: Any) -> None:
        stream = self._streams.get(output.request_id)
        if stream is None:
            return  # aborted while in flight
        if output.finished:
            del self._streams[output.request_id]
        if output.error is not None:
            failure = RequestFailedError(f"request {output.request_id} failed")
            logger.error("%s: %s", failure, output.error)
            stream.push(failure)
            return
        try:
            stream.push(output)
        except Exception:
            # Nobody can be told, so at least stop spending compute on it.
            logger.exception("delivering output of %s failed", output.request_id)
            self._drop(output.request_id)

    def _drop(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        try:
            self._engine.abort_request(request_id)
        except Exception:
            logger.exception("aborting request %s failed", request_id)

    def _handle_commands(self, block: bool, timed: bool = False) -> bool:
        """Apply queued commands; False once the engine must stop. `timed`: a
        blocking wait ends after IDLE_HOUSEKEEPING_S anyway."""
        try:
            timeout = IDLE_HOUSEKEEPING_S if block and timed else None
            command = self._commands.get(block=block, timeout=timeout)
        except queue.Empty:
            return True
        while True:
            if isinstance(command, _Shutdown):
                self._fail_everything("the server is shutting down")
                return False
            if isinstance(command, _RankExited):
                self._fail_everything(command.reason)
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
                engine.add_request(
                    command.prompt,
                    command.params,
                    command.request_id,
                    kv_transfer_params=command.kv_transfer_params,
                )
            except Exception as error:
                command.stream.push(error)  # fails this request only
                return
            self._streams[command.request_id] = command.stream
        elif isinstance(command, _Abort):
            if command.request_id in self._streams:
                self._drop(command.request_id)
        elif isinstance(command, _Call):
            if not command.result.set_running_or_notify_cancel():
                return  # the caller stopped waiting
            try:
                command.result.set_result(command.fn(engine))
            except Exception as error:
                command.result.set_exception(error)

    def _fail_everything(self, reason: str) -> None:
        """Mark the engine dead (keeping an earlier reason) and fail every pending
        request and call."""
        with self._lock:
            if self._dead_reason is None:
                self._dead_reason = reason
            reason = self._dead_reason
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

    # ---- death (engine thread or rank monitor) ----

    def _watch_ranks(self, wait_for_rank_exit: Callable[[float], str | None]) -> None:
        while not self._stopping.is_set():
            exited = wait_for_rank_exit(RANK_POLL_S)
            if exited is None or self._stopping.is_set():
                continue
            logger.error("%s; the engine cannot continue", exited)
            with self._lock:
                if self._dead_reason is None:
                    self._dead_reason = exited  # /health says so from now on
                    self._commands.put(_RankExited(exited))  # wakes an idle engine
            self._thread.join(ENGINE_EXIT_GRACE_S)
            self._report_death()
            return

    def _report_death(self) -> None:
        with self._lock:
            if self._death_reported:
                return
            self._death_reported = True
            reason = self._dead_reason or "the engine thread stopped"
        if self._on_dead is not None:
            self._on_dead(reason)
