"""The engine client's safety and bounds, without an engine: what it refuses to talk to (a socket
path that is not this user's socket, a peer of another user), how long it waits (hello, writes,
cancel, the spawn lock), and where it logs (0600 files in a 0700 directory, never through a
link)."""

import asyncio
import fcntl
import os
import socket
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from engine.ipc import client as C
from engine.ipc import paths
from engine.ipc import protocol as P
from engine.ipc.client import (
    EngineClient,
    EngineTimeout,
    EngineUnavailable,
    SpawnConfig,
    SpawnFailed,
    UnsafeSocket,
)


@pytest.fixture
def run_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("WD_ENGINE_DIR", str(tmp_path / "run"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    return paths.runtime_dir()


@pytest.fixture
def no_popen(monkeypatch):
    """Records what would have been started; starts nothing."""
    started = []

    def popen(command, **kw):
        started.append(command)
        raise AssertionError("no engine may be started here")

    monkeypatch.setattr(C.subprocess, "Popen", popen)
    return started


def plant(kind: str, path: Path, tmp_path: Path) -> None:
    if kind == "file":
        path.write_text("precious\n")
    elif kind == "dir":
        path.mkdir()
        (path / "inside").write_text("precious\n")
    elif kind == "symlink":
        (tmp_path / "target").write_text("precious\n")
        path.symlink_to(tmp_path / "target")
    elif kind == "fifo":
        os.mkfifo(path)


def listener(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    sock.listen(8)
    return sock


# -- the socket path --------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["file", "dir", "symlink", "fifo"])
def test_what_is_not_our_socket_is_refused_by_name(kind, run_dir, tmp_path):
    path = run_dir / "engine.sock"
    plant(kind, path, tmp_path)
    with pytest.raises(UnsafeSocket, match=str(path)):
        C.check_socket_path(path)


def test_our_socket_passes_and_another_users_does_not(run_dir, monkeypatch):
    path = run_dir / "engine.sock"
    assert C.check_socket_path(path) is False  # nothing there: an engine may be started
    sock = listener(path)
    try:
        assert C.check_socket_path(path) is True
        monkeypatch.setattr(C.os, "getuid", lambda: os.geteuid() + 1)
        with pytest.raises(UnsafeSocket, match="belongs to uid"):
            C.check_socket_path(path)
    finally:
        sock.close()


def test_peer_uid_is_read_from_the_socket():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        uid = C.peer_uid(a)
        if hasattr(socket, "SO_PEERCRED"):
            assert uid == os.getuid()
        else:
            assert uid in (None, os.getuid())  # None where the system cannot say: not checked
        C.check_peer(a, Path("pair"))
    finally:
        a.close()
        b.close()


class RecordingEngine:
    """A Unix listener that records every byte a client sends; answers only if told to."""

    def __init__(self, path: Path, answer_hello: bool = False, read_after_hello: bool = True):
        self.path, self.answer_hello, self.read_after_hello = path, answer_hello, read_after_hello
        self.connections, self.received, self.frames = 0, b"", []

    async def __aenter__(self):
        # A small buffer limit: a listener that stops reading stops taking bytes soon.
        self.server = await asyncio.start_unix_server(
            self._serve, path=str(self.path), limit=1 << 16
        )
        return self

    async def __aexit__(self, *exc):
        self.server.close()

    async def _serve(self, reader, writer):
        self.connections += 1
        try:
            hello = await P.read_frame(reader)
            if hello is None:
                return
            self.frames.append(hello)
            if not self.answer_hello:
                await asyncio.sleep(3600)  # stopped: reads nothing more, answers nothing
            writer.write(P.encode_frame({"id": hello["id"], "result": {"pid": os.getpid()}}))
            await writer.drain()
            if not self.read_after_hello:
                await asyncio.sleep(3600)
            while (frame := await P.read_frame(reader)) is not None:
                self.frames.append(frame)  # answers nothing: a hung engine
        except (ConnectionError, asyncio.CancelledError, P.FrameError):
            pass


async def test_a_peer_of_another_user_gets_nothing(run_dir, monkeypatch):
    path = run_dir / "engine.sock"
    async with RecordingEngine(path, answer_hello=True) as engine:
        monkeypatch.setattr(C, "peer_uid", lambda sock: os.getuid() + 1)
        client = EngineClient(socket_path=path)
        with pytest.raises(UnsafeSocket, match=f"{path}.*uid"):
            await client.connect()
        await asyncio.sleep(0.05)
        assert engine.frames == [] and not client.connected  # not even the hello


async def test_a_symlink_to_a_live_socket_is_not_followed_and_starts_nothing(
    run_dir, tmp_path, monkeypatch
):
    elsewhere = tmp_path / "elsewhere.sock"
    spawned = []
    monkeypatch.setattr(C, "spawn_daemon", lambda *args: spawned.append(args))
    async with RecordingEngine(elsewhere, answer_hello=True) as engine:
        (run_dir / "engine.sock").symlink_to(elsewhere)
        client = EngineClient(spawn=SpawnConfig())
        with pytest.raises(UnsafeSocket, match="symbolic link"):
            await client.connect()
        await asyncio.sleep(0.05)
        assert engine.connections == 0 and spawned == []
    assert os.readlink(run_dir / "engine.sock") == str(elsewhere)


def test_spawning_refuses_a_directory_at_the_socket_path(run_dir, tmp_path, no_popen):
    path = run_dir / "engine.sock"
    plant("dir", path, tmp_path)
    with pytest.raises(UnsafeSocket, match="a directory"):
        C.spawn_daemon(path, SpawnConfig(), lambda message: None)
    assert no_popen == [] and (path / "inside").read_text() == "precious\n"


def test_a_full_backlog_counts_as_listening_without_blocking(run_dir):
    path = run_dir / "engine.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(0)  # never accepted, like a stopped engine's
    queued = []
    try:
        for _ in range(64):
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            probe.setblocking(False)
            queued.append(probe)
            try:
                probe.connect(str(path))
            except BlockingIOError:
                break
        assert C._listening(path)
    finally:
        for probe in queued:
            probe.close()
        server.close()


# -- bounded waits ----------------------------------------------------------------------------
async def test_a_silent_engine_fails_the_hello_in_bounded_time_and_once(run_dir):
    path = run_dir / "engine.sock"
    async with RecordingEngine(path, answer_hello=False) as engine:
        client = EngineClient(socket_path=path, connect_timeout_s=0.3)
        with pytest.raises(EngineTimeout, match="did not answer"):
            await client.connect()
        assert (
            engine.connections == 1 and not client.connected
        )  # not retried: it would not answer either


async def test_writes_to_an_engine_that_stopped_reading_are_bounded(run_dir):
    path = run_dir / "engine.sock"
    async with RecordingEngine(path, answer_hello=True, read_after_hello=False):
        client = EngineClient(socket_path=path, write_timeout_s=0.3)
        await client.connect()
        with pytest.raises(EngineTimeout, match="read nothing"):
            for _ in range(8):  # far more than the socket buffers hold
                await client.complete({"prefix": "x" * (2 << 20), "suffix": ""})
        assert not client.connected and client._pending == {}


async def test_a_cancel_never_waits_for_a_hung_engine_and_leaves_nothing_pending(run_dir):
    path = run_dir / "engine.sock"
    async with RecordingEngine(path, answer_hello=True) as engine:
        client = EngineClient(socket_path=path)
        await client.connect()
        stream = await client.complete({"prefix": "def f(", "suffix": ""})
        await stream.cancel(wait_s=0.2)
        await stream.cancel(wait_s=0.2)  # a second cancel sends nothing more
        await asyncio.sleep(0.05)
        assert [f["method"] for f in engine.frames] == ["hello", "complete", "cancel"]
        assert engine.frames[-1]["params"] == {"id": stream.id}
        assert client._pending == {} and client.connected
        # A request with a bound that the engine never answers: EngineTimeout, nothing pending.
        with pytest.raises(EngineTimeout):
            await client.request("stats", timeout=0.2)
        assert client._pending == {}
        await client.close()


async def test_a_request_bound_covers_a_write_the_engine_never_reads(run_dir):
    path = run_dir / "engine.sock"
    async with RecordingEngine(path, answer_hello=True, read_after_hello=False):
        client = EngineClient(socket_path=path, write_timeout_s=60)
        await client.connect()
        async with asyncio.timeout(10):  # only catches a hang
            with pytest.raises(EngineTimeout, match="did not answer 'warm' within 0.3 s"):
                # Far more than the socket buffers hold: the write itself cannot finish.
                await client.request("warm", {"prefix": "x" * (6 << 20)}, timeout=0.3)
        assert client._pending == {}
        client.disconnect(abort=True)


async def test_without_reconnect_nothing_is_connected_or_spawned(run_dir, monkeypatch):
    path = run_dir / "engine.sock"
    spawned = []
    monkeypatch.setattr(C, "spawn_daemon", lambda *args: spawned.append(args))
    async with RecordingEngine(path, answer_hello=True) as engine:
        client = EngineClient(socket_path=path, spawn=SpawnConfig())
        for call in (
            client.request("stats", reconnect=False),
            client.warm({}, reconnect=False),
            client.complete({"prefix": "", "suffix": ""}, reconnect=False),
        ):
            with pytest.raises(EngineUnavailable, match="not connected"):
                await call
        await asyncio.sleep(0.05)
        assert engine.connections == 0 and spawned == [] and not client.connected


# -- the spawn lock ---------------------------------------------------------------------------
def hold_lock(path: Path) -> int:
    fd = os.open(C.spawn_lock_path(path), os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(
        fd, fcntl.LOCK_EX
    )  # another open file description: conflicts within one process too
    return fd


def test_a_held_spawn_lock_is_polled_and_given_up_on(run_dir, no_popen):
    path = run_dir / "engine.sock"
    holder = hold_lock(path)
    progress = []
    try:
        with pytest.raises(SpawnFailed, match="spawn lock .* was held for"):
            C.spawn_daemon(path, SpawnConfig(lock_timeout_s=0.3), progress.append)
    finally:
        os.close(holder)
    assert progress == [C.LOCK_HELD_MESSAGE] and no_popen == []


def test_the_lock_holders_engine_is_used_once_it_listens(run_dir, no_popen):
    path = run_dir / "engine.sock"
    holder = hold_lock(path)
    started, engines = threading.Event(), []

    def start_engine():
        started.wait(10)
        engines.append(listener(path))

    thread = threading.Thread(target=start_engine, daemon=True)
    thread.start()
    try:
        C.spawn_daemon(path, SpawnConfig(lock_timeout_s=30), lambda message: started.set())
    finally:
        os.close(holder)
        thread.join()
        for engine in engines:
            engine.close()
    assert no_popen == []  # the holder's engine serves; no second one


# -- logs -------------------------------------------------------------------------------------
def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_the_log_is_0600_in_a_0700_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    old = tmp_path / "state" / "wd-lsp"
    old.mkdir(parents=True, mode=0o755)
    os.chmod(old, 0o755)  # as an older version left it
    (old / "engine.log").write_text("earlier\n")
    os.chmod(old / "engine.log", 0o644)
    log = paths.log_path()
    assert log.parent == old and mode(old) == 0o700
    with paths.open_private_log(log, "a") as f:
        f.write("more\n")
    assert mode(log) == 0o600 and log.read_text() == "earlier\nmore\n"
    fresh = old / "fresh.log"
    with paths.open_private_log(fresh) as f:
        f.write(b"x")
    assert mode(fresh) == 0o600


@pytest.mark.parametrize("kind", ["symlink", "fifo", "dir"])
def test_the_log_is_never_written_through_what_is_planted_there(kind, tmp_path):
    path = tmp_path / "engine.log"
    plant(kind, path, tmp_path)
    with pytest.raises(paths.UnsafeLogFile, match=str(path)):
        paths.open_private_log(path)
    if kind == "symlink":
        assert (tmp_path / "target").read_text() == "precious\n" and path.is_symlink()


def test_a_private_dirs_mode_is_fixed_on_what_was_checked_not_on_a_swapped_in_link(
    tmp_path, monkeypatch
):
    """Between the check and the chmod, the directory is moved away and a link to another
    directory put in its place: the mode change must not follow that link."""
    path, victim = tmp_path / "wd-lsp", tmp_path / "victim"
    for directory in (path, victim):
        directory.mkdir()
        os.chmod(directory, 0o755)
    real_chmod, real_fchmod = os.chmod, os.fchmod

    def swap():
        path.rename(tmp_path / "moved")
        path.symlink_to(victim)

    def chmod(target, mode, **kw):
        swap()
        return real_chmod(target, mode, **kw)

    def fchmod(fd, mode):
        swap()
        return real_fchmod(fd, mode)

    monkeypatch.setattr(os, "chmod", chmod)
    monkeypatch.setattr(os, "fchmod", fchmod)
    paths.ensure_private_dir(path)
    monkeypatch.undo()
    assert mode(victim) == 0o755 and mode(tmp_path / "moved") == 0o700


@pytest.mark.parametrize("kind", ["symlink", "file"])
def test_a_private_dir_path_taken_by_something_else_is_refused(kind, tmp_path):
    path = tmp_path / "wd-lsp"
    if kind == "symlink":
        (tmp_path / "real").mkdir(mode=0o700)
        path.symlink_to(tmp_path / "real")
    else:
        path.write_text("x")
    with pytest.raises(paths.UnsafeRuntimeDir, match=str(path)):
        paths.ensure_private_dir(path)
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    with pytest.raises(paths.UnsafeRuntimeDir):
        paths.ensure_private_dir(dangling)
    assert not (tmp_path / "nowhere").exists()


def test_spawning_never_logs_through_a_symlink(run_dir, tmp_path, no_popen):
    log = paths.log_path()
    (tmp_path / "target").write_text("precious\n")
    log.symlink_to(tmp_path / "target")
    with pytest.raises(SpawnFailed, match="symbolic link"):
        C.spawn_daemon(run_dir / "engine.sock", SpawnConfig(), lambda message: None)
    assert no_popen == [] and (tmp_path / "target").read_text() == "precious\n"


def test_a_spawned_engine_logs_to_a_private_file(run_dir, monkeypatch):
    class Exited:
        returncode = 3

        def poll(self):
            return 3

    opened = []

    def popen(command, stdout, **kw):
        opened.append(os.fstat(stdout.fileno()))
        return Exited()

    monkeypatch.setattr(C.subprocess, "Popen", popen)
    with pytest.raises(SpawnFailed, match="exited with code 3"):
        C.spawn_daemon(run_dir / "engine.sock", SpawnConfig(), lambda message: None)
    log = paths.log_path()
    assert mode(log) == 0o600 and mode(log.parent) == 0o700
    assert opened and opened[0].st_ino == os.stat(log).st_ino
    # The spawn lock is released with the failed start: the next starter takes it at once.
    fd = os.open(C.spawn_lock_path(run_dir / "engine.sock"), os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)
    assert mode(C.spawn_lock_path(run_dir / "engine.sock")) == 0o600


def test_the_ipc_package_imports_neither_torch_nor_the_rest_of_the_engine():
    """Clients (the language server) load engine.ipc alone: no torch, and nothing of the engine
    outside the package."""
    ipc = Path(__file__).resolve().parents[2] / "engine" / "ipc"
    modules = sorted(f"engine.ipc.{f.stem}" for f in ipc.glob("*.py") if f.stem != "__init__")
    assert {"engine.ipc.client", "engine.ipc.protocol", "engine.ipc.socket_path"} <= set(modules)
    code = (
        "import sys\n"
        f"for m in {modules!r}:\n"
        "    __import__(m)\n"
        "outside = [m for m in sys.modules if m.startswith('engine.')\n"
        "           and not m.startswith('engine.ipc')]\n"
        "heavy = [m for m in ('torch', 'numpy', 'triton') if m in sys.modules]\n"
        "assert not outside and not heavy, (outside, heavy)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_features_come_from_the_hello_and_an_older_engine_offers_none(tmp_path):
    """What a client may send beyond the base protocol is read from the engine's hello: an
    engine whose hello lists no features (an older daemon) offers none of them."""
    client = EngineClient(socket_path=tmp_path / "engine.sock")
    assert not client.offers(P.FEATURE_BEAMS)  # not connected: no hello yet
    for hello, offered in (
        ({"model": {"name": "m"}}, False),  # an engine from before features were listed
        ({"features": "beams"}, False),  # not a list: nothing is taken on trust
        ({"features": []}, False),
        ({"features": list(P.FEATURES)}, True),
    ):
        client.server_info = hello
        assert client.offers(P.FEATURE_BEAMS) is offered
