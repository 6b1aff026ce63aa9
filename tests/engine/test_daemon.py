"""The engine daemon as real processes: spawning, sharing, streaming, crashes, bad input and
security."""

import asyncio
import os
import signal
import socket
import stat
import struct
import subprocess
import time

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.ipc import protocol as P
from engine.ipc.client import EngineClient, EngineError, EngineUnavailable, SpawnConfig
from engine.ipc.protocol import ErrorCode

FIM = {"prefix": "def add(a, b):\n    return ", "suffix": "\n\nprint(add(1, 2))\n"}


@pytest.fixture
def daemon_env(checkpoint_factory, tmp_path, monkeypatch):
    """A private runtime dir per test; kills whatever engine it left behind."""
    model = checkpoint_factory()
    monkeypatch.setenv("WD_ENGINE_DIR", str(tmp_path / "run"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    env = dict(model=str(model), sock=tmp_path / "run" / "engine.sock", pids=set())
    yield env
    for pid in env["pids"]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def make_client(env, *extra, **kw):
    return EngineClient(
        spawn=SpawnConfig(model=env["model"], extra_args=["--idle-timeout", "120", *extra]), **kw
    )


async def connect(env, client):
    info = await client.connect()
    env["pids"].add(info["pid"])
    return info


async def collect(client, params):
    stream = await client.complete(params)
    text = "".join([d async for d in stream])
    return text, stream.result


async def test_two_clients_share_one_spawned_daemon(daemon_env):
    a, b = make_client(daemon_env), make_client(daemon_env)
    info_a, info_b = await asyncio.gather(connect(daemon_env, a), connect(daemon_env, b))
    assert info_a["pid"] == info_b["pid"]
    # The hello lists what this engine takes beyond the base protocol: clients send beams on it.
    assert info_a["features"] == list(P.FEATURES) and a.offers(P.FEATURE_BEAMS)
    health = await b.request("health")
    assert health["clients"] == 2
    for c in (a, b):
        text, result = await collect(c, dict(FIM, max_tokens=6))
        assert result["finish_reason"] in ("length", "eos", "stop")
    _, result = await collect(a, dict(FIM, max_tokens=6, beams=2, stop=["\n"]))
    assert result["finish_reason"] in ("length", "eos", "stop")
    await a.close()
    await b.close()


async def test_socket_and_directory_are_owner_only(daemon_env):
    client = make_client(daemon_env)
    await connect(daemon_env, client)
    sock = daemon_env["sock"]
    assert stat.S_ISSOCK(sock.stat().st_mode)
    assert stat.S_IMODE(sock.stat().st_mode) == 0o600
    assert stat.S_IMODE(sock.parent.stat().st_mode) == 0o700
    await client.close()


async def test_32_concurrent_clients_stream_completions(daemon_env):
    first = make_client(daemon_env)
    await connect(daemon_env, first)
    clients = [make_client(daemon_env) for _ in range(32)]

    async def one(i, c):
        params = dict(
            FIM, prefix=f"def f{i}(x):\n    return ", max_tokens=8, temperature=0.5, seed=i
        )
        return await collect(c, params)

    results = await asyncio.gather(*(one(i, c) for i, c in enumerate(clients)))
    assert all(r["finish_reason"] in ("length", "eos", "stop") for _, r in results)
    assert sum(r["usage"]["completion_tokens"] for _, r in results) > 32
    stats = await first.request("stats")
    assert stats["completed"] >= 32 and stats["failed"] == 0 and stats["blocks_used"] == 0
    for c in clients + [first]:
        await c.close()


async def test_kill_9_mid_stream_gives_a_clean_error_and_the_next_request_respawns(daemon_env):
    client = make_client(daemon_env)
    info = await connect(daemon_env, client)
    stream = await client.complete(
        {"prompt": "x = 1\n" * 20, "max_tokens": 400, "temperature": 1.0, "seed": 1}
    )
    with pytest.raises(EngineUnavailable):
        async for _ in stream:
            os.kill(info["pid"], signal.SIGKILL)
    text, result = await collect(client, dict(FIM, max_tokens=4))
    new_pid = (await client.request("health"))["pid"]
    daemon_env["pids"].add(new_pid)
    assert new_pid != info["pid"] and result["finish_reason"]
    await client.close()


async def test_bad_parameters_get_errors_and_the_connection_lives(daemon_env):
    client = make_client(daemon_env)
    await connect(daemon_env, client)
    for params in (
        {},
        {"prefix": 3},
        {"prefix": "a", "max_tokens": -1},
        {"prefix": "a", "bogus": 1},
        {"prefix": "a", "top_p": 0},
        {"prefix": "a", "stop": "x"},
    ):
        with pytest.raises(EngineError) as err:
            await collect(client, params)
        assert err.value.code == ErrorCode.BAD_REQUEST
    with pytest.raises(EngineError, match="unknown method"):
        await client.request("explode")
    assert (await client.request("health"))["ok"]
    await client.close()


def _raw_exchange(path, payload: bytes, hello_first: bool) -> None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(2)
    try:
        s.connect(str(path))
        if hello_first:
            s.sendall(
                P.encode_frame(
                    {"id": 0, "method": "hello", "params": {"version": P.PROTOCOL_VERSION}}
                )
            )
        s.sendall(payload)
        s.shutdown(socket.SHUT_WR)
        while s.recv(65536):
            pass
    except OSError:
        pass
    finally:
        s.close()


msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
requests_maps = st.fixed_dictionaries(
    {
        "id": st.integers(0, 9) | st.text(max_size=3) | st.none(),
        "method": st.sampled_from(list(P.METHODS[1:4]) + ["x"]),
        "params": msgpack_values,
    },
)
frames = st.one_of(
    st.binary(max_size=64),  # garbage, often a huge length prefix
    msgpack_values.map(lambda v: P.HEADER.pack(len(b := msgpack.packb(v))) + b),
    requests_maps.map(lambda v: P.HEADER.pack(len(b := msgpack.packb(v))) + b),
    st.integers(P.MAX_FRAME_BYTES + 1, 2**32 - 1).map(lambda n: struct.pack(">I", n)),
)


def test_fuzzed_frames_leave_the_daemon_answering_health(daemon_env):
    client = make_client(daemon_env)
    pid = asyncio.run(connect(daemon_env, client))["pid"]
    asyncio.run(client.close())
    cases = []

    @settings(max_examples=1000, deadline=None, suppress_health_check=list(HealthCheck))
    @given(payload=frames, hello_first=st.booleans())
    def fuzz(payload, hello_first):
        cases.append(1)
        _raw_exchange(daemon_env["sock"], payload, hello_first)

    fuzz()
    assert len(cases) >= 1000

    async def check():
        probe = make_client(daemon_env)
        health = await probe.request("health")
        text, result = await collect(probe, dict(FIM, max_tokens=4))
        await probe.close()
        return health, result

    health, result = asyncio.run(check())
    assert health["ok"] and health["pid"] == pid and result["finish_reason"]


async def test_tcp_needs_the_token_and_binds_loopback(daemon_env, monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("WD_ENGINE_TOKEN", "s3cret-token")
    owner = make_client(daemon_env, "--tcp-port", str(port))
    await connect(daemon_env, owner)
    for token in (None, "wrong"):
        intruder = EngineClient(tcp=("127.0.0.1", port), token=token)
        with pytest.raises((EngineError, EngineUnavailable)) as err:
            await intruder.request("health")
        if isinstance(err.value, EngineError):
            assert err.value.code == ErrorCode.UNAUTHORIZED
        await intruder.close()
    friend = EngineClient(tcp=("127.0.0.1", port), token="s3cret-token")
    assert (await friend.request("health"))["ok"]
    await friend.close()
    out = (
        subprocess.run(["ss", "-ltnH"], capture_output=True, text=True).stdout if _has("ss") else ""
    )
    if out:
        listening = [line for line in out.splitlines() if f":{port} " in line + " "]
        assert listening and all("127.0.0.1" in line for line in listening)
    await owner.close()


def _has(tool):
    return any(
        os.access(os.path.join(p, tool), os.X_OK)
        for p in os.environ.get("PATH", "").split(os.pathsep)
    )


async def test_sigterm_drains_and_idle_timeout_exits(daemon_env):
    client = EngineClient(
        spawn=SpawnConfig(model=daemon_env["model"], extra_args=["--idle-timeout", "1"])
    )
    info = await connect(daemon_env, client)
    stream = await client.complete(dict(FIM, max_tokens=30, temperature=1.0, seed=2))
    os.kill(info["pid"], signal.SIGTERM)
    async for _ in stream:  # the running request finishes
        pass
    assert stream.result["finish_reason"] in ("length", "eos", "stop")
    await client.close()
    _wait_gone(info["pid"])
    assert not daemon_env["sock"].exists()

    idle = EngineClient(
        spawn=SpawnConfig(model=daemon_env["model"], extra_args=["--idle-timeout", "1"])
    )
    info = await connect(daemon_env, idle)
    await idle.close()
    _wait_gone(info["pid"], timeout=15)
    assert not daemon_env["sock"].exists()


async def test_stale_socket_is_replaced(daemon_env):
    sock_path = daemon_env["sock"]
    sock_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(sock_path))
    stale.close()  # the file stays, nobody listens: what a crash leaves
    client = make_client(daemon_env)
    await connect(daemon_env, client)
    assert (await client.request("health"))["ok"]
    await client.close()


def _wait_gone(pid, timeout=10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        try:  # reap it if it is our child
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"engine {pid} still running after {timeout} s")


async def test_cancel_with_a_bad_id_is_an_error_not_a_closed_connection(daemon_env):
    client = make_client(daemon_env)
    await connect(daemon_env, client)
    with pytest.raises(EngineError) as err:
        await client.request("cancel", {"id": [1, 2]})
    assert err.value.code == ErrorCode.BAD_REQUEST
    assert (await client.request("health"))["ok"]
    await client.close()


def test_a_draining_daemon_leaves_its_successors_socket_alone(tmp_path):
    from engine.ipc.socket_path import remove_own_socket

    path = tmp_path / "engine.sock"
    old = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old.bind(str(path))
    old_identity = (path.stat().st_dev, path.stat().st_ino)
    path.unlink()  # a successor cleaned the stale file and bound its own
    new = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    new.bind(str(path))
    remove_own_socket(path, old_identity)
    assert path.exists()
    remove_own_socket(path, (path.stat().st_dev, path.stat().st_ino))
    assert not path.exists()
    old.close()
    new.close()


async def test_speculative_decoding_is_on_by_default_and_the_flag_turns_it_off(daemon_env):
    for extra, expected in (((), True), (("--no-speculative",), False)):
        client = make_client(daemon_env, *extra)
        info = await connect(daemon_env, client)
        await collect(client, dict(FIM, max_tokens=8))
        stats = await client.request("stats")
        assert stats["speculative"] is expected
        if not expected:
            assert stats["draft_tokens"] == 0
        await client.close()
        os.kill(
            info["pid"], signal.SIGTERM
        )  # the next spawn must start a daemon with its own flags
        _wait_gone(info["pid"])
