"""The OpenAI-compatible HTTP server: routes, the edge middleware, lifecycle and shutdown.

    request ─▶ Edge (edge.py: arrival stamp, API key, body size; any escaped exception -> 500, connection kept)
       generation routes: admission AT ARRIVAL, before the body is read (loading / draining / dead /
       a disaggregated role without workers / queue full -> 503); the admitted request holds a queue
       slot until the engine thread counts it ─▶ route ─▶ serving.py (parse strictly, tokenize,
       fan out) ─▶ EngineThread ─▶ GenerationResponse

    SIGTERM / SIGINT ─▶ draining: generation routes and /health answer 503
       ─▶ wait until every in-flight response is done, at most --drain-timeout seconds
       ─▶ abort the rest (their clients get finish_reason "abort") ─▶ write --record ─▶ exit 0
    a second signal skips the wait; SIGUSR1 writes the run directory without stopping.

Model loading runs on the engine thread while the server already answers (/health: 503 loading).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Scope

from phaselab.errors import InvalidRequestError
from phaselab.server import serving
from phaselab.server.engine_thread import DEAD, FAILED, LOADING, EngineThread, EngineUnavailable
from phaselab.server.api_errors import APIError, invalid, unavailable
from phaselab.server.edge import Edge
from phaselab.server.options import BUNDLED_MODEL_NAME, ServerConfig
from phaselab.server.responses import Choice, GenerationResponse
from phaselab.server.token_strings import TokenIdStrings, TokenStrings
from phaselab.server.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
)

logger = logging.getLogger("phaselab.server")

METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def served_model_name(model: str | None) -> str:
    """The bundled model's short name, else the model file's stem or directory's name."""
    if model is None:
        return BUNDLED_MODEL_NAME
    from phaselab.modelinfo.bundled import default_model_path

    with contextlib.suppress(Exception):
        if os.path.samefile(model, default_model_path()):
            return BUNDLED_MODEL_NAME
    p = Path(model.rstrip("/"))
    return p.stem if p.is_file() else p.name


class ServerState:
    """What the routes share: the engine thread, the config, and the drain bookkeeping."""

    def __init__(self, config: ServerConfig, engine: EngineThread) -> None:
        self.config = config
        self.engine = engine
        engine.model_name = config.model_name
        self.draining = False
        self.num_active = 0  # generation requests between admission and their last byte
        self.num_reserved = 0  # generation requests admitted at arrival, not yet handed to the engine
        self._idle = asyncio.Event()
        self._idle.set()
        self.tokens: TokenStrings | None = None
        self.exit_code = 0
        self.started_s = time.time()
        self.is_shut_down = False

    # -- admission -------------------------------------------------------------------------------------
    def admit(self, reserve: bool = False) -> None:
        """503 unless a new generation request may start now. Checked when the request arrives,
        before its body is read: `reserve` then holds one queue slot for it until its engine
        requests are handed to the engine thread (`release_reservation`), so a burst of
        simultaneous arrivals counts every member at once."""
        if self.draining:
            raise unavailable("the server is shutting down", code="draining", retry_after_s=self.config.retry_after_s)
        status = self.engine.status
        if status == LOADING:
            raise unavailable("the model is still loading", code="loading", retry_after_s=self.config.retry_after_s)
        if status != "ready":
            raise unavailable(self.engine.error or f"the engine is {status}", code="engine_unavailable",
                              retry_after_s=None)
        if self.engine.unavailable is not None:  # disagg: a role has no live worker; refuse before any prefill
            raise unavailable(f"{self.engine.unavailable}; retry later or restart the server",
                              code="no_live_worker", retry_after_s=self.config.retry_after_s)
        limit = self.config.max_queued_requests
        waiting = self.engine.num_waiting + self.num_reserved
        if waiting >= limit:
            raise unavailable(f"too many requests are waiting ({waiting}, limit {limit}); retry later",
                              code="queue_full", retry_after_s=self.config.retry_after_s)
        if reserve:
            self.num_reserved += 1

    def release_reservation(self, scope: Scope) -> None:
        """Idempotent: the slot goes back when the engine thread took the request (its adds then
        count in engine.num_waiting) or when the request ends without reaching the engine."""
        st = scope.get("state", {})
        if st.get("reserved"):
            st["reserved"] = False
            self.num_reserved -= 1

    def enter(self) -> None:
        self.num_active += 1
        self._idle.clear()

    def leave(self) -> None:
        self.num_active -= 1
        if self.num_active == 0:
            self._idle.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.config.model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {self.config.model_name!r}",
                           param="model", code="model_not_found")

    @property
    def info(self) -> Any:
        """The loaded engine's immutable facts (tokenizer, max_model_len, vocab size)."""
        if self.engine.engine is None:
            raise unavailable("the model is still loading", code="loading", retry_after_s=self.config.retry_after_s)
        return self.engine.engine

    def token_strings(self) -> TokenStrings:
        if self.tokens is None:
            self.tokens = TokenStrings(self.info.tokenizer)
        return self.tokens


