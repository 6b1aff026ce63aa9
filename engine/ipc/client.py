"""Asyncio client of the engine daemon. Imports no torch: the language server uses it.

`EngineClient.connect()` reaches the daemon, spawning it first if nobody listens (under a file
lock, so two editors starting at once start one engine), and reconnects after the daemon dies.
Completions stream: `async for delta in await client.complete({...})`. Requests connect first
unless told not to (`reconnect=False`: a caller that connects, and spawns, in one place of its own).

Nothing is sent before the socket is known to be ours: the path must be a socket (not a symbolic
link) owned by this user, and the peer must run as this user (SO_PEERCRED where the system has
it). Every wait has a bound: connecting and the hello, each write (an engine that stopped reading
fills the socket buffer), the spawn lock (polled, never a blocking flock) and a cancel.
"""

from __future__ import annotations

import asyncio
import fcntl
import itertools
import logging
import os
import socket
import stat
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from engine.ipc import paths
from engine.ipc import protocol as P
from engine.ipc.protocol import ErrorCode
from engine.ipc.socket_path import file_kind

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 5.0  # reaching a listening engine and its answer to the hello
WRITE_TIMEOUT_S = 5.0  # an engine that reads nothing for this long is stopped or hung
CANCEL_WAIT_S = 1.0  # for the engine's acknowledgement of a cancel; the cancel itself is sent
LOCK_POLL_S = 0.1
# The holder may be another editor or a spawn of this process that is still under way.
LOCK_HELD_MESSAGE = "the engine is being started (spawn lock held)"


class EngineUnavailable(ConnectionError):
    """The daemon can't be reached or died mid-request."""


class SpawnFailed(EngineUnavailable):
    """The daemon could not be started; retrying at once would only start another."""


class EngineExited(SpawnFailed):
    """The spawned daemon exited before it listened; `reason` is the first line of why, as it
    wrote it to its log (a model that cannot load, one that does not fit the GPU), or None."""

    def __init__(self, message: str, reason: str | None = None):
        super().__init__(message)
        self.reason = reason


class UnsafeSocket(SpawnFailed):
    """Something that is not this user's engine socket is at the socket path (a file, a directory,
    a symbolic link, another user's socket) or the peer runs as another user: nothing is sent
    there, and no engine is started, which could not bind the path anyway."""


class EngineStarting(EngineUnavailable):
    """The engine is still starting (loading its model, or another editor is starting it)."""


class EngineTimeout(EngineUnavailable):
    """The engine did not answer or read in time: stopped, hung or overloaded."""


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
    # Waiting for another starter's engine (it may be loading a big model) before giving up.
    lock_timeout_s: float = 300.0


