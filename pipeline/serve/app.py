"""The ASGI app of `pipeline serve` (Starlette): OpenAI's API for agents, and sessions.

Routes (each `/v1/...` route also lives under `/sessions/<id>/v1/...`, so an unmodified agent
joins a session by its base URL alone; a session named there must exist. An `X-Session-Id`
header names a session too, opened at its first call):

    POST /v1/chat/completions    POST /v1/completions    GET /v1/models    GET /health
    POST /sessions               GET /sessions/<id>      POST /sessions/<id>/reward
    POST /sessions/<id>/end      GET /metrics (`pipeline.serve.metrics`)

Bodies are read up to `max_body_bytes` (413 beyond), must be UTF-8 JSON objects (400 for
invalid UTF-8, malformed or too deeply nested JSON, naming what is wrong), and are validated
strictly (400 naming the field). A call runs on the event loop from start to answer (its Redis
scripts awaited on an asyncio client, `pipeline.serve.turns`), so thousands of calls can wait at
once without a thread each; the other routes' short steps (sync Redis) run in worker threads
under a limiter. With `api_key` set every route but `/health` wants `Authorization: Bearer <key>`.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from typing import Any

import anyio
import numpy as np
import orjson
import redis
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from pipeline.core.broker.connection import is_unavailable, ping_within
from pipeline.core.errors import PipelineError
from pipeline.serve.api_error import APIError
from pipeline.serve.live import answered_events, error_event
from pipeline.serve.metrics import CONTENT_TYPE as METRICS_TYPE
from pipeline.serve.metrics import render as render_metrics
from pipeline.serve.protocol import ChatCompletionBody, CompletionBody
from pipeline.serve.turns import InFlight, Turns
from pipeline.serve.validation import from_validation

log = logging.getLogger(__name__)
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
MAX_JSON_DEPTH = 64
THREADS = 256  # threads for the short steps of the other routes, and a call's rare ones (sync Redis)


_STEP = np.zeros(256, dtype=np.int32)  # a byte's change of the nesting depth
_STEP[list(b"[{")], _STEP[list(b"]}")] = 1, -1
_NOT_STRUCTURE = bytes(b for b in range(256) if b not in b'[]{}"')  # what the count drops


def json_depth(raw: bytes) -> int:
    """Nesting depth of valid JSON text, a scalar counting as a level (`1` is 1, `[1]` 2): the
    brackets outside strings, counted on the bytes at C speed (a walk of the parsed value cost a
    long conversation's call more than its new messages did). Escaped backslashes, then escaped
    quotes, are dropped (left to right, as JSON reads escapes), so every quote left delimits a
    string; then all but brackets and quotes, and a bracket is outside strings where an even number
    of quotes comes before it."""
    if b"\\" in raw:
        raw = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    marks = np.frombuffer(raw.translate(None, _NOT_STRUCTURE), dtype=np.uint8)
    outside = (np.cumsum(marks == ord('"')) & 1) == 0
    return int(np.cumsum(_STEP[marks] * outside).max(initial=0)) + 1


async def read_json(request: Request, max_bytes: int, *, empty: Any = None) -> Any:
    """The body as JSON, refused cleanly when too large, not UTF-8, malformed or too deep; `empty`
    for an empty body when given."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise APIError(413, f"the body is {declared} bytes; the limit is {max_bytes}", code="body_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise APIError(413, f"the body is over the limit of {max_bytes} bytes", code="body_too_large")
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw.strip() and empty is not None:
        return empty
    try:  # orjson parses a long conversation's body several times faster than the standard library
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        # What orjson refuses the standard library may take (NaN, integers past 64 bits, which the
        # request's own checks then refuse by field), and it says where the text is not JSON.
        data = _parsed_by_python(raw)
    if json_depth(raw) > MAX_JSON_DEPTH:
        raise APIError(400, f"the JSON body nests deeper than {MAX_JSON_DEPTH} levels", code="invalid_json")
    return data


def _parsed_by_python(raw: bytes) -> Any:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise APIError(400, f"the body is not UTF-8 (byte {exc.start})", code="invalid_json") from None
    try:
        data = json.loads(text)
    except RecursionError:
        raise APIError(400, f"the JSON body nests deeper than {MAX_JSON_DEPTH} levels", code="invalid_json") from None
    except ValueError as exc:
        raise APIError(400, f"the body is not valid JSON: {exc}", code="invalid_json") from None
    return data


def create_app(turns: Turns, *, api_key: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> Starlette:
    """The app serving `turns`' pool."""
    limiter = anyio.CapacityLimiter(THREADS)

    async def in_thread(fn: Callable[..., Any], *args: Any) -> Any:
        return await anyio.to_thread.run_sync(partial(fn, *args), limiter=limiter)

    def guarded(handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            try:
                if api_key is not None:
                    given = request.headers.get("authorization", "")
                    if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                        raise APIError(401, "missing or wrong API key (Authorization: Bearer <key>)",
                                       code="invalid_api_key")
                return await handler(request)
            except APIError as exc:
                return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)
            except ValidationError as exc:
                error = from_validation(exc)
                return JSONResponse(error.body(), status_code=error.status)
            except PipelineError as exc:
                return JSONResponse(APIError(400, str(exc)).body(), status_code=400)
            except Exception as exc:
                if is_unavailable(exc):  # down, or refusing writes, past PIPELINE_REDIS_RECONNECT_S
                    error = APIError(503, f"Redis is unavailable: {exc}; call again later", code="redis_unreachable",
                                     headers={"Retry-After": "5"})
                    return JSONResponse(error.body(), status_code=503, headers=error.headers)
                log.exception("unexpected error serving %s %s", request.method, request.url.path)
                return JSONResponse(APIError(500, "internal error; see the server's log").body(), status_code=500)
        return endpoint

    def session_of(request: Request) -> tuple[str | None, bool]:
        """The call's session, and whether to open it if unknown. A session named in the URL must exist
        (a typo is a 404); one named by the `X-Session-Id` header is opened at its first call, since
        harnesses send their own rollout ids there (verifiers does, on every call of a rollout)."""
        if "session_id" in request.path_params:
            return request.path_params["session_id"], False
        header = request.headers.get("x-session-id")
        return header, header is not None

    async def streamed(call: InFlight) -> Response:
        """A streamed call's events as its tokens come (`pipeline.serve.live`). The first batch is
        awaited before the response starts, so a turn that fails at once is an HTTP error as
        without streaming; a failure after that ends the stream with an error event."""
        items = turns.stream_async(call)
        live = call.live(call.turn_id)
        try:
            first = await anext(items)
            head = live.take(first) if isinstance(first, list) else None
        except BaseException:
            await items.aclose()
            raise

        async def events() -> AsyncIterator[bytes]:
            try:
                item: Any = first
                if head is not None:
                    for event in head:
                        yield event
                    item = await anext(items)
                while isinstance(item, list):
                    for event in live.take(item):
                        yield event
                    item = await anext(items)
                for event in live.finish(await asyncio.shield(turns.finish(call, item))):
                    yield event
            except APIError as exc:
                yield error_event(exc)
            except Exception:
                log.exception("unexpected error streaming turn %s", call.turn_id)
                yield error_event(APIError(500, "internal error; see the server's log"))
            finally:
                await items.aclose()

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    def openai_route(validate: Callable[[str | None, Any], ChatCompletionBody | CompletionBody],
                     start: Callable[..., Any]) -> Callable[[Request], Awaitable[Response]]:
        """`/v1/chat/completions` or `/v1/completions`: validate, start the turn, wait for its rows (its
        tokens too, when streamed), answer: all on the loop."""
        async def endpoint(request: Request) -> Response:
            data = await read_json(request, max_body_bytes)
            session_id, create = session_of(request)
            body = validate(session_id, data)
            # Shielded, as a thread was: a call whose client goes away while it starts is still claimed,
            # enqueued and answered (a retry of it then finds it), never left claimed and not enqueued.
            call = await asyncio.shield(start(body, session_id, create=create,
                                              idempotency_key=request.headers.get("idempotency-key"),
                                              retry_count=request.headers.get("x-stainless-retry-count")))
            if isinstance(call, dict):  # answered before (a client's retry): the same answer
                if body.stream:
                    return StreamingResponse(iter(answered_events(call, body.include_usage)),
                                             media_type="text/event-stream")
                return JSONResponse(call)
            if body.stream:
                return await streamed(call)
            return JSONResponse(await asyncio.shield(turns.finish(call, await turns.wait_async(call))))
        return endpoint

    chat = openai_route(turns.conversations.validated, turns.chat)
    completions = openai_route(lambda session_id, data: CompletionBody.model_validate(data), turns.completion)

    async def models(request: Request) -> Response:
        """The served model and the pool's LoRA adapters, each a `model` a call may name (vLLM's cards)."""
        base = turns.settings.model
        adapters = await in_thread(turns.dispatch.router.adapter_versions)
        return JSONResponse({"object": "list", "data": [
            {"id": base, "object": "model", "created": 0, "owned_by": "rollout-pipeline"},
            *({"id": name, "object": "model", "created": 0, "owned_by": "rollout-pipeline", "parent": base,
               "root": f"{name}@v{version}"} for name, version in sorted(adapters.items()))]})

    async def health(request: Request) -> Response:
        try:  # not `turns.conn`'s retries: a Redis down answers 503 within about PROBE_TIMEOUT_S
            await in_thread(ping_within, turns.conn)
        except redis.RedisError as exc:
            return JSONResponse({"status": "unhealthy", "redis": str(exc)}, status_code=503)
        workers = await in_thread(turns.dispatch.live_workers)
        return JSONResponse({"status": "ok", "pool": turns.settings.pool, "live_workers": len(workers)})

    async def metrics(request: Request) -> Response:
        await in_thread(turns.counts.flush)  # this server's own counts, up to date
        text = await in_thread(render_metrics, turns.conn, turns.settings.pool)
        return Response(text, media_type=METRICS_TYPE)

    async def create_session(request: Request) -> Response:
        data = await read_json(request, max_body_bytes, empty={})
        fields = {"run", "metadata", "session_id", "adapter", "history"}
        if not isinstance(data, dict) or set(data) - fields:
            raise APIError(400, 'POST /sessions takes {"run": NAME, "metadata": {...}, "session_id": ID, "adapter": '
                                'NAME, "history": "verbatim" or "template"}, all optional',
                           param=",".join(sorted(set(data) - fields)) if isinstance(data, dict) else None)
        metadata = data.get("metadata") or {}
        if not isinstance(metadata, dict):
            raise APIError(400, "metadata must be a JSON object", param="metadata")
        session = await in_thread(partial(turns.sessions.create, run=data.get("run") or turns.settings.run,
                                          pool=turns.settings.pool, output=turns.settings.output,
                                          metadata=metadata, session_id=data.get("session_id"),
                                          adapter=data.get("adapter"), history=data.get("history")))
        return JSONResponse(session.public(), status_code=201)

    async def get_session(request: Request) -> Response:
        session = await in_thread(turns.sessions.get, request.path_params["session_id"])
        return JSONResponse(session.public())

    async def reward(request: Request) -> Response:
        data = await read_json(request, max_body_bytes)
        session = await in_thread(turns.sessions.reward, request.path_params["session_id"], data)
        return JSONResponse(session.public())

    async def end(request: Request) -> Response:
        data = await read_json(request, max_body_bytes, empty={})  # optionally the reward, in the same call
        if data:
            await in_thread(turns.sessions.reward, request.path_params["session_id"], data)
        session = await in_thread(turns.sessions.end, request.path_params["session_id"])
        return JSONResponse(session.public())

    routes = []
    for prefix in ("", "/sessions/{session_id}"):
        routes += [
            Route(f"{prefix}/v1/chat/completions", guarded(chat), methods=["POST"]),
            Route(f"{prefix}/v1/completions", guarded(completions), methods=["POST"]),
            Route(f"{prefix}/v1/models", guarded(models), methods=["GET"]),
        ]
    routes += [
        Route("/health", health, methods=["GET"]),
        Route("/metrics", guarded(metrics), methods=["GET"]),
        Route("/sessions", guarded(create_session), methods=["POST"]),
        Route("/sessions/{session_id}", guarded(get_session), methods=["GET"]),
        Route("/sessions/{session_id}/reward", guarded(reward), methods=["POST"]),
        Route("/sessions/{session_id}/end", guarded(end), methods=["POST"]),
    ]
    async def http_error(request: Request, exc: Exception) -> Response:
        """Starlette's own errors (an unknown path, a method a route does not take) in OpenAI's JSON
        error shape, as every other error of the server."""
        status = getattr(exc, "status_code", 500)
        message = (f"no route {request.method} {request.url.path}; the API is under /v1 and "
                   "/sessions/<id>/v1 (chat/completions, completions, models)" if status == 404
                   else f"{request.method} is not allowed on {request.url.path}" if status == 405
                   else str(getattr(exc, "detail", "error")))
        error = APIError(status, message, code="not_found" if status == 404 else None)
        return JSONResponse(error.body(), status_code=status, headers=getattr(exc, "headers", None))

    return Starlette(routes=routes, exception_handlers={HTTPException: http_error})
