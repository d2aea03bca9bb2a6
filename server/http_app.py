"""The FastAPI app: routes, OpenAI-shaped errors, body-size limit and API-key check.

The app is built around an explicit `OpenAIApi`: under Ray Serve the ingress builds it in
the replica (after its __init__), in unit tests it is built in-process.
"""
from __future__ import annotations

import hmac
import logging
from pathlib import Path
from typing import Any, Awaitable, Callable

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server import eval_results
from server.dashboard import dashboard_data
from server.event_stream import EventStreamResponse
from server.messages_api import add_messages_routes
from server.messages_protocol import error_body as messages_error_body
from server.messages_protocol import is_messages_path
from server.openai_api import ApiError, OpenAIApi
from server.prometheus import render_prometheus
from server.protocol import (
    AttentionRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    LoadLoraAdapterRequest,
    TokenizeRequest,
    UnloadLoraAdapterRequest,
    error_body,
)
from server.response_store import StoreClient
from server.responses_api import add_responses_routes
from server.wire import MetricsSnapshot

logger = logging.getLogger(__name__)
PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")
STATIC = Path(__file__).parent / "static"


def _error(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
           code: Any = None, headers: dict[str, str] | None = None, path: str = "") -> JSONResponse:
    """OpenAI's error shape; Anthropic's under /v1/messages (`path`: the route's path, see `_path`)."""
    body = messages_error_body(status, message) if is_messages_path(path) else error_body(message, type_, param, code)
    return JSONResponse(body, status_code=status, headers=headers)