class CompletionStream:
    """Text deltas of one `complete`; `result` (finish_reason, usage) once iteration ends."""

    def __init__(self, client: EngineClient, request_id: int, queue: asyncio.Queue):
        self.client, self.id, self.queue = client, request_id, queue
        self.result: dict | None = None
        self._cancelled = False

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
            raise EngineError(
                message["error"].get("code", "error"), message["error"].get("message", "")
            )
        self.result = message.get("result", {})
        raise StopAsyncIteration

    async def cancel(self, wait_s: float = CANCEL_WAIT_S) -> None:
        """Stop the engine's work on this completion; later frames for it are dropped. Takes at
        most `wait_s` (a stopped engine never acknowledges), and never reconnects: an engine
        drops the work of a connection that closed."""
        if self.result is not None or self._cancelled:
            return
        self._cancelled = True
        self.client._pending.pop(self.id, None)
        if not self.client.connected:
            return
        try:
            await self.client._call("cancel", {"id": self.id}, timeout=wait_s)
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
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
        write_timeout_s: float = WRITE_TIMEOUT_S,
    ):
        self.socket_path = Path(socket_path) if socket_path else None
        self.tcp, self.token = tcp, token
        self.spawn = spawn
        self.connect_timeout_s, self.write_timeout_s = connect_timeout_s, write_timeout_s
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

    def offers(self, feature: str) -> bool:
        """Whether the connected engine's hello lists `feature` (protocol.FEATURES); an engine
        that lists no features predates them and takes none of the optional parameters."""
        return feature in P.hello_features(self.server_info)

    # -- connection -----------------------------------------------------------------------------
    async def connect(self, attempts: int = 3) -> dict:
        """Connect and greet; a daemon that was just killed can still accept for a moment and
        then drop the connection, so a failed attempt is retried (respawning if allowed). A
        failed spawn, something foreign at the path or an engine that does not answer is not."""
        async with self._connect_lock:
            for attempt in range(attempts):
                if self.connected:
                    return self.server_info
                try:
                    return await self._connect_once()
                except (SpawnFailed, EngineTimeout):
                    raise
                except EngineUnavailable:
                    if attempt == attempts - 1:
                        raise
                    await asyncio.sleep(0.2 * (attempt + 1))

    async def _connect_once(self) -> dict:
        if self.tcp is None:
            path = self._unix_path()
            ours = check_socket_path(path)
            if self.spawn is not None and not (ours and _listening(path)):
                await _in_daemon_thread(spawn_daemon, path, self.spawn, self.on_progress)
            self._reader, self._writer = await self._open_unix(path)
            where = str(path)
        else:
            where = f"{self.tcp[0]}:{self.tcp[1]}"
            try:
                async with asyncio.timeout(self.connect_timeout_s):
                    opened = asyncio.open_connection(*self.tcp, limit=P.MAX_FRAME_BYTES)
                    self._reader, self._writer = await opened
            except TimeoutError as exc:
                raise EngineTimeout(
                    f"no answer from {where} within {self.connect_timeout_s:.1f} s"
                ) from exc
            except OSError as exc:
                raise EngineUnavailable(f"no engine at {where}: {exc}") from exc
        self._reader_task = asyncio.ensure_future(self._read_loop(self._reader))
        hello = {"version": P.PROTOCOL_VERSION}
        if self.token:
            hello["token"] = self.token
        try:
            self.server_info = await self._call("hello", hello, timeout=self.connect_timeout_s)
        except EngineTimeout as exc:
            self.disconnect()
            raise EngineTimeout(
                f"the engine at {where} accepted the connection but did not answer "
                f"within {self.connect_timeout_s:.1f} s (stopped or hung?)"
            ) from exc
        except BaseException:
            self.disconnect()
            raise
        return self.server_info

    def _unix_path(self) -> Path:
        if self.socket_path is not None:
            return self.socket_path
        try:
            return paths.socket_path()
        except paths.UnsafeRuntimeDir as exc:
            raise UnsafeSocket(str(exc)) from exc

    async def _open_unix(self, path: Path):
        """A stream to the engine at `path`, once the peer is known to be this user's."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                await asyncio.get_running_loop().sock_connect(sock, str(path))
            check_peer(sock, path)
            return await asyncio.open_unix_connection(sock=sock, limit=P.MAX_FRAME_BYTES)
        except EngineUnavailable:
            sock.close()
            raise
        except TimeoutError as exc:
            sock.close()
            raise EngineTimeout(
                f"the engine at {path} did not accept a connection within "
                f"{self.connect_timeout_s:.1f} s"
            ) from exc
        except OSError as exc:
            sock.close()
            raise EngineUnavailable(f"no engine at {path}: {exc}") from exc
        except BaseException:
            sock.close()
            raise

    def disconnect(self, reason: str = "connection closed", abort: bool = False) -> None:
        """Close without waiting (e.g. while the process is exiting); pending requests fail.
        `abort` drops unsent frames: an engine that resumes must not find stale requests."""
        writer, self._writer = self._writer, None
        if writer is not None:
            if abort:
                writer.transport.abort()
            else:
                writer.close()
        if self._reader_task is not None and self._reader_task is not _current_task():
            self._reader_task.cancel()
        self._fail_pending(EngineUnavailable(reason))

    async def close(self) -> None:
        writer = self._writer
        self.disconnect()
        if writer is not None:
            try:
                # The daemon sees the client gone only once this is flushed; a stopped one never
                # reads it, and then the frames are dropped.
                async with asyncio.timeout(self.write_timeout_s):
                    await writer.wait_closed()
            except TimeoutError:
                writer.transport.abort()
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
        """Write one frame. The wait for the socket to take it is bounded: an engine that stopped
        reading loses the connection (and the frames not yet sent) instead of stalling us. A
        request that cannot be framed is refused here (EngineError) and the connection stays."""
        request_id = next(self._ids)
        frame = _encode_request(request_id, method, params)
        queue: asyncio.Queue = asyncio.Queue()
        self._pending[request_id] = queue
        try:
            async with asyncio.timeout(self.write_timeout_s):
                async with self._write_lock:
                    self._writer.write(frame)
                    await self._writer.drain()
        except TimeoutError as exc:
            self._pending.pop(request_id, None)
            self.disconnect("the engine stopped reading", abort=True)
            raise EngineTimeout(
                f"the engine read nothing for {self.write_timeout_s:.1f} s (stopped or hung?)"
            ) from exc
        except (ConnectionError, OSError, AttributeError) as exc:
            self._pending.pop(request_id, None)
            self.disconnect()
            raise EngineUnavailable(f"engine connection lost: {exc}") from exc
        except BaseException:
            self._pending.pop(request_id, None)
            raise
        return request_id, queue

    async def _call(self, method: str, params: dict, timeout: float | None = None) -> dict:
        """Send a request and wait for its answer; `timeout` bounds both (EngineTimeout)."""
        request_id = None
        try:
            async with asyncio.timeout(timeout):
                request_id, queue = await self._send(method, params)
                message = await queue.get()
        except TimeoutError as exc:
            raise EngineTimeout(
                f"the engine did not answer {method!r} within {timeout:.1f} s"
            ) from exc
        finally:
            if request_id is not None:
                self._pending.pop(request_id, None)
        if isinstance(message, BaseException):
            raise message
        if "error" in message:
            raise EngineError(
                message["error"].get("code", "error"), message["error"].get("message", "")
            )
        return message.get("result", {})

    async def request(
        self,
        method: str,
        params: dict | None = None,
        timeout: float | None = None,
        reconnect: bool = True,
    ) -> dict:
        """One request/response call (`stats`, `health`, `model_info`, `warm`, `shutdown`...);
        `timeout` bounds sending it and the wait for the answer (EngineTimeout). Without
        `reconnect`, only on the current connection (EngineUnavailable when there is none)."""
        await self._ready(reconnect)
        return await self._call(method, params or {}, timeout)

    async def complete(self, params: dict, reconnect: bool = True) -> CompletionStream:
        await self._ready(reconnect)
        request_id, queue = await self._send("complete", params)
        return CompletionStream(self, request_id, queue)

    async def warm(
        self, params: dict, timeout: float | None = None, reconnect: bool = True
    ) -> dict:
        return await self.request("warm", params, timeout, reconnect)

    async def _ready(self, reconnect: bool) -> None:
        """Connected, connecting (and maybe spawning) first if allowed."""
        if reconnect:
            await self.connect()
        elif not self.connected:
            raise EngineUnavailable("not connected to the engine")


def _encode_request(request_id: int, method: str, params: dict) -> bytes:
    """The request's frame; EngineError for one that cannot be sent (text that is no valid
    UTF-8, such as a lone surrogate; a frame over the size limit), which says nothing about the
    engine or the connection."""
    try:
        return P.encode_frame({"id": request_id, "method": method, "params": params})
    except P.FrameError as exc:
        message = f"the {method!r} request is not sent: {exc}"
        raise EngineError(ErrorCode.BAD_FRAME, message) from exc
    except (UnicodeEncodeError, TypeError, ValueError, OverflowError) as exc:
        raise EngineError(
            ErrorCode.BAD_REQUEST, f"the {method!r} request cannot be encoded: {exc}"
        ) from exc


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


def check_socket_path(path: Path) -> bool:
    """True when this user's socket is at `path`, False when nothing is; UnsafeSocket, naming the
    path, when something else is. lstat: a symbolic link is refused, never followed."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise UnsafeSocket(f"cannot check the engine socket path {path}: {exc}") from exc
    if not stat.S_ISSOCK(info.st_mode):
        raise UnsafeSocket(
            f"{path} is {file_kind(info.st_mode)}, not the engine's socket: remove it "
            "or set another socket path; no engine is started meanwhile"
        )
    if info.st_uid != os.getuid():
        raise UnsafeSocket(f"the socket {path} belongs to uid {info.st_uid}, not to this user")
    return True


