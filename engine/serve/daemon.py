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
(engine.prompts.layout).
"""

from __future__ import annotations

import asyncio
import errno
import hmac
import logging
import os
import secrets
import signal
import socket
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from engine.core.scheduler import Engine, Request
from engine.decoding.token_healing import token_healer
from engine.ipc import protocol as P
from engine.prompts.layout import (
    UNBOUNDED_TEXT_BYTES,
    ContextChunk,
    layout_completion_prompt,
    max_token_bytes,
    plain_prompt_ids,
    prompt_budget,
    supported_fim_orders,
    uses_repo_context,
    utf8_len,
)

log = logging.getLogger("wd_engine")

# Markers in a connection's request table for a request whose prompt is still being built.
PENDING, CANCELLED = "<pending>", "<cancelled>"

# What a connection's reader holds, at most, before it stops reading from the socket (twice this,
# as asyncio counts): a peer cannot make the engine buffer more than the frame it is reading.
READ_BUFFER_BYTES = 64 << 10
LISTEN_BACKLOG = 128

# A completion prompt keeps at least this share of the model's context (or the daemon's prompt
# cap, if smaller): a max_tokens that would leave less is refused, not met by cutting the user's
# code down to a few tokens.
MIN_PROMPT_SHARE = 4


class UnsafeSocketPath(RuntimeError):
    """Something other than a stale socket of ours is at the socket's path."""