def _error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


# -- the app ---------------------------------------------------------------------------------------------------
def create_app(state: ServerState) -> FastAPI:
    """Routes over a ServerState. The engine thread is started by the app's lifespan."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.engine.start()
        yield
        await shutdown_engine(state)

    import phaselab
    from phaselab.server.openapi import build_openapi

    app = FastAPI(title="phaselab", version=phaselab.__version__, lifespan=lifespan)
    app.state.server = state
    schema = build_openapi("phaselab", phaselab.__version__, api_key=state.config.api_key is not None)
    app.openapi = lambda: schema  # type: ignore[method-assign]

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error_response(APIError(exc.status_code, str(exc.detail), headers=dict(exc.headers or {})))

    # any other exception reaches _Edge, which answers 500 and keeps the connection open

    @app.get("/health")
    async def health() -> Response:
        status = state.engine.status
        if state.draining:
            status = "draining"
        if status == "ready" and state.engine.unavailable is not None:
            status = "degraded"
        ok = status == "ready"
        body: dict[str, Any] = {"status": "ok" if ok else status, "num_running": state.engine.num_running,
                                "num_waiting": state.engine.num_waiting,
                                "records": state.engine.records}  # what the phase recorder holds
        if state.engine.error and status in (DEAD, FAILED):
            body["error"] = state.engine.error
        if status == "degraded":
            body["reason"] = state.engine.unavailable
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/version")
    async def version() -> dict[str, str]:
        import phaselab

        return {"version": phaselab.__version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.engine.render_metrics(), media_type=METRICS_CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> Response:
        info = state.info
        card = ModelCard(id=state.config.model_name, root=str(info.checkpoint_path), max_model_len=info.max_model_len,
                         created=int(state.started_s))
        return Response(ModelList(data=[card]).model_dump_json(), media_type="application/json")

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        req = serving.parse_body(TokenizeRequest, await request.body())
        state.check_model(req.model)
        tok = state.info.tokenizer
        if (req.prompt is None) == (req.messages is None):
            raise invalid("give exactly one of prompt or messages", param="prompt")
        if req.messages is not None:
            text = serving.render_chat(tok, req.messages, req.add_generation_prompt, None)
            ids = tok.encode(text, add_special_tokens=False)
        else:
            ids = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        tokens = state.token_strings()
        return {"count": len(ids), "max_model_len": state.info.max_model_len, "tokens": ids,
                "token_strs": [tokens.text(t) for t in ids]}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        req = serving.parse_body(DetokenizeRequest, await request.body())
        state.check_model(req.model)
        serving.check_token_ids(req.tokens, state.info.model_config.vocab_size, "tokens")
        return {"prompt": state.info.tokenizer.decode(req.tokens, skip_special_tokens=False)}

    @app.post("/record/flush")
    async def record_flush() -> dict[str, Any]:
        path = state.config.record_dir
        if path is None:
            raise invalid("this server was started without --record DIR; there is no run directory to write")
        return await write_record(state)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _generate(state, request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _generate(state, request, "chat")

    app.add_middleware(Edge, config=state.config, state=state)
    return app


async def _generate(state: ServerState, request: Request, kind: str) -> Response:
    state.enter()
    try:
        return await _prepare(state, request, kind)
    except BaseException:
        state.leave()
        raise


async def _prepare(state: ServerState, request: Request, kind: str) -> Response:
    """Parse, tokenize and add; the returned response leaves `state` when its last byte is out."""
    arrived_ns = request.scope.get("state", {}).get("arrived_ns") or time.monotonic_ns()
    body = await request.body()
    info = state.info
    tok, max_model_len, vocab = info.tokenizer, info.max_model_len, info.model_config.vocab_size
    req: Any
    if kind == "chat":
        req = serving.parse_body(ChatCompletionRequest, body)
        state.check_model(req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise invalid("top_logprobs needs logprobs=true", param="top_logprobs")
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= serving.MAX_LOGPROBS:
            raise invalid(f"top_logprobs must be between 0 and {serving.MAX_LOGPROBS}", param="top_logprobs")
        num_logprobs = (req.top_logprobs or 0) if req.logprobs else None
        text = serving.render_chat(tok, req.messages, req.add_generation_prompt, req.chat_template_kwargs)
        prompts: list[tuple[list[int], str | None]] = [(tok.encode(text, add_special_tokens=False), None)]
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        max_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        prompt_param, echo = "messages", False
    else:
        req = serving.parse_body(CompletionRequest, body)
        state.check_model(req.model)
        num_logprobs = req.logprobs
        if num_logprobs is not None and not 0 <= num_logprobs <= serving.MAX_LOGPROBS:
            raise invalid(f"logprobs must be between 0 and {serving.MAX_LOGPROBS}", param="logprobs")
        prompts = []
        for p in serving.completion_prompts(req.prompt):
            if isinstance(p, str):
                prompts.append((tok.encode(p), p))
            else:
                serving.check_token_ids(p, vocab, "prompt")
                prompts.append((p, None))
        max_tokens, max_param, prompt_param, echo = req.max_tokens, "max_tokens", "prompt", req.echo
    tokenized_ns = time.monotonic_ns()
    if req.stop_token_ids:
        serving.check_token_ids(req.stop_token_ids, vocab, "stop_token_ids")
    if req.n < 1:
        raise invalid("n must be at least 1", param="n")
    num_choices = len(prompts) * req.n
    if num_choices > state.config.max_queued_requests:
        raise invalid(f"{num_choices} choices (prompts x n) exceed the server's queue limit of "
                      f"{state.config.max_queued_requests}", param="n")
    params = []
    for ids, _ in prompts:
        if not ids:
            raise invalid("the prompt is empty; give at least one token", param=prompt_param)
        limit = serving.resolve_max_tokens(len(ids), max_tokens, max_model_len, prompt_param, max_param)
        params.append(serving.sampling_params(req, limit, num_logprobs))

    response_id = serving.new_id("chatcmpl" if kind == "chat" else "cmpl")
    new = serving.fan_out(response_id, prompts, params, req.n)
    try:
        echoes = [await _echo(state, ids, text, num_logprobs) if echo else ("", [], None) for ids, text in prompts]
        choices = [Choice(index=r.index, request_id=r.request_id, prompt_index=r.index // req.n,
                                  num_prompt_tokens=len(r.prompt_token_ids), num_logprobs=num_logprobs,
                                  echo_text=echoes[r.index // req.n][0], echo_token_ids=echoes[r.index // req.n][1],
                                  echo_logprobs=echoes[r.index // req.n][2]) for r in new]
        # the reservation ends where the engine thread starts counting them as pending adds
        queue = await state.engine.add(new, arrived_ns, tokenized_ns,
                                       on_submitted=lambda: state.release_reservation(request.scope))
        # nothing may fail after this
    except InvalidRequestError as e:
        raise invalid(str(e), param=prompt_param) from None
    except EngineUnavailable as e:
        raise unavailable(str(e), code="engine_unavailable", retry_after_s=None) from None
    include_usage = bool(req.stream and req.stream_options and req.stream_options.include_usage)
    return GenerationResponse(
        kind=kind, engine=state.engine, response_id=response_id, model=state.config.model_name, choices=choices,
        queue=queue, request_ids=[r.request_id for r in new], stream=req.stream, include_usage=include_usage,
        tokens=TokenIdStrings(state.token_strings()) if req.return_tokens_as_token_ids
        else state.token_strings(),
        on_done=state.leave)


async def _echo(state: ServerState, ids: list[int], text: str | None, num_logprobs: int | None
                ) -> tuple[str, list[int], Any]:
    """What `echo` prepends: the prompt's text, its ids, and (with logprobs) its own logprobs from
    one teacher-forced pass on the engine thread."""
    logprobs = None
    if num_logprobs is not None:
        logprobs = await state.engine.call(serving.prompt_logprobs_fn(ids, num_logprobs))
    echo_text = text if text is not None else state.info.tokenizer.decode(ids, skip_special_tokens=False)
    return echo_text, list(ids), logprobs


# -- record and shutdown ---------------------------------------------------------------------------------
async def write_record(state: ServerState) -> dict[str, Any]:
    path = state.config.record_dir
    assert path is not None

    def write(engine: Any) -> dict[str, Any]:
        engine.write_record(path)
        return {"path": os.path.abspath(path), "num_requests": len(engine.finished_requests),
                "num_iterations": len(engine.iterations)}

    try:
        return await state.engine.call(write)  # type: ignore[no-any-return]
    except EngineUnavailable as e:
        raise unavailable(str(e), code="engine_unavailable") from None


async def drain(state: ServerState, force: asyncio.Event) -> None:
    """Stop admitting, let in-flight requests finish (up to the drain timeout), abort the rest."""
    state.draining = True
    timeout = state.config.drain_timeout_s
    logger.info("draining: %d requests in flight, waiting up to %.1f s", state.num_active, timeout)
    idle = asyncio.create_task(state.wait_idle(timeout))
    forced = asyncio.create_task(force.wait())
    await asyncio.wait({idle, forced}, return_when=asyncio.FIRST_COMPLETED)
    forced.cancel()
    if state.num_active and state.engine.engine is not None:
        logger.info("drain: aborting %d requests still in flight", state.num_active)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(state.engine.abort_all(), 5)
        await state.wait_idle(2.0)  # let their final "abort" chunks reach the transport
    idle.cancel()


async def shutdown_engine(state: ServerState) -> None:
    """Write the run directory (--record) and stop the engine thread; idempotent."""
    if state.is_shut_down:
        return
    state.is_shut_down = True
    state.draining = True
    if state.num_active and state.engine.engine is not None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(state.engine.abort_all(), 5)
    if state.config.record_dir and state.engine.engine is not None:
        try:
            info = await asyncio.wait_for(write_record(state), 30)
            logger.info("run directory written to %s (%d requests)", info["path"], info["num_requests"])
        except Exception:  # noqa: BLE001 - shutting down anyway; say why
            logger.exception("could not write the run directory")
    await state.engine.stop()


def run_server(engine_args: Any, config: ServerConfig, host: str = "127.0.0.1", port: int = 8000,
               log_level: str = "info", disagg_config: Any = None) -> int:
    """Serve until SIGTERM/SIGINT, then drain and return the exit code (0 after a clean drain)."""
    import uvicorn

    from phaselab.serving_engine import make_engine

    def build_engine() -> Any:
        # without --record nothing reads the kept records, and a long-running server would
        # accumulate every iteration and request forever: observe them into Prometheus and drop them
        return make_engine(engine_args, keep_records=config.record_dir is not None, disagg_config=disagg_config)

    state = ServerState(config, EngineThread(build_engine))
    app = create_app(state)

    class Server(uvicorn.Server):
        """uvicorn with phaselab's signal handling: drain first, then exit (uvicorn's own would
        close the listener at once and re-raise the signal afterwards, exiting non-zero)."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            loop = asyncio.get_running_loop()
            force = asyncio.Event()
            tasks: list[asyncio.Task[None]] = []

            async def drain_and_exit() -> None:
                await drain(state, force)
                await shutdown_engine(state)
                self.should_exit = True

            def on_signal(sig: int) -> None:
                if state.draining:
                    logger.info("second %s: aborting what is left", signal.Signals(sig).name)
                    force.set()
                    return
                logger.info("%s: shutting down", signal.Signals(sig).name)
                state.draining = True  # now, not when the task first runs: a second signal must see it
                tasks.append(loop.create_task(drain_and_exit()))

            def on_usr1() -> None:
                if config.record_dir:
                    tasks.append(loop.create_task(_flush_quietly(state)))

            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, on_signal, sig)
            loop.add_signal_handler(signal.SIGUSR1, on_usr1)
            watcher = loop.create_task(_exit_if_load_fails(state, self))
            try:
                yield
            finally:
                watcher.cancel()
                for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
                    loop.remove_signal_handler(sig)

    uv_config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                               timeout_graceful_shutdown=3, access_log=log_level == "debug")
    server = Server(uv_config)
    server.run()
    return state.exit_code if server.started else (state.exit_code or 1)


async def _flush_quietly(state: ServerState) -> None:
    try:
        info = await write_record(state)
        logger.info("run directory written to %s (%d requests)", info["path"], info["num_requests"])
    except Exception:  # noqa: BLE001
        logger.exception("could not write the run directory")


async def _exit_if_load_fails(state: ServerState, server: Any) -> None:
    while state.engine._ready is None:  # the lifespan starts the engine thread
        await asyncio.sleep(0.05)
    await state.engine.wait_ready()
    if state.engine.status == FAILED:
        logger.error("%s; exiting", state.engine.error)
        state.exit_code = 1
        server.should_exit = True
