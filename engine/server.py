"""`wd-engine serve`: the resident daemon. One model, one engine loop, many clients.

Clients speak `engine.protocol` over a Unix socket (owner-only) or, optionally, over TCP on
loopback with a token. Nothing a client sends can stop the loop or disturb another client: bad
frames get an error frame and a closed connection, bad parameters an error for that request.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import secrets
import signal
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from engine import protocol as P
from engine.fim import healed_text
from engine.token_healing import token_healer
from engine.prompt_layout import (ContextChunk, build_completion_prompt, prompt_budget, supported_fim_orders,
                                  uses_repo_context)
from engine.scheduler import Engine, Request

log = logging.getLogger("wd_engine")

# Markers in a connection's request table for a request whose prompt is still being built.
PENDING, CANCELLED = "<pending>", "<cancelled>"


@dataclass
class ServeOptions:
    socket_path: Path
    tcp_host: str | None = None
    tcp_port: int | None = None
    token: str | None = None
    idle_timeout_s: float = 900.0
    drain_timeout_s: float = 10.0
    max_prompt_tokens: int = 4096
    http: object | None = None  # engine.openai_http.HttpOptions: the OpenAI-compatible listener


class _Connection:
    count = 0

    def __init__(self, reader, writer, needs_token: bool):
        _Connection.count += 1
        self.number = _Connection.count
        self.reader, self.writer = reader, writer
        self.needs_token = needs_token
        self.greeted = False
        self.lock = asyncio.Lock()
        self.requests: dict[object, str] = {}  # client request id -> engine request id
        self.tasks: set[asyncio.Task] = set()

    async def send(self, message: dict) -> None:
        async with self.lock:
            if self.writer.is_closing():
                return
            self.writer.write(P.encode_frame(message))
            await self.writer.drain()


class EngineServer:
    def __init__(self, engine: Engine, model_dir: Path, options: ServeOptions):
        self.engine = engine
        self.model_dir = Path(model_dir)
        self.options = options
        self.fim_orders = supported_fim_orders(model_dir)
        self.repo_context = uses_repo_context(model_dir)
        token_healer(self.engine.tokenizer)  # its vocabulary scan now, not in the first completion
        self.connections: set[_Connection] = set()
        self.started = time.monotonic()
        self.last_client_seen = time.monotonic()
        self.draining = False
        self.stopped = asyncio.Event()
        self.servers: list[asyncio.base_events.Server] = []
        self.counters = dict(connections=0, bad_frames=0, errors=0)
        self.http = None  # the OpenAI-compatible listener, when enabled

    # -- lifecycle ------------------------------------------------------------------------------
    async def serve(self) -> None:
        self.engine_thread = self.engine.start_thread()
        path = self.options.socket_path
        prepare_socket_path(path)
        old_umask = os.umask(0o177)  # the socket is created 0600: no window where others can connect
        try:
            unix = await asyncio.start_unix_server(self._on_unix, path=str(path), limit=P.MAX_FRAME_BYTES)
        finally:
            os.umask(old_umask)
        os.chmod(path, 0o600)
        bound = path.stat()
        self._socket_identity = (bound.st_dev, bound.st_ino)
        self.servers.append(unix)
        if self.options.tcp_port is not None:
            host = self.options.tcp_host or "127.0.0.1"
            tcp = await asyncio.start_server(self._on_tcp, host=host, port=self.options.tcp_port, limit=P.MAX_FRAME_BYTES)
            self.servers.append(tcp)
            self.tcp_port = tcp.sockets[0].getsockname()[1]
            log.info("listening on tcp %s:%d (token required)", host, self.tcp_port)
        if self.options.http is not None:
            from engine.openai_http import OpenAIFrontend  # starlette/uvicorn only when asked for

            self.http = OpenAIFrontend(self, self.options.http)
            await self.http.start()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda: asyncio.ensure_future(self.drain_and_stop("signal")))
        log.info("engine ready on %s (pid %d)", path, os.getpid())
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
        while time.monotonic() < deadline and (any(conn.tasks for conn in self.connections)
                                                or (self.http is not None and self.http.inflight)):
            await asyncio.sleep(0.05)  # requests in flight finish and send their final frame
        for conn in list(self.connections):
            conn.writer.close()
        self.stopped.set()

    async def _idle_watchdog(self) -> None:
        while True:
            await asyncio.sleep(min(5.0, max(0.1, self.options.idle_timeout_s / 4)))
            if not self.engine.alive:  # should never happen; if it does, exit so clients respawn us
                log.error("the engine loop died; stopping so that the next client starts a fresh engine")
                await self.drain_and_stop("engine loop died")
                return
            if self.connections:
                self.last_client_seen = time.monotonic()
            elif time.monotonic() - self.last_client_seen > self.options.idle_timeout_s:
                await self.drain_and_stop(f"no clients for {self.options.idle_timeout_s:.0f} s")
                return

    # -- connections ----------------------------------------------------------------------------
    async def _on_unix(self, reader, writer):
        await self._serve_connection(_Connection(reader, writer, needs_token=False))

    async def _on_tcp(self, reader, writer):
        await self._serve_connection(_Connection(reader, writer, needs_token=True))

    async def _serve_connection(self, conn: _Connection) -> None:
        self.connections.add(conn)
        self.counters["connections"] += 1
        try:
            while True:
                try:
                    message = await P.read_frame(conn.reader)
                except P.FrameError as exc:
                    self.counters["bad_frames"] += 1
                    await conn.send(P.error_message(None, P.BAD_FRAME, str(exc)))
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
            for engine_id in conn.requests.values():
                if engine_id not in (PENDING, CANCELLED):
                    self.engine.cancel(engine_id, "disconnected")
            for task in conn.tasks:
                task.cancel()
            self.connections.discard(conn)
            self.last_client_seen = time.monotonic()
            conn.writer.close()

    async def _dispatch(self, conn: _Connection, message: dict) -> bool:
        """Handle one request; False closes the connection."""
        rid, method, params = message.get("id"), message.get("method"), message.get("params", {})
        if not isinstance(rid, (int, str)) or isinstance(rid, bool):
            await conn.send(P.error_message(None, P.BAD_REQUEST, "'id' must be an integer or a string"))
            return True
        if not conn.greeted:
            return await self._hello(conn, rid, method, params)
        if method not in P.METHODS:
            await conn.send(P.error_message(rid, P.UNKNOWN_METHOD, f"unknown method {method!r}"))
            return True
        if not isinstance(params, dict):
            await conn.send(P.error_message(rid, P.BAD_REQUEST, "'params' must be a map"))
            return True
        if method in ("complete", "warm"):
            if self.draining:
                await conn.send(P.error_message(rid, P.SHUTTING_DOWN, "the engine is shutting down"))
                return True
            task = asyncio.ensure_future(self._complete(conn, rid, params, warm=method == "warm"))
            conn.tasks.add(task)
            task.add_done_callback(conn.tasks.discard)
        elif method == "cancel":
            target_id = params.get("id")
            if not isinstance(target_id, (int, str)) or isinstance(target_id, bool):
                await conn.send(P.error_message(rid, P.BAD_REQUEST, "'id' to cancel must be an integer or a string"))
                return True
            target = conn.requests.get(target_id)
            if target == PENDING:
                conn.requests[target_id] = CANCELLED  # still building its prompt: never submitted
            elif target is not None:
                self.engine.cancel(target)
            await conn.send({"id": rid, "result": {"cancelled": target is not None}})
        elif method == "stats":
            await conn.send({"id": rid, "result": dict(self.engine.stats(), **self.counters,
                                                       clients=len(self.connections))})
        elif method == "health":
            await conn.send({"id": rid, "result": self._health()})
        elif method == "model_info":
            await conn.send({"id": rid, "result": self._model_info()})
        elif method == "shutdown":
            await conn.send({"id": rid, "result": {"stopping": True}})
            asyncio.ensure_future(self.drain_and_stop("shutdown requested"))
        else:  # a second hello
            await conn.send({"id": rid, "result": self._health()})
        return True

    async def _hello(self, conn: _Connection, rid, method, params) -> bool:
        if method != "hello" or not isinstance(params, dict):
            await conn.send(P.error_message(rid, P.BAD_REQUEST, "the first request must be 'hello'"))
            return False
        if params.get("version") != P.PROTOCOL_VERSION:
            await conn.send(P.error_message(
                rid, P.VERSION_MISMATCH, f"engine speaks protocol {P.PROTOCOL_VERSION}, client {params.get('version')!r}"))
            return False
        if conn.needs_token:
            token = params.get("token")
            if not isinstance(token, str) or not hmac.compare_digest(token, self.options.token or ""):
                log.warning("tcp client refused: bad token")
                await conn.send(P.error_message(rid, P.UNAUTHORIZED, "a valid token is required"))
                return False
        conn.greeted = True
        await conn.send({"id": rid, "result": dict(self._health(), model=self._model_info())})
        return True

    # -- requests -------------------------------------------------------------------------------
    def _build_prompt(self, p: P.CompletionParams) -> tuple[list[int], str]:
        """The prompt's ids, and the text its first tokens must write (token healing)."""
        tokenizer = self.engine.tokenizer
        if p.prompt is not None:
            return tokenizer.encode_prompt(p.prompt), ""
        order = p.fim_order if p.fim_order != "auto" else ("spm" if "spm" in self.fim_orders else "psm")
        budget = prompt_budget(self.engine.model.config.max_position_embeddings, p.max_tokens,
                               self.options.max_prompt_tokens)
        chunks = [ContextChunk(c["path"], c["text"]) for c in p.chunks]
        ids = build_completion_prompt(tokenizer, p.prefix, p.suffix, chunks, p.path, order, max_prompt_tokens=budget,
                                      repo_context=self.repo_context, heal=True)
        return ids, healed_text(tokenizer, p.prefix)

    async def _complete(self, conn: _Connection, rid, params: dict, warm: bool) -> None:
        conn.requests[rid] = PENDING  # a cancel may arrive while the prompt is being built
        try:
            p = P.CompletionParams.from_params(params)
            prompt_ids, forced_text = await asyncio.to_thread(self._build_prompt, p)
        except Exception as exc:  # noqa: BLE001 - bad parameters are the client's error
            conn.requests.pop(rid, None)
            await conn.send(P.error_message(rid, P.BAD_REQUEST, str(exc)))
            return
        if conn.requests.get(rid) == CANCELLED:
            conn.requests.pop(rid, None)
            await conn.send({"id": rid, "result": {"finish_reason": "cancelled", "usage": None}})
            return
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        request = Request(
            prompt_ids, max_tokens=p.max_tokens, temperature=float(p.temperature), top_p=float(p.top_p),
            seed=p.seed, stop=p.stop, warm_only=warm, client=p.client, forced_text=forced_text, beams=p.beams,
            deadline_s=None if p.deadline_ms is None else p.deadline_ms / 1000.0,
            id=f"{conn.number}:{rid}:{secrets.token_hex(4)}",
        )
        conn.requests[rid] = request.id
        self.engine.submit(request, lambda e: loop.call_soon_threadsafe(events.put_nowait, e))
        try:
            while True:
                event = await events.get()
                if event.kind == "delta":
                    await conn.send({"id": rid, "delta": event.text})
                elif event.kind == "done":
                    await conn.send({"id": rid, "result": {"finish_reason": event.finish_reason, "usage": event.usage}})
                    return
                else:
                    self.counters["errors"] += 1
                    code = P.POOL_FULL if "pool" in (event.error or "") or "context" in (event.error or "") else P.ENGINE_ERROR
                    await conn.send(P.error_message(rid, code, event.error))
                    return
        except asyncio.CancelledError:
            self.engine.cancel(request.id, "disconnected")
            raise
        finally:
            conn.requests.pop(rid, None)

    def _health(self) -> dict:
        return dict(ok=not self.draining and self.engine.alive, pid=os.getpid(), version=P.PROTOCOL_VERSION,
                    uptime_s=round(time.monotonic() - self.started, 3), clients=len(self.connections))

    def _model_info(self) -> dict:
        cfg, model = self.engine.model.config, self.engine.model
        return dict(
            name=self.model_dir.name, architecture=cfg.architecture, layers=cfg.num_layers,
            hidden_size=cfg.hidden_size, experts=cfg.num_experts, experts_per_token=cfg.num_experts_per_tok,
            vocab_size=cfg.vocab_size, max_context=cfg.max_position_embeddings, fim_orders=list(self.fim_orders),
            dtype=str(model.dtype).removeprefix("torch."), device=str(model.device),
            kv_block_size=self.engine.block_size,
        )


def remove_own_socket(path: Path, identity: tuple[int, int]) -> None:
    """Unlink the socket only if it is still the one this daemon bound: while it drained, a
    successor may have replaced the path, and deleting that one would strand the new engine."""
    try:
        info = path.stat()
    except FileNotFoundError:
        return
    if (info.st_dev, info.st_ino) == identity:
        path.unlink(missing_ok=True)


def prepare_socket_path(path: Path) -> None:
    """Refuse to start beside a live engine; remove a stale socket left by a crash."""
    if not path.exists():
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except OSError:
        path.unlink()  # nobody listens: a crashed engine's leftover
        log.info("removed stale socket %s", path)
        return
    finally:
        probe.close()
    raise RuntimeError(f"an engine is already listening on {path}")


def new_token() -> str:
    return secrets.token_urlsafe(32)
