"""Engine faults seen from the editor: every wait on the engine is bounded. A stopped engine, a
spawn lock held by another editor, something that is not a socket at the socket path: each gives
empty completions within the request timeout and one logged reason, and the server recovers once
the fault is gone. Real processes (the language server, the engine daemon with the embedded model);
the link's own policies (backoff, shared connect, guard, what it sends on which connection) also
with stand-in clients and a stand-in engine."""

import asyncio
import itertools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from lsprotocol import types as T
from pytest_lsp import ClientServerConfig

from engine.ipc import protocol as P
from engine.ipc.client import (
    LOCK_HELD_MESSAGE,
    EngineClient,
    EngineError,
    EngineStarting,
    EngineTimeout,
    EngineUnavailable,
    SpawnFailed,
    spawn_lock_path,
)
from engine.models import default_model_dir
from wd_lsp import engine_link
from wd_lsp.config import Settings, merge_settings
from wd_lsp.engine_link import EngineLink
from wd_lsp.shape import StopRules

TIMEOUT_MS = 1500
GUARD_S = (
    TIMEOUT_MS / 1000 + engine_link.CLIENT_GRACE_S
)  # the longest a completion waits on the engine
# What a completion from a stuck engine may take, with room for the LSP round trip on a loaded
# machine: still far below the 10 s default timeout.
BOUND_S = GUARD_S + 3.0
PY = (
    "import os\n\n\ndef list_files(root):\n    return sorted(os.listdir(root))\n\n\n"
    "def main():\n    "
)
DOC_NUMBERS = itertools.count()
CAPS = T.ClientCapabilities(
    text_document=T.TextDocumentClientCapabilities(
        inline_completion=T.InlineCompletionClientCapabilities(),
        synchronization=T.TextDocumentSyncClientCapabilities(),
    ),
    window=T.WindowClientCapabilities(work_done_progress=True),
)


@pytest.fixture
def env(tmp_path):
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    environment = dict(
        os.environ,
        WD_ENGINE_DIR=str(run),
        XDG_STATE_HOME=str(tmp_path / "state"),
        WD_LSP_MODEL=str(default_model_dir()),
        WD_ENGINE_IDLE_TIMEOUT="30",
    )
    yield SimpleNamespace(
        vars=environment,
        run=run,
        sock=run / "engine.sock",
        log=tmp_path / "state" / "wd-lsp" / "engine.log",
    )
    asyncio.run(_stop_engine(environment))


@pytest.fixture
async def start_lsp(env):
    clients = []

    async def start():
        client = await ClientServerConfig(
            server_command=[sys.executable, "-m", "wd_lsp"], server_env=env.vars
        ).start()
        clients.append(client)
        await client.initialize_session(
            T.InitializeParams(
                capabilities=CAPS,
                root_uri="file:///project",
                initialization_options={
                    "debounceMs": 0,
                    "maxTokens": 16,
                    "requestTimeoutMs": TIMEOUT_MS,
                },
            )
        )
        return client

    yield start
    for client in clients:
        await client.shutdown_session()


def engine_at(environment, **kw) -> EngineClient:
    """A client of the engine the servers under test use (it never starts one)."""
    return EngineClient(socket_path=Path(environment["WD_ENGINE_DIR"]) / "engine.sock", **kw)


async def _stop_engine(environment):
    try:
        engine = engine_at(environment, connect_timeout_s=2.0)
        await engine.request("shutdown", timeout=2.0)
        await engine.close()
    except Exception:  # noqa: BLE001 - already gone, or never started
        pass


async def engine_pid(environment) -> int:
    engine = engine_at(environment)
    pid = (await engine.request("health", timeout=5.0))["pid"]
    await engine.close()
    return pid


async def timed_inline(client):
    """A completion at the end of a fresh document: never answered from a remembered suggestion."""
    uri = f"file:///project/faults{next(DOC_NUMBERS)}.py"
    client.text_document_did_open(
        T.DidOpenTextDocumentParams(
            text_document=T.TextDocumentItem(uri=uri, language_id="python", version=1, text=PY)
        )
    )
    lines = PY.split("\n")
    started = time.monotonic()
    result = await client.text_document_inline_completion_async(
        T.InlineCompletionParams(
            text_document=T.TextDocumentIdentifier(uri=uri),
            position=T.Position(line=len(lines) - 1, character=len(lines[-1])),
            context=T.InlineCompletionContext(trigger_kind=T.InlineCompletionTriggerKind.Automatic),
        )
    )
    return result.items, time.monotonic() - started


