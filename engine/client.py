"""Asyncio client of the engine daemon. Imports no torch: the language server uses it.

`EngineClient.connect()` reaches the daemon, spawning it first if nobody listens (under a file
lock, so two editors starting at once start one engine), and reconnects after the daemon dies.
Completions stream: `async for delta in await client.complete({...})`.
"""

from __future__ import annotations

import asyncio
import fcntl
import itertools
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from engine import paths
from engine import protocol as P

log = logging.getLogger(__name__)


class EngineUnavailable(ConnectionError):
    """The daemon can't be reached or died mid-request."""


class SpawnFailed(EngineUnavailable):
    """The daemon could not be started; retrying at once would only start another."""


class EngineError(RuntimeError):
    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code, self.message = code, message


@dataclass
class SpawnConfig:
    """How to start the daemon when none is running."""

    model: str | None = None
    extra_args: list[str] = field(default_factory=list)
    python: str = sys.executable
    ready_timeout_s: float = 300.0


class CompletionStream:
    """Text deltas of one `complete`; `result` (finish_reason, usage) once iteration ends."""

    def __init__(self, client: "EngineClient", request_id: int, queue: asyncio.Queue):
        self.client, self.id, self.queue = client, request_id, queue
        self.result: dict | None = None

    def __aiter__(self):
        return self

    async def __anext__(self) -> str:
        if self.result is not None:
            raise StopAsyncIteration
        message = await self.queue.get()
        if isinstance(message, BaseException):
            raise message
        if "delta" in message:
            return message["delta"]
        self.client._pending.pop(self.id, None)
        if "error" in message:
            raise EngineError(message["error"].get("code", "error"), message["error"].get("message", ""))
        self.result = message.get("result", {})
        raise StopAsyncIteration

    async def cancel(self) -> None:
        """Stop the engine's work on this completion; later frames for it are dropped."""
        if self.result is not None:
            return
        self.client._pending.pop(self.id, None)
        try:
            await self.client.request("cancel", {"id": self.id})
        except (EngineUnavailable, EngineError):
            pass


class EngineClient:
    def __init__(
        self,
        socket_path: str | Path | None = None,
        tcp: tuple[str, int] | None = None,
        token: str | None = None,
        spawn: SpawnConfig | None = None,
        on_progress: Callable[[str], None] | None = None,
    ):
        self.socket_path = Path(socket_path) if socket_path else None
        self.tcp, self.token = tcp, token
        self.spawn = spawn
        self.on_progress = on_progress or (lambda message: None)
        self._reader = self._writer = None
        self._reader_task: asyncio.Task | None = None
        self._pending: dict[int, asyncio.Queue] = {}
        self._ids = itertools.count(1)
        self._connect_lock = asyncio.Lock()
        self._write_lock = asyncio.Lock()
        self.server_info: dict | None = None

    @property
    def connected(self) -> bool:
        return self._writer is not None and not self._writer.is_closing()

    # -- connection -----------------------------------------------------------------------------
    async def connect(self, attempts: int = 3) -> dict:
        """Connect and greet; a daemon that was just killed can still accept for a moment and
        then drop the connection, so a failed attempt is retried (respawning if allowed)."""
        async with self._connect_lock:
            for attempt in range(attempts):
                if self.connected:
                    return self.server_info
                try:
                    return await self._connect_once()
                except SpawnFailed:
                    raise
                except EngineUnavailable:
                    if attempt == attempts - 1:
                        raise
                    await asyncio.sleep(0.2 * (attempt + 1))

    async def _connect_once(self) -> dict:
        if self.tcp is None:
            path = self.socket_path or paths.socket_path()
            if not _listening(path) and self.spawn is not None:
                await _in_daemon_thread(spawn_daemon, path, self.spawn, self.on_progress)
            try:
                self._reader, self._writer = await asyncio.open_unix_connection(str(path), limit=P.MAX_FRAME_BYTES)
            except OSError as exc:
                raise EngineUnavailable(f"no engine at {path}: {exc}") from exc
        else:
            try:
                self._reader, self._writer = await asyncio.open_connection(*self.tcp, limit=P.MAX_FRAME_BYTES)
            except OSError as exc:
                raise EngineUnavailable(f"no engine at {self.tcp[0]}:{self.tcp[1]}: {exc}") from exc
        self._reader_task = asyncio.ensure_future(self._read_loop(self._reader))
        hello = {"version": P.PROTOCOL_VERSION}
        if self.token:
            hello["token"] = self.token
        try:
            self.server_info = await self._call("hello", hello)
        except BaseException:
            self.disconnect()
            raise
        return self.server_info

    def disconnect(self, reason: str = "connection closed") -> None:
        """Close without waiting (e.g. while the process is exiting); pending requests fail."""
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()
        if self._reader_task is not None and self._reader_task is not _current_task():
            self._reader_task.cancel()
        self._fail_pending(EngineUnavailable(reason))

    async def close(self) -> None:
        writer = self._writer
        self.disconnect()
        if writer is not None:
            try:
                await writer.wait_closed()  # the daemon sees the client gone only once this is flushed
            except (ConnectionError, OSError):
                pass

    def _fail_pending(self, exc: BaseException) -> None:
        pending, self._pending = self._pending, {}
        for queue in pending.values():
            queue.put_nowait(exc)

    async def _read_loop(self, reader) -> None:
        try:
            while True:
                message = await P.read_frame(reader)
                if message is None:
                    break
                queue = self._pending.get(message.get("id"))
                if queue is not None:
                    queue.put_nowait(message)
                elif "error" in message:
                    log.warning("engine: %s", message["error"])
        except (P.FrameError, ConnectionError, OSError) as exc:
            log.warning("engine connection lost: %s", exc)
        finally:
            if self._reader is reader:
                self._writer = None
                self._fail_pending(EngineUnavailable("the engine closed the connection"))

    # -- requests -------------------------------------------------------------------------------
    async def _send(self, method: str, params: dict) -> tuple[int, asyncio.Queue]:
        request_id = next(self._ids)
        queue: asyncio.Queue = asyncio.Queue()
        self._pending[request_id] = queue
        try:
            async with self._write_lock:
                self._writer.write(P.encode_frame({"id": request_id, "method": method, "params": params}))
                await self._writer.drain()
        except (ConnectionError, OSError, AttributeError) as exc:
            self._pending.pop(request_id, None)
            self.disconnect()
            raise EngineUnavailable(f"engine connection lost: {exc}") from exc
        return request_id, queue

    async def _call(self, method: str, params: dict) -> dict:
        request_id, queue = await self._send(method, params)
        message = await queue.get()
        self._pending.pop(request_id, None)
        if isinstance(message, BaseException):
            raise message
        if "error" in message:
            raise EngineError(message["error"].get("code", "error"), message["error"].get("message", ""))
        return message.get("result", {})

    async def request(self, method: str, params: dict | None = None) -> dict:
        """One request/response call (`stats`, `health`, `model_info`, `warm`, `shutdown`...)."""
        await self.connect()
        return await self._call(method, params or {})

    async def complete(self, params: dict) -> CompletionStream:
        await self.connect()
        request_id, queue = await self._send("complete", params)
        return CompletionStream(self, request_id, queue)

    async def warm(self, params: dict) -> dict:
        return await self.request("warm", params)


