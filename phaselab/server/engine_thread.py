"""The engine loop in a thread of its own; the HTTP event loop talks to it through queues.

    event loop (HTTP handlers)                      engine thread (the only caller of LLMEngine)
    ──────────────────────────                      ────────────────────────────────────────────
    add(requests)  ─┐                               load the model, then forever:
    close(ids)      ├─ commands (SimpleQueue) ──▶     apply every queued command   (between steps)
    stamp_sent(...) │                                 step() if anything is unfinished
    call(fn)       ─┘                                 outputs -> per-request Deltas
    per-request asyncio.Queue  ◀── loop.call_soon_threadsafe(one batch per step) ──┘

Requests join and leave only between steps, so the engine never sees two threads. A slow client
only grows its own asyncio queue; the engine thread never waits on the network. When idle, the
thread blocks on the command queue (no polling).

Delivery: the engine runs with `stamp_sent = False`; the server appends each token's
`token_sent_ns` (bytes handed to the transport) through `stamp_sent()`, applied on this thread,
and `close()` ends with `engine.mark_delivered(id, last write)`: only then does the engine close
the request's record (finished_ns, Prometheus), so TTFT, ITL and delivery see the socket times.

An exception in `step()` fails every request in flight (their streams get an error Delta, i.e.
HTTP 500 or an error event) and marks the engine dead (/health 503); the thread then answers
commands without stepping, so no client ever waits on a loop that is gone.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from phaselab.core.outputs import EngineStats, TokenLogprobs
from phaselab.core.recorder import PhaseRecorder
from phaselab.core.sampling_params import SamplingParams
from phaselab.core.timing import RequestMetrics

logger = logging.getLogger("phaselab.server")

LOADING, READY, DEAD, FAILED, STOPPED = "loading", "ready", "dead", "failed", "stopped"
HEARTBEAT_S = 0.5  # idle engines with a heartbeat() (disagg: poll the workers) run it this often


class EngineUnavailable(Exception):
    """The engine cannot take requests (loading, dead, stopped); the message says which."""


@dataclass
class NewRequest:
    """One engine request of an HTTP request (a choice: one prompt, one of its n samples)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    index: int  # the choice index in the HTTP response
    prompt: str | None = None


@dataclass
class Delta:
    """What one step (or an abort, or a failure) produced for one choice, since the last Delta."""

    index: int
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None
    stop_reason: int | str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    metrics: RequestMetrics | None
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None


@dataclass
class _Route:
    """Engine-thread state of a request the server listens to."""

    queue: asyncio.Queue[Delta]
    index: int
    num_tokens: int = 0  # output tokens already delivered
    num_chars: int = 0  # output text already delivered


