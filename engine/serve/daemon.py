"""`wd-engine serve`: the resident daemon. One model, one engine loop, many clients.

Clients speak `engine.ipc.protocol` over a Unix socket (owner-only) or, optionally, over TCP on
loopback with a token. Nothing a client sends can stop the loop or disturb another client: bad
frames get an error frame and a closed connection, bad parameters an error for that request.

Limits, so that no client starves the others: a connection must greet within
`hello_timeout_s`, in a frame of at most P.MAX_HELLO_FRAME_BYTES; it has at most
`max_requests_per_connection` requests open (more are refused at once with TOO_MANY_REQUESTS);
the engine shares itself fairly across connections (engine.core.scheduler); frames are written
without waiting for the peer, and a peer that leaves more than `max_output_backlog` bytes unread
has its streams cancelled (SLOW_READER) and its next request read only once it catches up;
prompts are measured before they are tokenized and built a few at a time, one per connection
(engine.serve.service, which the OpenAI-compatible endpoint shares).

Every error frame carries an `ErrorCode`: the engine's refusals (engine.core.request) and error
events their own, malformed input BAD_REQUEST, anything else ENGINE_ERROR; never one read from a
message.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import secrets
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from engine.core.request import RequestRefused
from engine.ipc import protocol as P
from engine.ipc.protocol import ErrorCode
from engine.ipc.socket_path import LISTEN_BACKLOG, bind_socket, remove_own_socket
from engine.serve.service import MAX_PROMPT_TOKENS, PROMPT_BUILDERS, CompletionService

if TYPE_CHECKING:
    from engine.core.engine import Engine
    from engine.serve.openai_http import HttpOptions

log = logging.getLogger("wd_engine")

# Markers in a connection's request table for a request whose prompt is still being built.
PENDING, CANCELLED = "<pending>", "<cancelled>"

# What a connection's reader holds, at most, before it stops reading from the socket (twice this,
# as asyncio counts): a peer cannot make the engine buffer more than the frame it is reading.
READ_BUFFER_BYTES = 64 << 10


@dataclass
class ServeOptions:
    socket_path: Path
    tcp_host: str | None = None
    tcp_port: int | None = None
    token: str | None = None
    idle_timeout_s: float = 900.0
    drain_timeout_s: float = 10.0
    max_prompt_tokens: int = MAX_PROMPT_TOKENS
    http: HttpOptions | None = None  # the OpenAI-compatible listener, when asked for
    hello_timeout_s: float = 5.0  # a connection that has not greeted by then is closed
    max_requests_per_connection: int = 16  # completions and warm-ups open at once on one connection
    # Bytes a peer may leave unread before its streams are cancelled.
    max_output_backlog: int = 256 << 10
    prompt_builders: int = PROMPT_BUILDERS  # prompts tokenized at once (one per connection)


class _Connection:
    count = 0

    def __init__(self, reader, writer, needs_token: bool, backlog_limit: int):
        _Connection.count += 1
        self.number = _Connection.count
        self.reader, self.writer = reader, writer
        self.needs_token = needs_token
        self.greeted = False
        self.backlog_limit = backlog_limit
        writer.transport.set_write_buffer_limits(high=backlog_limit)  # where drain() starts to wait
        self.build_lock = asyncio.Lock()  # its prompts are built one at a time
        # Client request id -> engine request id (or a marker).
        self.requests: dict[object, str] = {}
        self.tasks: set[asyncio.Task] = set()

    @property
    def backlog(self) -> int:
        """Bytes written to the peer that it has not read yet (beyond the kernel's buffer)."""
        return self.writer.transport.get_write_buffer_size()

    def send(self, message: dict) -> None:
        """Queue a frame without waiting for the peer: one that does not read holds up only
        itself (its streams are cancelled past the backlog limit, its requests read when it
        catches up)."""
        if not self.writer.is_closing():
            self.writer.write(P.encode_frame(message))

    async def writable(self) -> None:
        """Wait while the peer leaves more than the backlog limit unread."""
        await self.writer.drain()


class EngineServer:
    def __init__(self, engine: Engine, model_dir: Path, options: ServeOptions):
        self.service = CompletionService(
            engine, model_dir, options.max_prompt_tokens, options.prompt_builders
        )
        self.service.warm_up()
        self.options = options
        self.connections: set[_Connection] = set()
        self.stopped = asyncio.Event()
        self.servers: list[asyncio.base_events.Server] = []
        self.counters = dict(
            connections=0,
            bad_frames=0,
            errors=0,
            too_many_requests=0,
            slow_readers=0,
            hello_timeouts=0,
        )
        self.http = None  # the OpenAI-compatible listener, when enabled

    # -- lifecycle ------------------------------------------------------------------------------
    async def serve(self) -> None:
        path = self.options.socket_path
        # Before the engine starts: a refused path stops nothing running.
        listener, self._socket_identity = bind_socket(path)
        self.service.start()
        unix = await asyncio.start_unix_server(
            self._on_unix, sock=listener, limit=READ_BUFFER_BYTES, backlog=LISTEN_BACKLOG
        )
        self.servers.append(unix)
        if self.options.tcp_port is not None:
            host = self.options.tcp_host or "127.0.0.1"
            tcp = await asyncio.start_server(
                self._on_tcp,
                host=host,
                port=self.options.tcp_port,
                limit=READ_BUFFER_BYTES,
                backlog=LISTEN_BACKLOG,
            )
            self.servers.append(tcp)
            self.tcp_port = tcp.sockets[0].getsockname()[1]
            log.info("listening on tcp %s:%d (token required)", host, self.tcp_port)
        if self.options.http is not None:
            # starlette and uvicorn are imported only when the listener is asked for
            from engine.serve.openai_http import OpenAIFrontend

            self.http = OpenAIFrontend(self.service, self.options.http)
            await self.http.start()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(
                sig, lambda: asyncio.ensure_future(self.drain_and_stop("signal"))
            )
        log.info("engine ready on %s (pid %d)", path, os.getpid())
        self.service.touch()  # the idle time counts from now, not from loading
        watchdog = asyncio.ensure_future(self._idle_watchdog())
        try:
            await self.stopped.wait()
        finally:
            watchdog.cancel()
            for server in self.servers:
                server.close()
            if self.http is not None:
                await self.http.stop()
            self.service.stop()
            remove_own_socket(path, self._socket_identity)
            log.info("engine stopped")

    async def drain_and_stop(self, why: str) -> None:
        """Refuse new work, let running requests finish (bounded), then stop."""
        if self.service.draining:
            return
        self.service.draining = True
        log.info("draining (%s)", why)
        for server in self.servers:
            server.close()
        deadline = time.monotonic() + self.options.drain_timeout_s
        while time.monotonic() < deadline and (
            any(conn.tasks for conn in self.connections)
            or (self.http is not None and self.http.inflight)
        ):
            await asyncio.sleep(0.05)  # requests in flight finish and send their final frame
        for conn in list(self.connections):
            conn.writer.close()
        self.stopped.set()

    async def _idle_watchdog(self) -> None:
        while True:
            await asyncio.sleep(min(5.0, max(0.1, self.options.idle_timeout_s / 4)))
            # Should never happen; if it does, exit so that the next client starts a fresh one.
            if not self.service.alive:
                log.error(
                    "the engine loop died; stopping so that the next client starts a fresh engine"
                )
                await self.drain_and_stop("engine loop died")
                return
            # Connections that never greeted are no clients: they keep nothing alive.
            if self.clients:
                self.service.touch()
            elif time.monotonic() - self.service.last_activity > self.options.idle_timeout_s:
                await self.drain_and_stop(f"no clients for {self.options.idle_timeout_s:.0f} s")
                return

    @property
    def clients(self) -> int:
        return sum(conn.greeted for conn in self.connections)

    # -- connections ----------------------------------------------------------------------------
    async def _on_unix(self, reader, writer):
        await self._serve_connection(
            _Connection(reader, writer, False, self.options.max_output_backlog)
        )

    async def _on_tcp(self, reader, writer):
        await self._serve_connection(
            _Connection(reader, writer, True, self.options.max_output_backlog)
        )

    async def _serve_connection(self, conn: _Connection) -> None:
        self.connections.add(conn)
        self.counters["connections"] += 1
        try:
            while True:
                await conn.writable()  # a peer that does not read gets nothing more read either
                try:
                    message = await self._next_message(conn)
                except P.FrameError as exc:
                    self.counters["bad_frames"] += 1
                    conn.send(P.error_message(None, ErrorCode.BAD_FRAME, str(exc)))
                    break
                except TimeoutError:
                    self.counters["hello_timeouts"] += 1
                    wait = self.options.hello_timeout_s
                    log.info("connection %d closed: no hello within %.1f s", conn.number, wait)
                    conn.send(
                        P.error_message(None, ErrorCode.BAD_REQUEST, f"no hello within {wait:g} s")
                    )
                    break
                if message is None:
                    break
                if not await self._dispatch(conn, message):
                    break
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        except Exception:  # noqa: BLE001 - one broken connection must not take the daemon down
            log.exception("connection %d failed", conn.number)
        finally:
            for engine_id in list(conn.requests.values()):
                if engine_id not in (PENDING, CANCELLED):
                    self.service.cancel(engine_id, "disconnected")
            for task in conn.tasks:
                task.cancel()
            self.connections.discard(conn)
            if conn.greeted:
                self.service.touch()
            conn.writer.close()

    async def _next_message(self, conn: _Connection) -> dict | None:
        """The connection's next frame; before its hello, within the hello timeout (TimeoutError)
        and at most P.MAX_HELLO_FRAME_BYTES long."""
        if conn.greeted:
            return await P.read_frame(conn.reader)
        async with asyncio.timeout(self.options.hello_timeout_s):
            return await P.read_frame(conn.reader, P.MAX_HELLO_FRAME_BYTES)

    async def _dispatch(self, conn: _Connection, message: dict) -> bool:
        """Handle one request; False closes the connection."""
        rid, method, params = message.get("id"), message.get("method"), message.get("params", {})
        if not isinstance(rid, (int, str)) or isinstance(rid, bool):
            conn.send(
                P.error_message(None, ErrorCode.BAD_REQUEST, "'id' must be an integer or a string")
            )
            return True
        if not conn.greeted:
            return self._hello(conn, rid, method, params)
        if method not in P.METHODS:
            conn.send(P.error_message(rid, ErrorCode.UNKNOWN_METHOD, f"unknown method {method!r}"))
            return True
        if not isinstance(params, dict):
            conn.send(P.error_message(rid, ErrorCode.BAD_REQUEST, "'params' must be a map"))
            return True
        if method in ("complete", "warm"):
            self._start_completion(conn, rid, params, warm=method == "warm")
        elif method == "cancel":
            self._cancel(conn, rid, params)
        elif method == "stats":
            conn.send({"id": rid, "result": self._stats()})
        elif method == "health":
            conn.send({"id": rid, "result": self._health()})
        elif method == "model_info":
            conn.send({"id": rid, "result": self.service.model_info()})
        elif method == "shutdown":
            conn.send({"id": rid, "result": {"stopping": True}})
            asyncio.ensure_future(self.drain_and_stop("shutdown requested"))
        else:  # a second hello
            conn.send({"id": rid, "result": self._health()})
        return True

    def _start_completion(self, conn: _Connection, rid, params: dict, warm: bool) -> None:
        if self.service.draining:
            conn.send(P.error_message(rid, ErrorCode.SHUTTING_DOWN, "the engine is shutting down"))
            return
        if rid in conn.requests:
            message = f"request id {rid!r} is in use on this connection"
            conn.send(P.error_message(rid, ErrorCode.BAD_REQUEST, message))
            return
        cap = self.options.max_requests_per_connection
        if len(conn.requests) >= cap:
            self.counters["too_many_requests"] += 1
            message = (
                f"this connection already has {cap} requests open, the most it may; wait for one "
                "to end or cancel one"
            )
            conn.send(P.error_message(rid, ErrorCode.TOO_MANY_REQUESTS, message))
            return
        # Registered now, not when the task first runs: a cancel read from the same write as the
        # request must find it.
        conn.requests[rid] = PENDING
        task = asyncio.ensure_future(self._complete(conn, rid, params, warm))
        conn.tasks.add(task)
        task.add_done_callback(conn.tasks.discard)

    def _cancel(self, conn: _Connection, rid, params: dict) -> None:
        target_id = params.get("id")
        if not isinstance(target_id, (int, str)) or isinstance(target_id, bool):
            message = "'id' to cancel must be an integer or a string"
            conn.send(P.error_message(rid, ErrorCode.BAD_REQUEST, message))
            return
        target = conn.requests.get(target_id)
        if target == PENDING:  # its prompt is not built yet: it is never submitted
            conn.requests[target_id] = CANCELLED
        elif target not in (None, CANCELLED):
            self.service.cancel(target)
        conn.send({"id": rid, "result": {"cancelled": target is not None}})

    def _hello(self, conn: _Connection, rid, method, params) -> bool:
        if method != "hello" or not isinstance(params, dict):
            message = "the first request must be 'hello'"
            conn.send(P.error_message(rid, ErrorCode.BAD_REQUEST, message))
            return False
        if params.get("version") != P.PROTOCOL_VERSION:
            message = (
                f"engine speaks protocol {P.PROTOCOL_VERSION}, client {params.get('version')!r}"
            )
            conn.send(P.error_message(rid, ErrorCode.VERSION_MISMATCH, message))
            return False
        if conn.needs_token:
            token = params.get("token")
            expected = (self.options.token or "").encode()  # bytes: a non-ASCII token compares too
            given = token.encode() if isinstance(token, str) else b""
            if not expected or not hmac.compare_digest(given, expected):
                log.warning("tcp client refused: bad token")
                message = "a valid token is required"
                conn.send(P.error_message(rid, ErrorCode.UNAUTHORIZED, message))
                return False
        conn.greeted = True
        result = dict(self._health(), model=self.service.model_info(), features=list(P.FEATURES))
        conn.send({"id": rid, "result": result})
        return True

    # -- requests -------------------------------------------------------------------------------
    async def _complete(self, conn: _Connection, rid, params: dict, warm: bool) -> None:
        try:
            prepared = await self._prepare(conn, rid, params)
            if prepared is None:
                return
            await self._run(conn, rid, *prepared, warm)
        finally:
            conn.requests.pop(rid, None)

    async def _prepare(self, conn: _Connection, rid, params: dict):
        """Validated parameters and the checked prompt, or None once the request is answered (an
        error, or cancelled before its prompt was built: never submitted, nothing computed)."""
        try:
            p = P.CompletionParams.from_params(params)
            async with conn.build_lock:  # one prompt at a time per connection: a turn for others
                cancelled = conn.requests.get(rid) == CANCELLED
                prompt = None if cancelled else await self.service.prepare(p)
        except Exception as exc:  # noqa: BLE001 - answered, the connection lives on
            conn.send(P.error_message(rid, *refusal(exc)))
            return None
        if prompt is None or conn.requests.get(rid) == CANCELLED:
            conn.send({"id": rid, "result": {"finish_reason": "cancelled", "usage": None}})
            return None
        return p, prompt

    async def _run(self, conn: _Connection, rid, p: P.CompletionParams, prompt, warm: bool) -> None:
        """Submit the request and forward its events as frames."""
        request = self.service.make_request(
            p,
            prompt,
            request_id=f"{conn.number}:{rid}:{secrets.token_hex(4)}",
            owner=f"connection:{conn.number}",
            # Supersession stays within the connection: another client's key must not cancel ours.
            client=None if p.client is None else f"{conn.number}:{p.client}",
            warm=warm,
        )
        conn.requests[rid] = request.id
        events = self.service.submit(request)
        try:
            while True:
                event = await events.get()
                if event.kind == "delta":
                    if conn.backlog > conn.backlog_limit:
                        self._drop_slow_stream(conn, rid, request.id)
                        return
                    conn.send({"id": rid, "delta": event.text})
                elif event.kind == "done":
                    result = {"finish_reason": event.finish_reason, "usage": event.usage}
                    if event.alternatives:
                        result["alternatives"] = event.alternatives
                    conn.send({"id": rid, "result": result})
                    return
                else:
                    self.counters["errors"] += 1
                    code = event.code or ErrorCode.ENGINE_ERROR
                    conn.send(P.error_message(rid, code, event.error or "engine error"))
                    return
        except asyncio.CancelledError:
            self.service.cancel(request.id, "disconnected")
            raise

    def _drop_slow_stream(self, conn: _Connection, rid, request_id: str) -> None:
        """The peer leaves its output unread: stop computing for it, not buffer without end."""
        self.service.cancel(request_id, "slow reader")
        self.counters["slow_readers"] += 1
        log.warning(
            "connection %d left %d bytes unread: request %r cancelled",
            conn.number,
            conn.backlog,
            rid,
        )
        message = (
            f"more than {conn.backlog_limit} bytes of output were left unread; the completion "
            "was cancelled"
        )
        conn.send(P.error_message(rid, ErrorCode.SLOW_READER, message))

    def _stats(self) -> dict:
        return dict(
            self.service.stats(),
            **self.counters,
            clients=self.clients,
            http_inflight=self.http.inflight if self.http else 0,
        )

    def _health(self) -> dict:
        return dict(self.service.health(), version=P.PROTOCOL_VERSION, clients=self.clients)


def refusal(exc: Exception) -> tuple[ErrorCode, str]:
    """The code and message of a request refused before it reached the engine: the engine's
    typed refusals carry their code, malformed input is BAD_REQUEST, anything else (a bug) is
    the engine's error, logged."""
    if isinstance(exc, RequestRefused):
        return exc.code, str(exc)
    if isinstance(exc, (ValueError, TypeError)):  # the client's input
        return ErrorCode.BAD_REQUEST, str(exc)
    log.exception("preparing a request failed", exc_info=exc)
    return ErrorCode.ENGINE_ERROR, f"engine error: {type(exc).__name__}: {exc}"