async def _in_daemon_thread(fn, *args):
    """Run a blocking call in a daemon thread: unlike asyncio.to_thread, a process exiting
    meanwhile (an editor closing while the engine loads) does not wait for it."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def settle(setter, value):
        if not done.done():
            setter(value)

    def work():
        try:
            result = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
            callback = (settle, done.set_exception, exc)
        else:
            callback = (settle, done.set_result, result)
        try:
            loop.call_soon_threadsafe(*callback)
        except RuntimeError:
            pass  # the loop is gone: nobody is waiting any more

    threading.Thread(target=work, name="wd-engine-spawn", daemon=True).start()
    return await done


def _current_task():
    try:
        return asyncio.current_task()
    except RuntimeError:  # called with no running loop (an exiting process)
        return None


def _listening(path: Path) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
        return True
    except OSError:
        return False
    finally:
        probe.close()


def spawn_daemon(path: Path, config: SpawnConfig, on_progress: Callable[[str], None]) -> None:
    """Start `wd-engine serve` detached unless one already listens, and wait until it does.

    An exclusive lock on a file beside the socket serialises starters: the second editor waits
    for the first one's engine instead of starting its own. The lock dies with its holder, so a
    crash while starting leaves nothing stale behind.
    """
    lock_file = path.parent / (path.name + ".lock")
    with open(lock_file, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _listening(path):
            return
        command = [config.python, "-m", "engine.cli", "serve", "--socket", str(path)]
        if config.model:
            command += ["--model", config.model]
        command += config.extra_args
        log_file = open(paths.log_path(), "ab")
        on_progress("starting the engine")
        process = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=log_file, stderr=log_file,
            start_new_session=True,  # outlives the editor that started it
            env=dict(os.environ),
        )
        log_file.close()
        started = time.monotonic()
        next_report = started + 1.0
        while not _listening(path):
            if process.poll() is not None:
                raise SpawnFailed(f"the engine exited with code {process.returncode} while starting; "
                                  f"see {paths.log_path()}")
            now = time.monotonic()
            if now - started > config.ready_timeout_s:
                process.kill()  # never leave a half-started engine holding memory
                raise SpawnFailed(f"the engine did not start within {config.ready_timeout_s:.0f} s")
            if now >= next_report:
                on_progress(f"loading the model ({now - started:.0f} s)")
                next_report = now + 1.0
            time.sleep(0.05)
        on_progress("engine ready")