async def status(client):
    return await client.workspace_execute_command_async(
        T.ExecuteCommandParams(command="wdLsp.status")
    )


async def wait_ready(client, limit_s=90.0):
    deadline = time.monotonic() + limit_s  # the engine imports torch and loads the model
    while time.monotonic() < deadline:
        if (await status(client))["engine"] == "ready":
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"the engine was not ready within {limit_s:.0f} s")


async def answers_normally(client, attempts=5) -> bool:
    """A completion that reached the engine and came back without an error."""
    for _ in range(attempts):
        before = await status(client)
        await timed_inline(client)
        after = await status(client)
        if after["engine_calls"] > before["engine_calls"] and after["errors"] == before["errors"]:
            return True
    return False


def logged(client, text):
    return [m.message for m in client.log_messages if text in m.message]


async def test_a_stopped_engine_gives_empty_completions_and_status_in_bounded_time(env, start_lsp):
    lsp = await start_lsp()
    await wait_ready(lsp)
    assert await answers_normally(lsp)
    pid = await engine_pid(env.vars)
    # The engine's log: 0600 in a 0700 directory.
    assert (
        os.stat(env.log).st_mode & 0o777 == 0o600
        and os.stat(env.log.parent).st_mode & 0o777 == 0o700
    )
    os.kill(pid, signal.SIGSTOP)
    try:
        for _ in range(2):  # the second finds the engine still stopped, and is bounded the same
            items, took = await timed_inline(lsp)
            print(f"completion from a stopped engine: {took:.2f} s")
            assert not items and took < BOUND_S
        started = time.monotonic()
        s = await status(lsp)
        print(f"status with a stopped engine: {time.monotonic() - started:.2f} s")
        assert time.monotonic() - started < engine_link.STATS_TIMEOUT_S + 3.0
        assert s["engine"] == "error" and s["engineStats"] == {}
        assert len(logged(lsp, "did not answer within")) == 1  # once, not per keystroke
    finally:
        os.kill(pid, signal.SIGCONT)
    assert await answers_normally(lsp)
    assert (await status(lsp))["engine"] == "ready"
    assert await engine_pid(env.vars) == pid  # the same engine: a stopped one is not replaced


