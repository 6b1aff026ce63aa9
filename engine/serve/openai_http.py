"""An OpenAI-compatible HTTP endpoint on the engine daemon (opt-in: `wd-engine serve --http-port`).

`/v1/completions` (plain prompts, or FIM through `suffix`; streaming as server-sent events),
`/v1/models` and `/health`, on Starlette + uvicorn. It runs in the daemon's own event loop and
goes through the same `CompletionService` (engine.serve.service) as the msgpack path, so both
share one prompt builder, one context check, one scheduler and one prefix cache. Every `/v1/*`
route needs `Authorization: Bearer <token>`; `/health` answers without it (load balancers probe
it) and says nothing but ok/draining.

Errors use OpenAI's shape, {"error": {"message", "type", "param", "code"}}: 400 for bad
parameters, a body that is not a JSON object, or a prompt longer than the context; 401 without a
valid token; 404 for another model name or path; 413 for a body over `MAX_BODY_BYTES`; 429 when
`HttpOptions.max_requests` completions are already in flight, or the engine refuses more
(TOO_MANY_REQUESTS); 503 while draining, when the KV pool can't hold the request, or on an
engine error. The engine's refusals and error events carry an `ErrorCode`, and `ENGINE_ERRORS`
gives the status, type and code for it: never read from the message. A client that disconnects
mid-request cancels its engine request.

Text fields may hold lone surrogates (JSON's "\\ud800" is valid syntax, but no UTF-8 can hold
it; editors that cut text at a UTF-16 offset split pairs): each becomes U+FFFD, as a lossy
UTF-16 decoder does, so such a prompt is completed rather than refused.

Fairness: all HTTP requests are one owner of the engine (`HTTP_OWNER`), sharing it with each
msgpack connection as one client does, and at most `max_requests` are in flight at once. One
owner, not one per peer: every HTTP client holds the same bearer token, and on loopback (where
the listener belongs) peers differ only by their source port, a new one per connection, so a
key per peer would hand each parallel request its own turn and its own share of the pool.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import secrets
import socket
import time
from dataclasses import dataclass
from typing import NamedTuple

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from engine.core.request import BadRequest, Event, Request, RequestRefused
from engine.ipc import protocol as P
from engine.ipc.protocol import ErrorCode
from engine.serve.service import CompletionService

log = logging.getLogger("wd_engine.http")

MAX_BODY_BYTES = P.MAX_FRAME_BYTES
LOOPBACK = ("127.0.0.1", "::1", "localhost")
LONE_SURROGATE = re.compile("[\ud800-\udfff]")  # json.loads joins valid pairs: what is left is lone

HTTP_OWNER = "http"  # the engine's fairness key for every HTTP request (see above)
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # OpenAI's code; clients trim their prompt


class HttpError(NamedTuple):
    status: int
    type: str
    code: str  # OpenAI's own where it has one, else the engine's
    param: str | None = None


# The engine's error codes as what an OpenAI client expects; any other code is answered as the
# engine's own failure.
ENGINE_ERRORS: dict[ErrorCode, HttpError] = {
    ErrorCode.BAD_REQUEST: HttpError(400, "invalid_request_error", ErrorCode.BAD_REQUEST),
    ErrorCode.CONTEXT_EXCEEDED: HttpError(
        400, "invalid_request_error", CONTEXT_LENGTH_EXCEEDED, param="prompt"
    ),
    # Clients back off and retry.
    ErrorCode.TOO_MANY_REQUESTS: HttpError(429, "rate_limit_error", "rate_limit_exceeded"),
    # This engine's KV pool is too small for the request.
    ErrorCode.POOL_FULL: HttpError(503, "server_error", ErrorCode.POOL_FULL),
    ErrorCode.SHUTTING_DOWN: HttpError(503, "server_error", ErrorCode.SHUTTING_DOWN),
    ErrorCode.ENGINE_ERROR: HttpError(503, "server_error", ErrorCode.ENGINE_ERROR),
}


@dataclass
class HttpOptions:
    host: str = "127.0.0.1"
    port: int = 8000  # 0 picks a free port
    token: str = ""
    max_requests: int = 16  # completions in flight at once, all HTTP clients together; more get 429


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type_,
            param,
            code,
        )

    def body(self) -> dict:
        # The message may quote the client's text: no lone surrogate may reach the UTF-8 encoder.
        return {
            "error": {
                "message": _clean_text(self.message),
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def _bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


class OpenAIFrontend:
    """The HTTP listener over one `CompletionService`: start() binds, stop() drains and closes."""

    def __init__(self, service: CompletionService, options: HttpOptions):
        self.service = service
        self.options = options
        self.model_id = service.model_name
        self.created = int(time.time())
        self.inflight = 0  # requests being answered; the daemon's drain waits for them
        self.admitted = 0  # of them, those past authorization that count against max_requests
        self.port: int | None = None
        # Bytes, so that a token with non-ASCII characters compares without a TypeError.
        self._token = options.token.encode("utf-8")
        self.app = Starlette(
            routes=[
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/models/{model:path}", self.model, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
            ],
            exception_handlers={HTTPException: _http_exception, Exception: _unexpected_exception},
        )
        self._uvicorn: uvicorn.Server | None = None
        self._task: asyncio.Task | None = None

    # -- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        # Bind here, not inside uvicorn: a taken port becomes a clean error before the daemon
        # reports ready (uvicorn would sys.exit), and port 0 tells us the port it got.
        host, port = self.options.host, self.options.port
        try:
            info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
            sock = socket.socket(info[0], socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(info[4])
        except OSError as exc:
            raise RuntimeError(f"cannot listen for HTTP on {host}:{port}: {exc}") from exc
        sock.listen(128)
        sock.setblocking(False)
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            self.app,
            log_config=None,
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=2,
            server_header=False,
        )
        self._uvicorn = _InLoopServer(config)
        self._task = asyncio.ensure_future(self._uvicorn.serve(sockets=[sock]))
        while not self._uvicorn.started:
            if self._task.done():
                self._task.result()  # raises what stopped it
                raise RuntimeError("the HTTP listener stopped while starting")
            await asyncio.sleep(0.01)
        if host not in LOOPBACK:
            log.warning("http listener on %s is reachable beyond this machine", host)
        log.info("listening on http://%s:%d/v1 (bearer token required)", host, self.port)

    async def stop(self) -> None:
        if self._uvicorn is None:
            return
        self._uvicorn.should_exit = True
        try:
            await self._task
        except Exception:  # noqa: BLE001 - stopping anyway
            log.exception("http listener failed while stopping")

    # -- routes ---------------------------------------------------------------------------------
    async def health(self, request: HttpRequest) -> JSONResponse:
        ok = not self.service.draining
        return JSONResponse({"status": "ok" if ok else "draining"}, status_code=200 if ok else 503)

    async def models(self, request: HttpRequest) -> JSONResponse:
        try:
            self._authorize(request)
        except ApiError as exc:
            return exc.response()
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: HttpRequest) -> JSONResponse:
        try:
            self._authorize(request)
            self._check_model(request.path_params["model"])
        except ApiError as exc:
            return exc.response()
        return JSONResponse(self._model_card())

    async def completions(self, request: HttpRequest):
        self.service.touch()
        self.inflight += 1
        engine_request = watcher = None
        streaming = admitted = False
        try:
            self._authorize(request)
            if self.service.draining:
                raise _engine_error(ErrorCode.SHUTTING_DOWN, "the engine is shutting down")
            self._admit()  # before the body is read: a refusal costs nothing
            admitted = True
            body = await _read_json(request)
            engine_request, stream, include_usage = await self._make_request(body)
            events = self.service.submit(engine_request)
            # A client gone mid-request cancels the engine's work; the engine then ends the
            # request with a "done" event, so the loops below always see an end.
            watcher = asyncio.ensure_future(self._cancel_on_disconnect(request, engine_request))
            first = await events.get()
            if first.kind == "error":  # nothing was sent yet: a proper status code
                raise _engine_error(first.code, first.error)
            if stream:
                streaming = True  # the response owns the watcher and the in-flight count now
                return _EventStream(
                    self._sse(engine_request, events, first, include_usage),
                    on_close=lambda: self._stream_closed(engine_request, watcher, admitted),
                    media_type="text/event-stream",
                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                )
            return await self._collect(events, engine_request, first)
        except ApiError as exc:
            return exc.response()
        except asyncio.CancelledError:  # uvicorn gave up on the request (shutdown timeout)
            if engine_request is not None:
                self.service.cancel(engine_request.id, "disconnected")
            raise
        finally:
            if not streaming:
                self._done(watcher, admitted)

    # -- helpers --------------------------------------------------------------------------------
    def _admit(self) -> None:
        """Count one more completion in flight, or refuse it with 429 past `max_requests`."""
        cap = self.options.max_requests
        if self.admitted >= cap:
            raise _engine_error(
                ErrorCode.TOO_MANY_REQUESTS,
                f"{cap} completions are already in flight over HTTP, "
                "the most there may be; retry when one has ended",
            )
        self.admitted += 1

    def _done(self, watcher: asyncio.Task | None, admitted: bool) -> None:
        if watcher is not None:
            watcher.cancel()
        self.inflight -= 1
        if admitted:
            self.admitted -= 1
        self.service.touch()

    async def _cancel_on_disconnect(self, request: HttpRequest, engine_request: Request) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        self.service.cancel(engine_request.id, "disconnected")

    def _authorize(self, request: HttpRequest) -> None:
        # Starlette decodes header bytes as latin-1: encoding back gives the bytes the client sent.
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        given = token.strip().encode("latin-1")
        if (
            scheme.lower() != "bearer"
            or not self._token
            or not hmac.compare_digest(given, self._token)
        ):
            raise ApiError(401, "a valid bearer token is required", code="invalid_api_key")

    def _check_model(self, name) -> None:
        if name is not None and not isinstance(name, str):
            raise _bad("'model' must be a string", "model")
        if name is not None and name != self.model_id:
            raise ApiError(
                404,
                f"the model {name!r} does not exist; this engine serves {self.model_id!r}",
                param="model",
                code="model_not_found",
            )

    def _model_card(self) -> dict:
        return {
            "id": self.model_id,
            "object": "model",
            "created": self.created,
            "owned_by": "wd-lsp",
            "max_model_len": self.service.context_length,
        }

    async def _make_request(self, body: dict) -> tuple[Request, bool, bool]:
        """Validate an OpenAI completions body and build the engine request."""
        self._check_model(body.get("model"))
        _check_unsupported(body)
        stream, include_usage = _stream_flags(body)
        p, token_ids = _completion_params(body)
        ignore_eos = body.get("ignore_eos", False)  # vLLM's extension; benchmarks use it
        if not isinstance(ignore_eos, bool):
            raise _bad("'ignore_eos' must be a boolean", "ignore_eos")
        try:
            if token_ids is not None:
                prompt = self.service.prepare_ids(token_ids, p.max_tokens)
            else:
                prompt = await self.service.prepare(p, whole_budget=True)
        except RequestRefused as exc:
            raise _refused(exc) from exc
        except (TypeError, ValueError) as exc:  # the client's input, as on the msgpack path
            raise _bad(str(exc), "prompt") from exc
        engine_request = self.service.make_request(
            p,
            prompt,
            request_id=f"http:{secrets.token_hex(8)}",
            owner=HTTP_OWNER,
            stop_at_eos=not ignore_eos,
        )
        return engine_request, stream, include_usage

    async def _collect(
        self, events: asyncio.Queue, engine_request: Request, event: Event
    ) -> JSONResponse:
        text = []
        while event.kind == "delta":
            text.append(event.text)
            event = await events.get()
        if event.kind == "error":
            raise _engine_error(event.code, event.error)
        choice = {
            "text": "".join(text),
            "index": 0,
            "logprobs": None,
            "finish_reason": _finish(event.finish_reason),
        }
        return JSONResponse(
            dict(self._envelope(engine_request), choices=[choice], usage=_usage(event.usage))
        )

    async def _sse(
        self, engine_request: Request, events: asyncio.Queue, event: Event, include_usage: bool
    ):
        envelope = self._envelope(engine_request)
        while True:
            if event.kind == "delta":
                yield _sse_data(dict(envelope, choices=[_chunk(event.text, None)]))
            elif event.kind == "done":
                yield _sse_data(dict(envelope, choices=[_chunk("", _finish(event.finish_reason))]))
                if include_usage:
                    yield _sse_data(dict(envelope, choices=[], usage=_usage(event.usage)))
                break
            else:  # the status line is already sent: report in the stream, as others do
                yield _sse_data(_engine_error(event.code, event.error).body())
                break
            event = await events.get()
        yield "data: [DONE]\n\n"

    def _stream_closed(
        self, engine_request: Request, watcher: asyncio.Task, admitted: bool
    ) -> None:
        # However the response ended (finished, failed write, never started because the client
        # left at once): stop the engine's work, which is a no-op for a finished request.
        self.service.cancel(engine_request.id, "disconnected")
        self._done(watcher, admitted)

    def _envelope(self, engine_request: Request) -> dict:
        return {
            "id": f"cmpl-{engine_request.id.removeprefix('http:')}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model_id,
        }


class _EventStream(StreamingResponse):
    """A streamed response that always runs `on_close`, even when it never started streaming."""

    def __init__(self, content, on_close, **kwargs):
        super().__init__(content, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


class _InLoopServer(uvicorn.Server):
    """uvicorn inside the daemon's loop: the daemon owns SIGTERM/SIGINT (it drains first)."""

    def capture_signals(self):
        import contextlib

        return contextlib.nullcontext()