def _path(scope: Scope) -> str:
    """The path the routes see: under a route prefix (Serve), scope["path"] keeps it."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


class GuardMiddleware:
    """Rejects oversized bodies (413) and, when an API key is set, unauthenticated /v1 calls (401): the key
    comes as `Authorization: Bearer` (OpenAI's clients) or `x-api-key` (Anthropic's).

    A raw ASGI middleware, so the body is counted as it streams in, Content-Length or not.
    """

    def __init__(self, app: ASGIApp, max_body_bytes: int, api_key: str | None) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.api_key = api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit, api_key = self.max_body_bytes, self.api_key
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        path = _path(scope)
        if api_key and path.startswith(PROTECTED_PREFIXES):
            given = headers.get("authorization", "")
            token = given[7:] if given.lower().startswith("bearer ") else headers.get("x-api-key", "")
            if not hmac.compare_digest(token.encode(), api_key.encode()):  # constant-time
                return await _error(401, "invalid or missing API key", "authentication_error",
                                    code="invalid_api_key", path=path)(scope, receive, send)
        declared = headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit:
            return await _too_large(limit, receive, send, body_done=False, path=path)
        seen, over, body_done = 0, False, False

        async def limited_receive() -> Message:
            nonlocal seen, over, body_done
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                body_done = not message.get("more_body", False)
                if seen > limit:
                    over = True
                    raise _BodyTooLarge()
            return message

        async def guarded_send(message: Message) -> None:
            if not over:  # the app's answer to _BodyTooLarge (FastAPI makes it a 400) is replaced by the 413
                await send(message)
        try:
            await self.app(scope, limited_receive, guarded_send)
        except Exception:
            if not over:
                raise
        if over:
            await _too_large(limit, receive, send, body_done, path)


class _BodyTooLarge(Exception):
    pass


# NOTE: after a 413 the rest of the body is read and dropped (like nginx's lingering close): closing a
# socket with unread data makes the kernel send RST, and a client still uploading (urllib, anything that
# sends "Connection: close") gets "Connection reset by peer" instead of the 413. Capped in bytes and
# time so a huge or slow-loris upload cannot hold the task; past the caps the connection is just closed.
LINGER_MAX_BYTES = 64 * 2**20
LINGER_MAX_SECONDS = 30.0


async def _too_large(limit: int, receive: Receive, send: Send, body_done: bool, path: str) -> None:
    """The 413's bytes go out first, so clients that read while uploading get it at once; the response
    is only completed after the drain, because the server stops handing over the body once it is."""
    response = _error(413, f"request body exceeds {limit} bytes", code="request_too_large", path=path)
    await send({"type": "http.response.start", "status": 413, "headers": response.raw_headers})
    await send({"type": "http.response.body", "body": response.body, "more_body": True})
    dropped = 0
    with anyio.move_on_after(LINGER_MAX_SECONDS):
        while not body_done and dropped <= LINGER_MAX_BYTES:
            message = await receive()
            if message["type"] != "http.request":
                break
            dropped += len(message.get("body", b""))
            body_done = not message.get("more_body", False)
    await send({"type": "http.response.body", "body": b"", "more_body": False})


def _param(loc: tuple) -> str | None:
    parts = [str(p) for p in loc if p not in ("body", "query", "path")]
    return ".".join(parts) if parts else None


def create_app(api: OpenAIApi, api_key: str | None = None,
               snapshots: Callable[[], Awaitable[list[MetricsSnapshot]]] | None = None,
               responses_store: StoreClient | None = None) -> FastAPI:
    """`snapshots` returns every replica's metrics snapshot (see server/metrics.py)."""
    app = FastAPI(title="attnserve", version="0.1.0", description="OpenAI-compatible text generation")
    page, attention_page, uplot_js, uplot_css = ((STATIC / name).read_bytes() for name in (
        "dashboard.html", "attention.html", "uplot/uPlot.iife.min.js", "uplot/uPlot.min.css"))
    app.add_middleware(GuardMiddleware, max_body_bytes=api.limits.max_body_bytes, api_key=api_key)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        msg = "; ".join(f"{_param(tuple(e.get('loc', ()))) or 'body'}: {e.get('msg')}" for e in errors[:5])
        return _error(400, msg or "invalid request", param=_param(tuple(first.get("loc", ()))),
                      path=_path(request.scope))

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return _error(exc.status, str(exc), exc.type, exc.param, exc.code, exc.headers, _path(request.scope))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(exc.status_code, str(exc.detail), "not_found_error" if exc.status_code == 404 else
                      "invalid_request_error", path=_path(request.scope))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return _error(500, f"internal error: {type(exc).__name__}", "server_error", path=_path(request.scope))

    def respond(result: Any) -> Any:
        return JSONResponse(result) if isinstance(result, dict) else EventStreamResponse(result)

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        models = await api.health()
        ok = bool(models) and all(models.values())
        return JSONResponse({"status": "ok" if ok else "unavailable", "models": models}, status_code=200 if ok else 503)

    async def all_snapshots() -> list[MetricsSnapshot]:
        return await snapshots() if snapshots is not None else []

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(render_prometheus(await all_snapshots()), media_type=CONTENT_TYPE_LATEST)

    @app.get("/dashboard")
    async def dashboard() -> Response:
        return Response(page, media_type="text/html")

    @app.get("/dashboard/attention")
    async def dashboard_attention() -> Response:
        return Response(attention_page, media_type="text/html")

    @app.get("/dashboard/data")
    async def dashboard_json() -> JSONResponse:
        # eval rows come from the file `attnserve eval` writes; nothing is computed here
        return JSONResponse({**dashboard_data(await all_snapshots()), "eval": eval_results.load()})

    @app.get("/dashboard/uplot.js")
    async def dashboard_js() -> Response:
        return Response(uplot_js, media_type="text/javascript")

    @app.get("/dashboard/uplot.css")
    async def dashboard_css() -> Response:
        return Response(uplot_css, media_type="text/css")

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        return JSONResponse(await api.models())

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return respond(await api.completions(body))

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        return respond(await api.chat(body))

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request) -> JSONResponse:
        return JSONResponse(await api.embeddings(body))

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest, request: Request) -> JSONResponse:
        return JSONResponse(await api.tokenize(body))

    @app.post("/v1/attention")
    async def attention(body: AttentionRequest, request: Request) -> JSONResponse:
        return JSONResponse(await api.attention(body))

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, request: Request) -> JSONResponse:
        return JSONResponse(await api.detokenize(body))

    def runtime_lora() -> None:
        """NOTE: these endpoints read paths on the server: only behind an API key (GuardMiddleware checks
        it: they are under /v1/), or where the operator allowed them without one."""
        if not (api_key or api.allow_runtime_lora):
            raise ApiError(403, "loading LoRA adapters at run time is off: serve with --api-key, or with "
                           "--allow-runtime-lora on a trusted network", type_="permission_error",
                           code="runtime_lora_disabled")

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoraAdapterRequest, request: Request) -> JSONResponse:
        runtime_lora()
        return JSONResponse(await api.load_lora_adapter(body))

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoraAdapterRequest, request: Request) -> JSONResponse:
        runtime_lora()
        return JSONResponse(await api.unload_lora_adapter(body))

    add_responses_routes(app, api, responses_store)
    add_messages_routes(app, api)
    return app