@dataclass
class ServeOptions:
    socket_path: Path
    tcp_host: str | None = None
    tcp_port: int | None = None
    token: str | None = None
    idle_timeout_s: float = 900.0
    drain_timeout_s: float = 10.0
    max_prompt_tokens: int = 4096
    http: object | None = (
        None  # engine.serve.openai_http.HttpOptions: the OpenAI-compatible listener
    )
    hello_timeout_s: float = 5.0  # a connection that has not greeted by then is closed
    max_requests_per_connection: int = 16  # completions and warm-ups open at once on one connection
    max_output_backlog: int = (
        256 << 10
    )  # bytes a peer may leave unread before its streams are cancelled
    prompt_builders: int = 2  # prompts tokenized at once (each connection's one at a time)


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
        self.requests: dict[
            object, str
        ] = {}  # client request id -> engine request id (or a marker)
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
        self.engine = engine
        self.model_dir = Path(model_dir)
        self.options = options
        self.fim_orders = supported_fim_orders(model_dir)
        self.repo_context = uses_repo_context(model_dir)
        token_healer(self.engine.tokenizer)  # its vocabulary scan now, not in the first completion
        max_token_bytes(
            self.engine.tokenizer
        )  # and the prompt-length bound's (engine.prompts.layout)
        self.connections: set[_Connection] = set()
        self._builders = asyncio.Semaphore(options.prompt_builders)
        self.started = time.monotonic()
        self.last_client_seen = time.monotonic()
        self.draining = False
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
        self.engine_thread = self.engine.start_thread()
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
            from engine.serve.openai_http import (
                OpenAIFrontend,
            )  # starlette/uvicorn only when asked for

            self.http = OpenAIFrontend(self, self.options.http)
            await self.http.start()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(
                sig, lambda: asyncio.ensure_future(self.drain_and_stop("signal"))
            )
        log.info("engine ready on %s (pid %d)", path, os.getpid())
        self.last_client_seen = time.monotonic()  # the idle time counts from now, not from loading
        watchdog = asyncio.ensure_future(self._idle_watchdog())
        try:
            await self.stopped.wait()
        finally:
            watchdog.cancel()
            for server in self.servers:
                server.close()
            if self.http is not None:
                await self.http.stop()
            self.engine.stop()
            remove_own_socket(path, self._socket_identity)
            log.info("engine stopped")

    async def drain_and_stop(self, why: str) -> None:
        """Refuse new work, let running requests finish (bounded), then stop."""
        if self.draining:
            return
        self.draining = True
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
            if not self.engine.alive:  # should never happen; if it does, exit so clients respawn us
                log.error(
                    "the engine loop died; stopping so that the next client starts a fresh engine"
                )
                await self.drain_and_stop("engine loop died")
                return
            if (
                self.clients
            ):  # connections that never greeted are no clients: they keep nothing alive
                self.last_client_seen = time.monotonic()
            elif time.monotonic() - self.last_client_seen > self.options.idle_timeout_s:
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
                    conn.send(P.error_message(None, P.BAD_FRAME, str(exc)))
                    break
                except TimeoutError:
                    self.counters["hello_timeouts"] += 1
                    wait = self.options.hello_timeout_s
                    log.info("connection %d closed: no hello within %.1f s", conn.number, wait)
                    conn.send(P.error_message(None, P.BAD_REQUEST, f"no hello within {wait:g} s"))
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
                    self.engine.cancel(engine_id, "disconnected")
            for task in conn.tasks:
                task.cancel()
            self.connections.discard(conn)
            if conn.greeted:
                self.last_client_seen = time.monotonic()
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
            conn.send(P.error_message(None, P.BAD_REQUEST, "'id' must be an integer or a string"))
            return True
        if not conn.greeted:
            return self._hello(conn, rid, method, params)
        if method not in P.METHODS:
            conn.send(P.error_message(rid, P.UNKNOWN_METHOD, f"unknown method {method!r}"))
            return True
        if not isinstance(params, dict):
            conn.send(P.error_message(rid, P.BAD_REQUEST, "'params' must be a map"))
            return True
        if method in ("complete", "warm"):
            self._start_completion(conn, rid, params, warm=method == "warm")
        elif method == "cancel":
            self._cancel(conn, rid, params)
        elif method == "stats":
            conn.send(
                {
                    "id": rid,
                    "result": dict(
                        self.engine.stats(),
                        **self.counters,
                        clients=self.clients,
                        http_inflight=self.http.inflight if self.http else 0,
                    ),
                }
            )
        elif method == "health":
            conn.send({"id": rid, "result": self._health()})
        elif method == "model_info":
            conn.send({"id": rid, "result": self._model_info()})
        elif method == "shutdown":
            conn.send({"id": rid, "result": {"stopping": True}})
            asyncio.ensure_future(self.drain_and_stop("shutdown requested"))
        else:  # a second hello
            conn.send({"id": rid, "result": self._health()})
        return True

    def _start_completion(self, conn: _Connection, rid, params: dict, warm: bool) -> None:
        if self.draining:
            conn.send(P.error_message(rid, P.SHUTTING_DOWN, "the engine is shutting down"))
            return
        if rid in conn.requests:
            conn.send(
                P.error_message(
                    rid, P.BAD_REQUEST, f"request id {rid!r} is in use on this connection"
                )
            )
            return
        cap = self.options.max_requests_per_connection
        if len(conn.requests) >= cap:
            self.counters["too_many_requests"] += 1
            conn.send(
                P.error_message(
                    rid,
                    P.TOO_MANY_REQUESTS,
                    f"this connection already has {cap} requests "
                    "open, the most it may; wait for one to end or cancel one",
                )
            )
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
            conn.send(
                P.error_message(rid, P.BAD_REQUEST, "'id' to cancel must be an integer or a string")
            )
            return
        target = conn.requests.get(target_id)
        if target == PENDING:
            conn.requests[target_id] = (
                CANCELLED  # its prompt is not built yet: it is never submitted
            )
        elif target not in (None, CANCELLED):
            self.engine.cancel(target)
        conn.send({"id": rid, "result": {"cancelled": target is not None}})

    def _hello(self, conn: _Connection, rid, method, params) -> bool:
        if method != "hello" or not isinstance(params, dict):
            conn.send(P.error_message(rid, P.BAD_REQUEST, "the first request must be 'hello'"))
            return False
        if params.get("version") != P.PROTOCOL_VERSION:
            conn.send(
                P.error_message(
                    rid,
                    P.VERSION_MISMATCH,
                    f"engine speaks protocol {P.PROTOCOL_VERSION}, client {params.get('version')!r}",
                )
            )
            return False
        if conn.needs_token:
            token = params.get("token")
            expected = (self.options.token or "").encode()  # bytes: a non-ASCII token compares too
            given = token.encode() if isinstance(token, str) else b""
            if not expected or not hmac.compare_digest(given, expected):
                log.warning("tcp client refused: bad token")
                conn.send(P.error_message(rid, P.UNAUTHORIZED, "a valid token is required"))
                return False
        conn.greeted = True
        conn.send({"id": rid, "result": dict(self._health(), model=self._model_info())})
        return True

    # -- requests -------------------------------------------------------------------------------
    async def build_prompt(self, p: P.CompletionParams) -> tuple[list[int], str]:
        """`_build_prompt` off the event loop, at most `prompt_builders` at a time, so that a few
        clients' large prompts leave cores for the engine and a turn for everyone else. A build's
        slot is given back when the build ends, not when the task awaiting it does: a task
        cancelled mid-build (its peer left) must not let another build start beside it."""
        await self._builders.acquire()
        try:
            build = asyncio.get_running_loop().run_in_executor(None, self._build_prompt, p)
        except BaseException:
            self._builders.release()
            raise
        build.add_done_callback(lambda _: self._builders.release())
        return await asyncio.shield(build)

    def _build_prompt(self, p: P.CompletionParams) -> tuple[list[int], str]:
        """The prompt's ids, and the text its first tokens must write (token healing). Bounded in
        time and memory by the model's context, not by the texts' sizes. Raises P.RequestError
        (CONTEXT_EXCEEDED) for a prompt that cannot fit, found by its size before tokenizing where
        that tells, and ValueError for other bad input."""
        tokenizer = self.engine.tokenizer
        context = self.engine.model.config.max_position_embeddings
        if p.prompt is not None:
            ids = plain_prompt_ids(tokenizer, p.prompt, context - 1)  # one position for the reply
            capped = (
                max_token_bytes(tokenizer) is None and utf8_len(p.prompt) > UNBOUNDED_TEXT_BYTES
            )
            if ids is None and capped:
                raise P.RequestError(
                    P.CONTEXT_EXCEEDED,
                    (
                        f"the prompt is over {UNBOUNDED_TEXT_BYTES} bytes, the most this engine tokenizes with "
                        "this model's tokenizer (whose token count a text's size does not bound)"
                    ),
                )
            if ids is None:
                raise P.RequestError(
                    P.CONTEXT_EXCEEDED,
                    (
                        f"the prompt has more than {context - 1} tokens; this model's maximum context length is "
                        f"{context} tokens, one of them for the reply"
                    ),
                )
            return ids, ""
        budget = self._fim_budget(p.max_tokens)
        order = (
            p.fim_order if p.fim_order != "auto" else ("spm" if "spm" in self.fim_orders else "psm")
        )
        chunks = [ContextChunk(c["path"], c["text"]) for c in p.chunks]
        return layout_completion_prompt(
            tokenizer,
            p.prefix,
            p.suffix,
            chunks,
            p.path,
            order,
            max_prompt_tokens=budget,
            repo_context=self.repo_context,
            heal=True,
        )

    def _least_prompt_tokens(self) -> int:
        context = self.engine.model.config.max_position_embeddings
        return min(self.options.max_prompt_tokens, context // MIN_PROMPT_SHARE)

    def _fim_budget(self, max_tokens: int) -> int:
        """Tokens a completion prompt may take; a max_tokens that leaves less than the least
        prompt is refused: cutting the code around the cursor to a few tokens helps nobody."""
        context = self.engine.model.config.max_position_embeddings
        budget = prompt_budget(context, max_tokens, self.options.max_prompt_tokens)
        least = self._least_prompt_tokens()
        if budget < least:
            raise P.RequestError(
                P.CONTEXT_EXCEEDED,
                (
                    f"max_tokens={max_tokens} leaves too little of this model's {context}-token context for "
                    f"the code around the cursor: a completion may ask for at most {context - least - 1}, so "
                    f"that a {least}-token prompt fits"
                ),
            )
        return budget

    async def _complete(self, conn: _Connection, rid, params: dict, warm: bool) -> None:
        try:
            built = await self._prepare(conn, rid, params)
            if built is None:
                return
            await self._run(conn, rid, built, warm)
        finally:
            conn.requests.pop(rid, None)

    async def _prepare(self, conn: _Connection, rid, params: dict):
        """Validated parameters and the built prompt, or None once the request is answered (an
        error, or cancelled before its prompt was built: never submitted, nothing computed)."""
        try:
            p = P.CompletionParams.from_params(params)
            async with conn.build_lock:  # one prompt at a time per connection: a turn for others
                built = None if conn.requests.get(rid) == CANCELLED else await self.build_prompt(p)
        except Exception as exc:  # noqa: BLE001 - answered, the connection lives on
            conn.send(P.error_message(rid, *self._error_code(exc)))
            return None
        if built is None or conn.requests.get(rid) == CANCELLED:
            conn.send({"id": rid, "result": {"finish_reason": "cancelled", "usage": None}})
            return None
        return p, built

    @staticmethod
    def _error_code(exc: Exception) -> tuple[str, str]:
        if isinstance(exc, P.RequestError):
            return exc.code, str(exc)
        if isinstance(exc, (ValueError, TypeError)):  # the client's input
            return P.BAD_REQUEST, str(exc)
        log.exception("building a prompt failed", exc_info=exc)
        return P.ENGINE_ERROR, f"engine error: {type(exc).__name__}: {exc}"

    async def _run(self, conn: _Connection, rid, built, warm: bool) -> None:
        """Submit the request and forward its events; the engine thread only ever queues them."""
        p, (prompt_ids, forced_text) = built
        loop = asyncio.get_running_loop()
        # Unbounded, yet it stays short: it is drained as fast as the loop runs, since a frame is
        # queued for the peer without waiting for it.
        events: asyncio.Queue = asyncio.Queue()
        request = Request(
            prompt_ids,
            max_tokens=p.max_tokens,
            temperature=float(p.temperature),
            top_p=float(p.top_p),
            seed=p.seed,
            stop=p.stop,
            warm_only=warm,
            forced_text=forced_text,
            beams=p.beams,
            # Supersession stays within the connection: another client's key must not cancel ours.
            client=None if p.client is None else f"{conn.number}:{p.client}",
            owner=f"connection:{conn.number}",
            deadline_s=None if p.deadline_ms is None else p.deadline_ms / 1000.0,
            id=f"{conn.number}:{rid}:{secrets.token_hex(4)}",
        )
        conn.requests[rid] = request.id
        self.engine.submit(request, lambda e: loop.call_soon_threadsafe(events.put_nowait, e))
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
                    conn.send({"id": rid, "result": result})
                    return
                else:
                    self.counters["errors"] += 1
                    code = event.code or P.ENGINE_ERROR
                    conn.send(P.error_message(rid, code, event.error or "engine error"))
                    return
        except asyncio.CancelledError:
            self.engine.cancel(request.id, "disconnected")
            raise

    def _drop_slow_stream(self, conn: _Connection, rid, request_id: str) -> None:
        """The peer leaves its output unread: stop computing for it rather than buffer without end."""
        self.engine.cancel(request_id, "slow reader")
        self.counters["slow_readers"] += 1
        log.warning(
            "connection %d left %d bytes unread: request %r cancelled",
            conn.number,
            conn.backlog,
            rid,
        )
        conn.send(
            P.error_message(
                rid,
                P.SLOW_READER,
                f"more than {conn.backlog_limit} bytes of output were "
                "left unread; the completion was cancelled",
            )
        )

    def _health(self) -> dict:
        return dict(
            ok=not self.draining and self.engine.alive,
            pid=os.getpid(),
            version=P.PROTOCOL_VERSION,
            uptime_s=round(time.monotonic() - self.started, 3),
            clients=self.clients,
        )

    def _model_info(self) -> dict:
        cfg, model = self.engine.model.config, self.engine.model
        return dict(
            name=self.model_dir.name,
            architecture=cfg.architecture,
            layers=cfg.num_layers,
            hidden_size=cfg.hidden_size,
            experts=cfg.num_experts,
            experts_per_token=cfg.num_experts_per_tok,
            vocab_size=cfg.vocab_size,
            max_context=cfg.max_position_embeddings,
            fim_orders=list(self.fim_orders),
            # The largest max_tokens a FIM completion may ask for (see _fim_budget).
            max_completion_tokens=cfg.max_position_embeddings - self._least_prompt_tokens() - 1,
            dtype=str(model.dtype).removeprefix("torch."),
            device=str(model.device),
            kv_block_size=self.engine.block_size,
        )


def remove_own_socket(path: Path, identity: tuple[int, int]) -> None:
    """Unlink the socket only if it is still the one this daemon bound: while it drained, a
    successor may have replaced the path, and deleting that one would strand the new engine."""
    try:
        info = path.lstat()
    except FileNotFoundError:
        return
    if (info.st_dev, info.st_ino) == identity:
        path.unlink(missing_ok=True)


def bind_socket(path: Path) -> tuple[socket.socket, tuple[int, int]]:
    """A Unix socket listening at `path`, after `prepare_socket_path`, and the (st_dev, st_ino)
    of its file, for `remove_own_socket`. It is 0600 from its first moment (the umask; no chmod,
    which would follow a link planted in its place). bind() never replaces anything that is
    there, and listen() follows at once: until then another engine starting would take the
    socket for a crashed one's leftover and replace it, and the identity, taken now, would be
    that engine's socket."""
    prepare_socket_path(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)  # the socket is created 0600: no window where others can connect
    try:
        sock.bind(str(path))
        sock.listen(LISTEN_BACKLOG)
        info = path.lstat()
    except OSError as exc:
        sock.close()
        raise UnsafeSocketPath(f"cannot listen on {path}: {exc.strerror or exc}") from exc
    finally:
        os.umask(old_umask)
    return sock, (info.st_dev, info.st_ino)


def prepare_socket_path(path: Path) -> None:
    """Refuse to start beside a live engine, or over anything but a socket of ours; remove a stale
    socket left by a crash. Never follows a symbolic link, never unlinks what is not a socket.
    (The default path's directory is checked by paths.runtime_dir, which gives it.)"""
    try:
        info = path.lstat()
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(info.st_mode):
        raise UnsafeSocketPath(
            f"{path} exists and is {_kind(info.st_mode)}, not a socket; refusing to "
            "replace it: remove it or choose another --socket"
        )
    if info.st_uid != os.getuid():
        raise UnsafeSocketPath(f"the socket {path} belongs to another user; refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except OSError as exc:
        if exc.errno != errno.ECONNREFUSED:  # e.g. a full backlog: someone listens, busy
            raise UnsafeSocketPath(
                f"cannot tell whether an engine listens on {path}: {exc.strerror or exc}"
            ) from exc
        again = path.lstat()
        if (again.st_dev, again.st_ino) == (info.st_dev, info.st_ino):
            path.unlink()  # nobody listens: a crashed engine's leftover
            log.info("removed stale socket %s", path)
        return
    finally:
        probe.close()
    raise RuntimeError(f"an engine is already listening on {path}")


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISREG, "a regular file"),
        (stat.S_ISFIFO, "a FIFO"),
    ):
        if test(mode):
            return name
    return "a special file"