async def _read_json(request: HttpRequest) -> dict:
    """The body as a JSON object, read in chunks up to `MAX_BODY_BYTES`: a larger body is refused
    before it is held whole, and a declared one before any of it is read."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise _too_large()
    size, chunks = 0, []
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise _too_large()
            chunks.append(chunk)
    except ClientDisconnect as exc:  # nobody reads the answer; it only ends the request quietly
        raise _bad("the client disconnected while sending the body") from exc
    try:
        body = json.loads(b"".join(chunks))
    except RecursionError as exc:
        raise _bad("the body nests JSON too deeply") from exc
    except (ValueError, UnicodeDecodeError) as exc:
        raise _bad(f"the body is not JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise _bad("the body must be a JSON object")
    return body


def _too_large() -> ApiError:
    return ApiError(
        413, f"the request body exceeds {MAX_BODY_BYTES} bytes", code="request_too_large"
    )


def _check_unsupported(body: dict) -> None:
    for name, neutral in (
        ("n", 1),
        ("best_of", 1),
        ("echo", False),
        ("logprobs", None),
        ("presence_penalty", 0),
        ("frequency_penalty", 0),
    ):
        if body.get(name, neutral) not in (neutral, None):
            raise _bad(f"'{name}' is not supported (only {neutral!r})", name)
    if body.get("logit_bias"):
        raise _bad("'logit_bias' is not supported", "logit_bias")


def _stream_flags(body: dict) -> tuple[bool, bool]:
    """Whether to stream, and whether the stream ends with a usage chunk."""
    stream = body.get("stream") or False
    options = body.get("stream_options") or {}
    if not isinstance(stream, bool) or not isinstance(options, dict):
        raise _bad("'stream' must be a boolean and 'stream_options' an object", "stream")
    return stream, bool(options.get("include_usage"))


def _completion_params(body: dict) -> tuple[P.CompletionParams, list[int] | None]:
    """The engine's parameters for a completions body, and the prompt's ids when it gives ids."""
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if isinstance(stop, list):
        stop = [_clean_text(s) if isinstance(s, str) else s for s in stop]
    # OpenAI's defaults, not the engine's greedy ones: tools expect the API's behaviour.
    params = dict(
        max_tokens=16 if body.get("max_tokens") is None else body["max_tokens"],
        temperature=1.0 if body.get("temperature") is None else body["temperature"],
        top_p=1.0 if body.get("top_p") is None else body["top_p"],
        stop=stop,
        seed=body.get("seed"),
    )
    prompt = _single_prompt(body.get("prompt"))
    suffix = body.get("suffix")
    token_ids = None
    if isinstance(prompt, list):
        if suffix is not None:
            raise _bad("'suffix' needs a text prompt", "suffix")
        token_ids, params["prompt"] = prompt, ""
    elif suffix is not None:  # FIM: the prompt is the text before the hole
        params.update(
            prefix=prompt, suffix=_clean_text(suffix) if isinstance(suffix, str) else suffix
        )
    else:
        params["prompt"] = prompt
    try:
        return P.CompletionParams.from_params(params), token_ids
    except (TypeError, ValueError) as exc:
        raise _bad(str(exc)) from exc


def _single_prompt(prompt):
    """One prompt: a string, or token ids; a list of exactly one of those is unwrapped."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return _clean_text(prompt)
    if isinstance(prompt, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    ):
        return prompt
    if isinstance(prompt, list) and all(isinstance(t, (str, list)) for t in prompt):
        raise _bad("only one prompt per request is supported", "prompt")
    raise _bad("'prompt' must be a string or a list of token ids", "prompt")