async def test_a_held_spawn_lock_gives_empty_completions_until_its_holder_lets_go(env, start_lsp):
    hold = (
        "import fcntl, sys; f = open(sys.argv[1], 'a'); fcntl.flock(f, fcntl.LOCK_EX); "
        "print('held', flush=True); sys.stdin.read()"
    )  # until its stdin closes
    holder = subprocess.Popen(
        [sys.executable, "-c", hold, str(spawn_lock_path(env.sock))],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        lsp = await start_lsp()
        for _ in range(2):
            items, took = await timed_inline(lsp)
            print(f"completion while another process holds the spawn lock: {took:.2f} s")
            assert not items and took < BOUND_S
        assert len(logged(lsp, LOCK_HELD_MESSAGE)) == 1
        assert not env.log.exists()  # nothing was started meanwhile
    finally:
        holder.stdin.close()  # the holder exits: its lock goes with it
        holder.wait(10)
    await wait_ready(lsp)  # the waiting server starts the engine itself
    assert await answers_normally(lsp)


@pytest.mark.parametrize("kind", ["file", "dir", "symlink"])
async def test_something_else_at_the_socket_path_is_named_and_left_alone(
    kind, env, start_lsp, tmp_path
):
    target = tmp_path / "precious.txt"
    target.write_text("keep me\n")
    if kind == "file":
        env.sock.write_text("keep me\n")
    elif kind == "dir":
        env.sock.mkdir()
        (env.sock / "inside.txt").write_text("keep me\n")
    else:
        env.sock.symlink_to(target)
    inode = os.lstat(env.sock).st_ino
    lsp = await start_lsp()
    for _ in range(4):
        items, took = await timed_inline(lsp)
        assert not items and took < BOUND_S
    s = await status(lsp)
    assert s["engine"] == "error" and s["errors"] >= 4
    errors = [m.message for m in lsp.log_messages if m.type == T.MessageType.Error]
    assert len(errors) == 1 and str(env.sock) in errors[0], errors  # said once, naming the path
    assert os.lstat(env.sock).st_ino == inode and target.read_text() == "keep me\n"
    if kind == "file":
        assert env.sock.read_text() == "keep me\n"
    elif kind == "dir":
        assert (env.sock / "inside.txt").read_text() == "keep me\n"
    else:
        assert os.readlink(env.sock) == str(target)
    assert not env.log.exists()  # no engine was ever started: none could bind the path


# -- the link's policies, with stand-in clients -----------------------------------------------
CTX = SimpleNamespace(prefix="def f():\n    ", suffix="\n", path="/p/a.py", chunks=())
RULES = StopRules(multiline=True, max_lines=4)


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def make_link(monkeypatch, client_factory, **settings) -> tuple[EngineLink, list]:
    states = []
    link = EngineLink(lambda state, message: states.append((state, message)), lambda message: None)
    link.configure(merge_settings(Settings(), settings))
    monkeypatch.setattr(link, "_make_client", client_factory)

    async def no_background_restart():
        pass

    monkeypatch.setattr(link, "_restart_soon", no_background_restart)
    return link, states


async def test_a_failed_spawn_backs_off_and_requests_are_answered_at_once(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(engine_link, "_now", clock)
    attempts = []

    class NeverStarts:
        connected = False

        async def connect(self):
            attempts.append(clock.now)
            raise SpawnFailed("the engine exited with code 1 while starting")

        def disconnect(self):
            pass

    link, states = make_link(monkeypatch, NeverStarts)
    with pytest.raises(SpawnFailed):
        await link.ensure_connected()
    for _ in range(20):  # keystrokes during the backoff: no new spawn, an answer at once
        with pytest.raises(EngineUnavailable, match="not trying again"):
            await link.ensure_connected()
    assert len(attempts) == 1
    for step in (1.0, 2.0, 4.0, 8.0):  # each failure doubles the wait
        clock.now += step - 0.01
        with pytest.raises(EngineUnavailable, match="not trying again"):
            await link.ensure_connected()
        clock.now += 0.01
        with pytest.raises(SpawnFailed):
            await link.ensure_connected()
    assert len(attempts) == 5
    for _ in range(2):
        clock.now += 3600
        with pytest.raises(SpawnFailed):
            await link.ensure_connected()
    assert link._backoff_s == engine_link.BACKOFF_MAX_S  # capped
    assert [s for s, _ in states].count("error") == 1  # the same reason is said once


async def test_a_slow_start_is_waited_for_within_a_bound_and_connected_once(monkeypatch):
    loaded = asyncio.Event()
    attempts = []

    class Loading:
        connected = False

        async def connect(self):
            attempts.append(1)
            link._progress("loading the model (3 s)")
            await loaded.wait()
            self.connected = True
            return {"model": {"name": "tiny"}}

        def disconnect(self):
            pass

    link, states = make_link(monkeypatch, Loading)
    for _ in range(3):
        with pytest.raises(EngineStarting, match="loading the model"):
            await link.ensure_connected(wait_s=0.05)
    assert link.state == "starting" and len(attempts) == 1  # one connect, shared by every caller
    loaded.set()
    client = await link.ensure_connected(wait_s=1.0)
    assert client.connected and link.state == "ready" and len(attempts) == 1
    starting = [m for s, m in states if s == "starting" and "completions are empty" in m]
    assert len(starting) == 1


async def test_a_guard_timeout_sends_the_cancel_without_waiting_for_it(monkeypatch):
    cancels = []

    class Hung:
        result = None

        def __aiter__(self):
            return self

        async def __anext__(self):
            await asyncio.Event().wait()

        async def cancel(self):
            cancels.append(1)
            await asyncio.Event().wait()  # a stopped engine never acknowledges

    class Answers:
        result = {"finish_reason": "stop"}

        async def __aiter__(self):
            yield "x = 1"

    class Client:
        connected = True
        hung = True

        async def complete(self, params, reconnect=True):
            return Hung() if self.hung else Answers()

        def disconnect(self):
            self.connected = False

    client = Client()
    monkeypatch.setattr(engine_link, "CLIENT_GRACE_S", 0.1)
    link, states = make_link(monkeypatch, lambda: client, requestTimeoutMs=100)
    link.client = client
    for _ in range(2):
        with pytest.raises(EngineTimeout):
            await link.complete(CTX, RULES, "doc")
    await asyncio.sleep(0)
    assert len(cancels) == 2  # sent in the background, never awaited
    assert [s for s, _ in states] == ["error"]  # said once
    client.hung = False
    assert (await link.complete(CTX, RULES, "doc")).text == "x = 1"
    assert link.state == "ready"
    # The cancels an engine never acknowledges go with the connection, not with the process.
    unanswered = list(link._background)
    assert len(unanswered) == 2
    link.disconnect()
    async with asyncio.timeout(5):
        await asyncio.gather(*unanswered, return_exceptions=True)
    assert all(task.cancelled() for task in unanswered) and not link._background


async def test_while_the_model_loads_only_the_first_request_waits_the_timeout(monkeypatch):
    """Clients that wait for the completion before showing their menu must not hang on every
    keystroke while a big model loads; a model that loads within the timeout answers at once."""
    load_s = [0.3]
    loaded = asyncio.Event()

    class Loading:
        connected = False

        async def connect(self):
            link._progress("loading the model (1 s)")
            try:
                async with asyncio.timeout(load_s[0]):
                    await loaded.wait()
            except TimeoutError:
                pass
            self.connected = True
            return {"model": {"name": "tiny"}}

        def disconnect(self):
            self.connected = False

    link, states = make_link(monkeypatch, Loading, requestTimeoutMs=1000)
    assert (
        await link.ensure_connected()
    ).connected  # loads within the timeout: the first one waits
    link.disconnect()
    load_s[0] = 3600.0
    started = time.monotonic()
    with pytest.raises(EngineStarting, match="loading the model"):
        await link.ensure_connected()
    assert time.monotonic() - started >= 0.9  # the first request waits the whole timeout
    for _ in range(5):  # later ones only glance at the loading engine
        started = time.monotonic()
        with pytest.raises(EngineStarting, match="loading the model"):
            await link.complete(CTX, RULES, "doc")
        assert time.monotonic() - started < 0.6
    loaded.set()
    assert (await link.ensure_connected(wait_s=5.0)).connected and link.state == "ready"
    link.disconnect()


class StandInEngine:
    """A Unix socket that answers like an engine: the hello always, the rest only while
    `answering` (a delta and a result for `complete`, an empty result otherwise). Records frames."""

    def __init__(self, path: Path):
        self.path, self.frames, self.answering = path, [], True

    async def __aenter__(self):
        self.server = await asyncio.start_unix_server(self._serve, path=str(self.path))
        return self

    async def __aexit__(self, *exc):
        self.server.close()

    async def _serve(self, reader, writer):
        try:
            while (frame := await P.read_frame(reader)) is not None:
                self.frames.append(frame)
                for answer in self._answers(frame):
                    writer.write(P.encode_frame(answer))
                await writer.drain()
        except (
            ConnectionError,
            P.FrameError,
            asyncio.CancelledError,
        ):  # cancelled: the test is over
            pass
        finally:
            writer.close()

    def _answers(self, frame: dict) -> list[dict]:
        if frame["method"] == "hello":
            return [{"id": frame["id"], "result": {"model": {"name": "stand-in"}}}]
        if not self.answering:
            return []
        if frame["method"] == "complete":
            return [{"id": frame["id"], "delta": "x = 1"}, {"id": frame["id"], "result": {}}]
        return [{"id": frame["id"], "result": {}}]


def stand_in_link(path: Path, timeout_ms: int = 300) -> EngineLink:
    link = EngineLink(lambda state, message: None, lambda message: None)
    link.configure(
        merge_settings(
            Settings(),
            {"engine": {"socket": str(path), "autoStart": False}, "requestTimeoutMs": timeout_ms},
        )
    )
    return link


async def test_warm_and_stats_on_a_silent_engine_raise_engine_timeout(tmp_path):
    async with StandInEngine(tmp_path / "engine.sock") as engine:
        link = stand_in_link(engine.path)
        await link.ensure_connected()
        engine.answering = False
        for call, bound_s in (
            (link.warm(CTX, "doc"), 0.3),
            (link.stats(), engine_link.STATS_TIMEOUT_S),
        ):
            started = time.monotonic()
            with pytest.raises(
                EngineTimeout
            ):  # what the server's handlers catch: no stray TimeoutError
                await call
            assert time.monotonic() - started < bound_s + 3.0
        assert link.client.connected  # a slow answer is no lost connection
        link.disconnect()


async def test_a_lone_surrogate_in_the_document_uri_still_completes(tmp_path):
    async with StandInEngine(tmp_path / "engine.sock") as engine:
        link = stand_in_link(engine.path, timeout_ms=5000)
        key = "inst:file:///p/caf\udce9.py"
        assert (await link.complete(CTX, RULES, key)).text == "x = 1"
        await link.warm(CTX, key)
        sent = [f["params"]["client"] for f in engine.frames if f["method"] in ("complete", "warm")]
        assert sent == ["inst:file:///p/caf\ufffd.py"] * 2
        link.disconnect()


async def test_an_unsendable_request_is_an_error_and_keeps_the_connection(tmp_path):
    async with StandInEngine(tmp_path / "engine.sock") as engine:
        client = EngineClient(socket_path=engine.path)
        await client.connect()
        with pytest.raises(EngineError, match="cannot be encoded"):
            await client.complete({"prefix": "\ud800", "suffix": ""})
        with pytest.raises(EngineError, match="limit"):
            await client.request("warm", {"prefix": "x" * (P.MAX_FRAME_BYTES + 1)})
        assert client.connected and client._pending == {}
        assert await client.request("stats") == {}
        await client.close()


class Recording:
    """A stand-in client that records each call and whether it was allowed to reconnect."""

    def __init__(self, calls: list, connect_gate: asyncio.Event | None = None):
        self.calls, self.gate, self.connected, self.dropped = calls, connect_gate, False, False

    async def connect(self):
        self.calls.append((self, "connect"))
        if self.gate is not None:
            await self.gate.wait()
        self.connected = True
        return {"model": {"name": "tiny"}}

    async def complete(self, params, reconnect=True):
        self.calls.append((self, "complete", reconnect))
        return Answer()

    async def request(self, method, params=None, timeout=None, reconnect=True):
        self.calls.append((self, method, reconnect))
        return {}

    async def warm(self, params, timeout=None, reconnect=True):
        self.calls.append((self, "warm", reconnect))
        return {}

    def disconnect(self):
        self.connected, self.dropped = False, True

    async def close(self):
        self.disconnect()


class Answer:
    result = {}

    async def __aiter__(self):
        yield "x = 1"


async def test_only_the_shared_connect_task_connects(monkeypatch):
    calls = []
    link, _ = make_link(monkeypatch, lambda: Recording(calls))
    await link.ensure_connected()
    await link.complete(CTX, RULES, "doc")
    await link.warm(CTX, "doc")
    await link.stats()
    await link.restart()
    assert [call[1:] for call in calls] == [
        ("connect",),
        ("complete", False),
        ("warm", False),
        ("stats", False),
        ("shutdown", False),
        ("connect",),
    ]


async def test_a_failure_on_a_replaced_client_leaves_the_new_one_alone(monkeypatch):
    calls, gate, clients = [], asyncio.Event(), []

    def make():
        clients.append(Recording(calls, gate if clients else None))
        return clients[-1]

    link, states = make_link(monkeypatch, make)
    old = await link.ensure_connected()
    deaths = [asyncio.Event() for _ in range(3)]

    class Dies:
        result = None

        def __init__(self, death: asyncio.Event):
            self.death = death

        def __aiter__(self):
            return self

        async def __anext__(self):
            await self.death.wait()
            raise EngineUnavailable("the engine closed the connection")

    async def dying_complete(params, reconnect=True):
        return Dies(deaths[len(streams) - 1])

    streams = []
    old.complete = lambda params, reconnect=True: streams.append(1) or dying_complete(params)

    async def completion_on_old():
        task = asyncio.ensure_future(link.complete(CTX, RULES, "doc"))
        await asyncio.sleep(0.01)  # it waits for the engine's answer on the old connection
        return task

    first, second, third = [await completion_on_old() for _ in range(3)]
    deaths[0].set()  # the old connection dies: the link drops it
    with pytest.raises(EngineUnavailable):
        await first
    assert link.client is None and old.dropped
    with pytest.raises(EngineStarting):  # a new client starts connecting
        await link.ensure_connected(wait_s=0.01)
    new = link.client
    assert new is not old and not link._connect_task.done()
    deaths[1].set()  # another completion on the old connection fails only now
    with pytest.raises(EngineUnavailable):
        await second
    assert link.client is new and not new.dropped
    gate.set()
    assert await link.ensure_connected(wait_s=1.0) is new and link.state == "ready"
    deaths[2].set()  # and once the new one is connected, old news does not touch it either
    with pytest.raises(EngineUnavailable):
        await third
    assert link.client is new and not new.dropped and link.state == "ready"
    link.disconnect()


async def test_disconnect_cancels_a_scheduled_reconnect(monkeypatch):
    connects = []

    class Refused:
        connected = False

        async def connect(self):
            connects.append(1)
            raise EngineUnavailable("no engine at the socket")

        def disconnect(self):
            pass

    link = EngineLink(lambda state, message: None, lambda message: None)
    link.configure(merge_settings(Settings(), {}))
    monkeypatch.setattr(link, "_make_client", Refused)
    with pytest.raises(EngineUnavailable):
        await link.ensure_connected()
    restart = link._restart_task
    assert restart is not None and not restart.done()  # a reconnect is scheduled
    link.disconnect()  # as `shutdown` and `exit` do
    await asyncio.sleep(engine_link.RESTART_DELAY_S + 0.5)
    assert restart.cancelled() and len(connects) == 1