def peer_uid(sock: socket.socket) -> int | None:
    """The uid the peer of a connected Unix socket runs as; None where the system can't say."""
    try:
        if hasattr(socket, "SO_PEERCRED"):  # Linux: struct ucred {pid, uid, gid}
            creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            return struct.unpack("3i", creds)[1]
        if hasattr(socket, "LOCAL_PEERCRED"):  # macOS, BSD: struct xucred {version, uid, ...}
            creds = sock.getsockopt(0, socket.LOCAL_PEERCRED, struct.calcsize("2I") + 72)
            return struct.unpack_from("2I", creds)[1]
    except OSError as exc:
        log.debug("cannot read the peer's credentials: %s", exc)
    return None


def check_peer(sock: socket.socket, path: Path) -> None:
    """Refuse a peer running as another user, before any prompt or code is sent to it."""
    uid = peer_uid(sock)
    if uid is not None and uid != os.getuid():
        raise UnsafeSocket(f"the process listening on {path} runs as uid {uid}, not as this user")


def _listening(path: Path) -> bool:
    """Whether an engine accepts on `path`. Non-blocking: a stopped engine with a full backlog
    (EAGAIN) is listening too, and must not stall the caller."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.setblocking(False)
    try:
        probe.connect(str(path))
        return True
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        probe.close()


EXIT_REASON_MAX_BYTES = 64 << 10  # of the log's end: a start's last words are near it
EXIT_REASON_MAX_CHARS = 500


def exit_reason(log_path: Path, start: int, pid: int | None = None) -> str | None:
    """Why an engine that exited while starting did, from what it appended to its log after
    `start`: its own error line (`wd-engine: ...` on stderr, else an ERROR record of its pid),
    else the last line (a traceback's exception). The first line of it, or None."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # as the log is opened
    try:
        fd = os.open(log_path, flags)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return None
        f.seek(max(start, info.st_size - EXIT_REASON_MAX_BYTES))
        text = f.read(EXIT_REASON_MAX_BYTES).decode("utf-8", "replace")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    said = [line for line in lines if line.startswith("wd-engine")]
    if not said and pid is not None:
        said = [
            line.split(f"[{pid}]: ", 1)[1]
            for line in lines
            if " ERROR " in line and f"[{pid}]: " in line
        ]
    if said:
        return said[-1].removeprefix("wd-engine: ")[:EXIT_REASON_MAX_CHARS]
    return lines[-1][:EXIT_REASON_MAX_CHARS] if lines else None


def spawn_lock_path(path: Path) -> Path:
    """The file whose lock serialises starting the engine that listens on `path`."""
    return path.parent / (path.name + ".lock")


def spawn_daemon(path: Path, config: SpawnConfig, on_progress: Callable[[str], None]) -> None:
    """Start `wd-engine serve` detached unless one already listens, and wait until it does.

    An exclusive lock on a file beside the socket serialises starters: the second editor waits
    for the first one's engine instead of starting its own. The lock dies with its holder, so a
    crash while starting leaves nothing stale behind. It is polled, never waited for in flock:
    a starter that is stuck must not stall this one beyond `config.lock_timeout_s`.
    """
    lock_file = spawn_lock_path(path)
    try:
        lock_fd = os.open(lock_file, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise SpawnFailed(f"cannot open the spawn lock {lock_file}: {exc}") from exc
    try:
        if not _take_spawn_lock(lock_fd, lock_file, path, config, on_progress):
            return  # the holder's engine is up
        if check_socket_path(path) and _listening(path):
            return
        _start_and_wait(path, config, on_progress)
    finally:
        os.close(lock_fd)  # releases the lock


def _take_spawn_lock(
    lock_fd: int,
    lock_file: Path,
    path: Path,
    config: SpawnConfig,
    on_progress: Callable[[str], None],
) -> bool:
    """True once the lock is ours; False when the holder's engine starts listening meanwhile."""
    started = time.monotonic()
    told = False
    while True:
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            pass
        if check_socket_path(path) and _listening(path):
            return False
        if not told:
            log.info("%s: %s", LOCK_HELD_MESSAGE, lock_file)
            on_progress(LOCK_HELD_MESSAGE)
            told = True
        if time.monotonic() - started > config.lock_timeout_s:
            raise SpawnFailed(
                f"the spawn lock {lock_file} was held for {config.lock_timeout_s:.0f} s "
                f"without an engine listening on {path}"
            )
        time.sleep(LOCK_POLL_S)


def _start_and_wait(path: Path, config: SpawnConfig, on_progress: Callable[[str], None]) -> None:
    command = [config.python, "-m", "engine.cli", "serve", "--socket", str(path)]
    if config.model:
        command += ["--model", config.model]
    command += config.extra_args
    try:
        log_path = paths.log_path()
        log_file = paths.open_private_log(log_path, "ab")
        log_start = os.fstat(log_file.fileno()).st_size  # where this engine's lines begin
    except (paths.UnsafeLogFile, paths.UnsafeRuntimeDir, OSError) as exc:
        raise SpawnFailed(f"not starting the engine: {exc}") from exc
    on_progress("starting the engine")
    try:
        process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=log_file,
            start_new_session=True,  # outlives the editor that started it
            env=dict(os.environ),
        )
    except OSError as exc:
        raise SpawnFailed(f"cannot start the engine ({command[0]}): {exc}") from exc
    finally:
        log_file.close()
    started = time.monotonic()
    next_report = started + 1.0
    while not _listening(path):
        if process.poll() is not None:
            reason = exit_reason(log_path, log_start, getattr(process, "pid", None))
            raise EngineExited(
                f"the engine exited with code {process.returncode} while starting"
                + (f": {reason}" if reason else "")
                + f"; see {log_path}",
                reason,
            )
        now = time.monotonic()
        if now - started > config.ready_timeout_s:
            process.kill()  # never leave a half-started engine holding memory
            raise SpawnFailed(f"the engine did not start within {config.ready_timeout_s:.0f} s")
        if now >= next_report:
            on_progress(f"loading the model ({now - started:.0f} s)")
            next_report = now + 1.0
        time.sleep(0.05)
    on_progress("engine ready")