def _clean_text(text: str) -> str:
    """`text` with each lone surrogate replaced by U+FFFD: neither the tokenizer nor UTF-8 takes
    them."""
    return text if text.isascii() else LONE_SURROGATE.sub("\ufffd", text)


def _engine_error(
    code: ErrorCode | str | None, message: str | None, param: str | None = None
) -> ApiError:
    """The answer to an engine error, by its code (and the parameter at fault where it is
    known): never by its message."""
    error = ENGINE_ERRORS.get(code, ENGINE_ERRORS[ErrorCode.ENGINE_ERROR])
    return ApiError(
        error.status, message or "engine error", error.type, param or error.param, error.code
    )


def _refused(exc: RequestRefused) -> ApiError:
    """The answer to a request refused before it reached the engine. A bad parameter it names is
    answered as the endpoint's own parameter checks are (param set, code null)."""
    if isinstance(exc, BadRequest) and exc.param is not None:
        return _bad(str(exc), exc.param)
    return _engine_error(exc.code, str(exc), exc.param)


async def _http_exception(request: HttpRequest, exc: HTTPException) -> JSONResponse:
    """Starlette's own refusals (no such path, wrong method) in OpenAI's shape."""
    type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
    body = ApiError(exc.status_code, exc.detail, type_).body()
    return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)


async def _unexpected_exception(request: HttpRequest, exc: Exception) -> JSONResponse:
    """A bug's answer: OpenAI's shape, no traceback (uvicorn logs it)."""
    error = ApiError(
        500, "internal error, see the engine log", "server_error", code="internal_error"
    )
    return error.response()


def _finish(reason: str | None) -> str:
    return "length" if reason == "length" else "stop"


def _usage(usage: dict | None) -> dict:
    usage = usage or {}
    prompt, completion = usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": usage.get("cached_tokens", 0)},
    }


def _chunk(text: str, finish_reason: str | None) -> dict:
    return {"text": text, "index": 0, "logprobs": None, "finish_reason": finish_reason}


def _sse_data(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