class EngineThread:
    """Owns an LLMEngine on a dedicated thread. Event-loop methods are async or non-blocking."""

    def __init__(self, make_engine: Callable[[], Any]) -> None:
        self._make_engine = make_engine
        self.model_name: str | None = None  # the served name: labels the vLLM-named metrics
        self.engine: Any = None  # set once loaded; only the engine thread may call into it
        self.status = LOADING
        self.error: str | None = None
        self._commands: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="phaselab-engine", daemon=True)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready: asyncio.Event | None = None
        # event-loop view of the engine, refreshed after every step and command batch
        self.num_engine_waiting = 0
        self.unavailable: str | None = None  # why no new request can be served (disagg: a role has no live worker)
        self.num_running = 0
        self.num_unfinished = 0
        self.records: dict[str, int] = {}  # what the engine's phase recorder holds (engine.stats().records)
        self._num_pending_adds = 0  # engine requests sent with add() and not applied yet
        # engine-thread state
        self._routes: dict[str, _Route] = {}
        self._metrics: Any = None  # the engine's EngineMetrics
        self._deliveries: list[tuple[asyncio.Queue[Delta], Delta]] = []
        self._acks: list[tuple[asyncio.Future[Any], Any, BaseException | None]] = []
        self._num_applied_adds = 0
        self._stopping = False  # engine thread: the stop command was applied
        self._dead = False
        self._closed = False  # event loop: stop() was called, nothing new may be queued

    # -- event-loop side ----------------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._ready = asyncio.Event()
        self._thread.start()

    async def wait_ready(self) -> None:
        assert self._ready is not None
        await self._ready.wait()

    @property
    def num_waiting(self) -> int:
        """Requests waiting for admission: the engine's waiting queue plus adds not applied yet."""
        return self.num_engine_waiting + self._num_pending_adds

    def render_metrics(self) -> bytes:
        """Prometheus text (prometheus_client's collectors are thread-safe to read)."""
        if self._metrics is None:
            return b""
        return self._metrics.render()  # type: ignore[no-any-return]

    def _check_available(self) -> None:
        if self._closed:
            raise EngineUnavailable("the engine is stopping")
        if self.status != READY:
            raise EngineUnavailable(self.error or f"the engine is {self.status}")

    async def add(self, requests: list[NewRequest], arrived_ns: int, tokenized_ns: int,
                  on_submitted: Callable[[], None] | None = None) -> asyncio.Queue[Delta]:
        """Add engine requests (all or none); their Deltas arrive on the returned queue.
        `on_submitted` runs as soon as they count in `num_waiting` (before the engine took them).

        Raises InvalidRequestError (the engine refused them) or EngineUnavailable.
        """
        self._check_available()
        assert self._loop is not None
        q: asyncio.Queue[Delta] = asyncio.Queue()
        fut: asyncio.Future[Any] = self._loop.create_future()
        self._num_pending_adds += len(requests)
        if on_submitted is not None:
            on_submitted()
        self._commands.put(("add", requests, arrived_ns, tokenized_ns, q, fut))
        try:
            await fut
        except asyncio.CancelledError:
            self.close([r.request_id for r in requests])  # FIFO: applied after the add
            raise
        return q

    def close(self, request_ids: list[str]) -> None:
        """The server stops listening: abort what is unfinished; close the records of finished
        ones not marked delivered yet (their response ended without their last chunk)."""
        self._commands.put(("close", request_ids, time.monotonic_ns()))

    def stamp_sent(self, metrics: RequestMetrics, num_tokens: int, sent_ns: int, delivered_id: str | None = None
                   ) -> None:
        """`num_tokens` more tokens of this request were handed to the transport at `sent_ns`;
        `delivered_id`: that write carried the request's last chunk."""
        if num_tokens > 0 or delivered_id is not None:
            self._commands.put(("stamp", metrics, num_tokens, sent_ns, delivered_id))

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """Run fn(engine) on the engine thread between steps; return its result (or raise)."""
        if self.engine is None or self._closed:
            raise EngineUnavailable(self.error or f"the engine is {'stopping' if self._closed else self.status}")
        assert self._loop is not None
        fut: asyncio.Future[Any] = self._loop.create_future()
        self._commands.put(("call", fn, fut))
        return await fut

    async def abort_all(self) -> None:
        """Abort every request in flight; their streams end with finish_reason "abort"."""
        if self._closed:
            return
        assert self._loop is not None
        fut: asyncio.Future[Any] = self._loop.create_future()
        self._commands.put(("abort_all", fut))
        await fut

    async def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the thread after the commands already queued (a step in progress finishes first);
        every later add/call is refused at once, so nothing waits on a thread that is gone."""
        self._closed = True
        self._commands.put(("stop",))
        if self._thread.is_alive():
            await asyncio.to_thread(self._thread.join, timeout_s)

    def _on_batch(self, acks: list[tuple[asyncio.Future[Any], Any, BaseException | None]],
                  deliveries: list[tuple[asyncio.Queue[Delta], Delta]], num_adds: int,
                  stats: EngineStats | None, status: tuple[str, str | None] | None) -> None:
        self._num_pending_adds -= num_adds
        if stats is None:
            self.num_engine_waiting = self.num_running = self.num_unfinished = 0
            self.unavailable = None
        else:
            self.num_engine_waiting, self.num_running = stats.num_waiting, stats.num_running
            self.num_unfinished, self.records = stats.num_unfinished, stats.records
            self.unavailable = stats.unavailable
        if status is not None:
            self.status, self.error = status
            if self._ready is not None and status[0] != LOADING:
                self._ready.set()
        for q, delta in deliveries:
            q.put_nowait(delta)
        for fut, result, exc in acks:
            if not fut.done():
                if exc is not None:
                    fut.set_exception(exc)
                else:
                    fut.set_result(result)

    # -- engine thread ---------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            engine = self._make_engine()
            engine.stamp_sent = False  # the server stamps token_sent_ns at the socket
            self._metrics = engine.metrics
            if self.model_name is not None and hasattr(engine.metrics, "enable_vllm_names"):
                engine.metrics.enable_vllm_names(self.model_name)  # vLLM dashboards work unchanged
            self.engine = engine
        except BaseException as e:  # noqa: BLE001 - reported through /health and the log
            logger.exception("the engine failed to load")
            self._flush(status=(FAILED, f"the engine failed to load: {e}"))
            self._serve_dead()
            return
        self._flush(status=(READY, None))
        # an engine with workers of its own (disagg) is checked even while idle: a dead role must
        # show in /health and admission before the next request arrives, not after it failed
        heartbeat = getattr(engine, "heartbeat", None)
        while not self._stopping:
            idle = not engine.has_unfinished_requests()
            self._apply_commands(block=idle, timeout_s=HEARTBEAT_S if heartbeat is not None else None)
            if self._stopping or self._dead:
                break
            if heartbeat is not None and not engine.has_unfinished_requests():
                try:
                    heartbeat()
                except Exception as e:  # noqa: BLE001 - as a failed step
                    self._die(e)
                    break
            if engine.has_unfinished_requests():
                try:
                    outputs = engine.step()
                except Exception as e:  # noqa: BLE001 - isolate: fail requests, keep serving errors
                    self._die(e)
                    break
                self._dispatch(outputs)
            else:
                self._refresh_idle_gauges()
            self._flush()
        if self._dead:
            self._serve_dead()
        try:
            engine.shutdown()  # e.g. disagg: stop the Ray workers
        except Exception:  # noqa: BLE001 - stopping anyway
            logger.exception("engine shutdown failed")
        self._flush(status=(STOPPED, self.error) if not self._dead else None)

    def _serve_dead(self) -> None:
        """After a failure: no more steps, but every command still gets an answer."""
        while not self._stopping:
            self._apply_commands(block=True)
            self._flush()

    def _apply_commands(self, block: bool, timeout_s: float | None = None) -> None:
        try:
            cmd = self._commands.get(timeout=timeout_s) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, cmd: tuple[Any, ...]) -> None:
        kind = cmd[0]
        engine = self.engine
        if kind == "add":
            _, requests, arrived_ns, tokenized_ns, q, fut = cmd
            self._num_applied_adds += len(requests)
            if engine is None or self._dead or self._stopping:
                self._acks.append((fut, None, EngineUnavailable(self.error or "the engine is not running")))
                return
            added: list[str] = []
            try:
                for r in requests:
                    engine.add_request(r.prompt_token_ids, r.params, request_id=r.request_id, arrived_ns=arrived_ns,
                                       tokenized_ns=tokenized_ns, prompt_text=r.prompt)  # the server tokenized it
                    added.append(r.request_id)
                    self._routes[r.request_id] = _Route(q, r.index)
            except Exception as e:  # noqa: BLE001 - all or none: undo, then report
                for rid in added:
                    self._routes.pop(rid, None)
                engine.abort_request(added)
                self._acks.append((fut, None, e))
                return
            self._acks.append((fut, None, None))
        elif kind == "close":
            _, ids, sent_ns = cmd
            listening = [rid for rid in ids if self._routes.pop(rid, None) is not None]
            if engine is not None and not self._dead:
                if listening:
                    engine.abort_request(listening)  # unfinished ones only: finished ids are forgotten
                for rid in ids:
                    engine.mark_delivered(rid, sent_ns)
        elif kind == "stamp":
            _, m, n, sent_ns, delivered_id = cmd
            PhaseRecorder.stamp_sent(m, sent_ns, n)
            if delivered_id is not None and engine is not None:
                engine.mark_delivered(delivered_id, sent_ns)
        elif kind == "call":
            _, fn, fut = cmd
            try:
                self._acks.append((fut, fn(engine), None))
            except Exception as e:  # noqa: BLE001 - the caller gets it
                self._acks.append((fut, None, e))
        elif kind == "abort_all":
            if self._routes and engine is not None and not self._dead:
                self._dispatch(engine.abort_request(list(self._routes)))
            self._acks.append((cmd[1], None, None))
        elif kind == "stop":
            self._stopping = True
        else:  # pragma: no cover
            raise AssertionError(f"unknown command {kind!r}")

    def _dispatch(self, outputs: list[Any]) -> None:
        """Turn the engine's cumulative outputs into per-request Deltas (new tokens, new text)."""
        for out in outputs:
            route = self._routes.get(out.request_id)
            if route is None:
                continue  # closed by the server (client gone)
            c = out.outputs[0]
            start = route.num_tokens
            text = c.text
            delta = Delta(
                index=route.index,
                token_ids=c.token_ids[start:],
                text=text[route.num_chars:],
                logprobs=c.logprobs[start:] if c.logprobs is not None else None,
                finish_reason=c.finish_reason if out.finished else None,
                stop_reason=c.stop_reason if out.finished else None,
                num_prompt_tokens=len(out.prompt_token_ids),
                num_cached_tokens=out.num_cached_tokens,
                metrics=out.metrics,
                error=getattr(c, "error", None) if out.finished else None,  # e.g. disagg: no decode worker left
            )
            route.num_tokens, route.num_chars = len(c.token_ids), len(text)
            if out.finished:
                del self._routes[out.request_id]
            self._deliveries.append((route.queue, delta))

    def _die(self, e: Exception) -> None:
        self._dead = True
        self.error = f"the engine loop failed: {type(e).__name__}: {e}"
        logger.error("%s\n%s", self.error, traceback.format_exc())
        for rid, route in self._routes.items():
            self._deliveries.append((route.queue, Delta(
                index=route.index, token_ids=[], text="", logprobs=None, finish_reason=None, stop_reason=None,
                num_prompt_tokens=0, num_cached_tokens=0, metrics=None, error=self.error)))
        self._routes.clear()
        self._flush(status=(DEAD, self.error))

    def _refresh_idle_gauges(self) -> None:
        """The engine sets its gauges per iteration; once idle (e.g. after aborts) no iteration runs."""
        engine = self.engine
        if engine is not None and hasattr(engine, "refresh_gauges"):
            engine.refresh_gauges()

    def _flush(self, status: tuple[str, str | None] | None = None) -> None:
        """Hand this round's acks, deltas and stats to the event loop in one callback."""
        engine = self.engine
        stats = engine.stats() if engine is not None and not self._dead else None
        acks, self._acks = self._acks, []
        deliveries, self._deliveries = self._deliveries, []
        num_adds, self._num_applied_adds = self._num_applied_adds, 0
        if self._loop is None:
            return
        try:
            self._loop.call_soon_threadsafe(self._on_batch, acks, deliveries, num_adds, stats, status)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass
