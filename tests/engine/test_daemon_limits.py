"""The daemon under hostile clients: floods, peers that never read, huge prompts, a cancel in the
same write as its request, silent connections, and things planted at the socket's path.

Daemons run as real processes on the embedded model (no transformers import), started with
`ServeOptions` chosen per test; their memory is read from /proc. The scheduler's share-out is
also driven step by step in process. Time bounds are generous and stated where they are set.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import msgpack
import pytest

from engine.ipc import protocol as P
from engine.ipc.client import EngineClient, EngineError
from engine.ipc.protocol import ErrorCode
from engine.models import default_model_dir

REPO = Path(__file__).resolve().parents[2]
FIM = {"prefix": "def add(a, b):\n    return ", "suffix": "\n\nprint(add(1, 2))\n"}

# Fairness bound: with a flooder and a never-reading client busy, another client's 8-token
# completion must finish within this many seconds. Generous, for a loaded CI machine where every
# decode step also carries their 32 streams; without the limits it waited behind the flood's
# thousands of requests (BENCHMARKS.md, "Daemon under hostile clients").
FAIR_BOUND_S = 20.0
# Memory bound: an 8 MB prompt may move the daemon's RSS by this much at most, a fraction of what
# tokenizing it whole would hold.
RSS_BOUND_MB = 300

LAUNCH = """
import asyncio, json, sys
from pathlib import Path
from engine.loading.loader import load_model
from engine.models import default_model_dir
from engine.core.engine import Engine
from engine.serve.daemon import EngineServer, ServeOptions
from engine.loading.tokenizer import Tokenizer
options = json.loads(sys.argv[1])
options["socket_path"] = Path(options["socket_path"])
model_dir = default_model_dir()
model = load_model(model_dir)
tokenizer = Tokenizer.from_dir(model_dir, extra_eos_ids=model.config.eos_token_ids)
asyncio.run(EngineServer(Engine(model, tokenizer), model_dir, ServeOptions(**options)).serve())
"""


class Daemon(SimpleNamespace):
    def rss_mb(self) -> float:
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise AssertionError("no VmRSS")

    def client(self) -> EngineClient:
        return EngineClient(socket_path=self.socket)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(10)


def start_daemon(tmp: Path, **options) -> Daemon:
    sock = tmp / "run" / "engine.sock"
    sock.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    env = dict(os.environ, WD_ENGINE_DIR=str(sock.parent))
    options = dict(dict(idle_timeout_s=120.0), **options, socket_path=str(sock))
    log = open(tmp / "daemon.log", "wb")
    process = subprocess.Popen(
        [sys.executable, "-c", LAUNCH, json.dumps(options)],
        cwd=REPO,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    daemon = Daemon(process=process, socket=sock, log=tmp / "daemon.log")
    deadline = time.monotonic() + 120
    while not _listening(sock):
        if process.poll() is not None or time.monotonic() > deadline:
            daemon.stop()
            raise RuntimeError(f"daemon did not start: {daemon.log.read_text()}")
        time.sleep(0.05)
    return daemon


def _listening(path: Path) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
        return True
    except OSError:
        return False
    finally:
        probe.close()


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    daemon = start_daemon(tmp_path_factory.mktemp("shared"))
    yield daemon
    daemon.stop()


def frame(rid, method: str, params: dict | None = None) -> bytes:
    return P.encode_frame({"id": rid, "method": method, "params": params or {}})


HELLO = frame(0, "hello", {"version": P.PROTOCOL_VERSION})


class RawPeer:
    """A blocking client that writes frames as it likes and reads only when told to."""

    def __init__(self, path: Path, greet: bool = True):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(str(path))
        self.sock.settimeout(60)
        if greet:
            self.sock.sendall(HELLO)
            assert "result" in self.read()

    def send(self, *frames: bytes) -> None:
        self.sock.sendall(b"".join(frames))

    def read(self) -> dict | None:
        header = self._exactly(P.HEADER.size)
        if header is None:
            return None
        return msgpack.unpackb(self._exactly(P.HEADER.unpack(header)[0]), raw=False)

    def _exactly(self, n: int) -> bytes | None:
        data = b""
        while len(data) < n:
            chunk = self.sock.recv(n - len(data))
            if not chunk:
                return None
            data += chunk
        return data

    def close(self) -> None:
        self.sock.close()


async def timed_completion(client: EngineClient, params: dict) -> tuple[float, dict]:
    t0 = time.monotonic()
    stream = await client.complete(params)
    async for _ in stream:
        pass
    return time.monotonic() - t0, stream.result


# -- fairness ----------------------------------------------------------------------------------
class Flooder(threading.Thread):
    """Queues thousands of requests on one connection and, whenever one ends, asks for more."""

    def __init__(self, path: Path, first: int = 3000):
        super().__init__(daemon=True)
        self.peer = RawPeer(path)
        self.codes: dict[str, int] = {}  # final frames by error code ("done" for results)
        self.next_id = 1
        self.peer.send(*self._requests(first))

    def _requests(self, n: int) -> list[bytes]:
        first, self.next_id = self.next_id, self.next_id + n
        return [
            frame(
                i,
                "complete",
                dict(
                    FIM, prefix=f"def f{i}(x):\n    return ", max_tokens=64, temperature=1.0, seed=i
                ),
            )
            for i in range(first, first + n)
        ]

    def run(self) -> None:
        try:
            while (message := self.peer.read()) is not None:
                if "delta" in message:
                    continue
                code = message["error"]["code"] if "error" in message else "done"
                self.codes[code] = self.codes.get(code, 0) + 1
                if (
                    code != ErrorCode.TOO_MANY_REQUESTS
                ):  # one ended: more than the cap allows, again
                    self.peer.send(*self._requests(20))
        except OSError:
            pass  # closed by the test


def never_reader(path: Path, n: int) -> RawPeer:
    """Asks for long streamed completions and never reads a byte of them."""
    peer = RawPeer(path)
    peer.send(
        *(
            frame(
                i,
                "complete",
                dict(prompt=f"# file {i}\nimport os\n", max_tokens=900, temperature=1.0, seed=i),
            )
            for i in range(1, n + 1)
        )
    )
    return peer


async def test_a_flood_and_a_reader_that_never_reads_do_not_starve_another_client(tmp_path):
    daemon = start_daemon(tmp_path)
    victim = daemon.client()
    peers = []
    try:
        await victim.connect()
        unloaded = [(await timed_completion(victim, dict(FIM, max_tokens=8)))[0] for _ in range(3)]
        cap = 16  # ServeOptions.max_requests_per_connection
        flooder = Flooder(daemon.socket)
        flooder.start()
        peers += [flooder.peer, never_reader(daemon.socket, cap)]
        deadline = time.monotonic() + 30
        while (await victim.request("stats"))["running"] < cap and time.monotonic() < deadline:
            await asyncio.sleep(0.05)  # both hold the engine before the victim asks
        loaded = []
        for _ in range(3):
            seconds, result = await timed_completion(victim, dict(FIM, max_tokens=8))
            assert result["finish_reason"] in ("length", "eos", "stop")
            loaded.append(seconds)
        stats = await victim.request("stats")
        busy = ", ".join(f"{s:.2f}" for s in loaded)
        print(
            f"\nvictim's 8-token completion: unloaded median {statistics.median(unloaded):.3f} s; "
            f"with the flooder and the never-reader busy {busy} s (bound {FAIR_BOUND_S} s); "
            f"flooder's final frames {flooder.codes}; engine running {stats['running']}, "
            f"waiting {stats['waiting']}"
        )
        assert max(loaded) < FAIR_BOUND_S
        # The excess, refused at once.
        assert flooder.codes.get(ErrorCode.TOO_MANY_REQUESTS, 0) >= 3000 - cap
        assert stats["too_many_requests"] >= 3000 - cap
    finally:
        for peer in peers:
            peer.close()
        await victim.close()
        daemon.stop()


async def test_a_peer_that_never_reads_loses_its_streams_and_holds_up_nobody(tmp_path):
    """The loop never waits on one peer: its streams are cancelled once its unread output passes
    the limit, while another connection is answered as usual."""
    daemon = start_daemon(tmp_path, max_output_backlog=4096)
    client = daemon.client()
    silent = None
    try:
        await client.connect()
        silent = never_reader(daemon.socket, 4)
        deadline = time.monotonic() + 60
        while (stats := await client.request("stats"))[
            "slow_readers"
        ] < 4 and time.monotonic() < deadline:
            t0 = time.monotonic()
            assert (await client.request("health"))["ok"] and time.monotonic() - t0 < 5
            await asyncio.sleep(0.1)
        print(f"\nstreams of the never-reader cancelled: {stats['slow_readers']}")
        assert stats["slow_readers"] == 4
        deadline = time.monotonic() + 30
        while (stats := await client.request("stats"))["running"] and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert (
            stats["running"] == 0 and stats["waiting"] == 0
        )  # the engine stopped computing for it
    finally:
        if silent is not None:
            silent.close()
        await client.close()
        daemon.stop()


# -- the scheduler's share-out, driven step by step ---------------------------------------------
@pytest.fixture(scope="module")
def embedded():
    from engine.loading.loader import load_model
    from engine.loading.tokenizer import Tokenizer

    model = load_model(default_model_dir())
    return model, Tokenizer.from_dir(default_model_dir(), extra_eos_ids=model.config.eos_token_ids)


def test_one_owner_queue_neither_fills_the_batch_nor_the_pool_for_another(embedded):
    from engine.core.engine import Engine
    from engine.core.options import EngineOptions
    from engine.core.request import Request

    model, tok = embedded
    options = EngineOptions(num_blocks=256, block_size=16, max_batch=2, speculative=False)
    engine = Engine(model, tok, options)
    done: dict[str, object] = {}

    def on_event(event):
        if event.kind != "delta":
            done[event.request_id] = event

    prompt = tok.encode("def add(a, b):\n    return a + b\n")
    for i in range(12):  # one client's queue: each takes 300 tokens of room, 19 blocks
        flood = Request(
            prompt + [100 + i], max_tokens=280, stop_at_eos=False, owner="flood", id=f"f{i}"
        )
        engine.submit(flood, on_event)
    engine.submit(
        Request(prompt + [7], max_tokens=6, stop_at_eos=False, owner="other", id="other"), on_event
    )
    engine.step()
    running = engine.scheduler.running
    flood_blocks = sum(len(a.table.blocks) for a in running if a.request.owner == "flood")
    # With another owner there, a quarter of the pool, however many it queues (alone it may take
    # more: tests/engine/test_scheduler.py).
    assert flood_blocks <= engine.scheduler.owner_block_limit == 64
    assert (
        sum(a.request.owner == "flood" for a in running) > engine.options.max_batch
    )  # it fills the batch
    steps = 1
    while "other" not in done and steps < 50:
        engine.step()
        steps += 1
    # Admitted at once, prefilled next, then in every decode step although the batch is full.
    assert done["other"].kind == "done" and steps <= 2 + 6
    assert not any(key.startswith("f") for key in done)  # the flood's requests are all still going
    for a in engine.scheduler.running + engine.scheduler.waiting:
        engine.cancel(a.request.id)
    engine.run_until_idle()


def test_engine_errors_carry_protocol_codes(embedded):
    from engine.core.engine import Engine
    from engine.core.options import EngineOptions
    from engine.core.request import Request

    model, tok = embedded
    engine = Engine(model, tok, EngineOptions(num_blocks=4, block_size=16))
    context = model.config.max_position_embeddings
    cases = {
        ErrorCode.BAD_REQUEST: [],
        ErrorCode.CONTEXT_EXCEEDED: [5] * context,
        ErrorCode.POOL_FULL: [5] * 100,
    }
    events = {}
    for code, ids in cases.items():
        engine.submit(
            Request(ids, max_tokens=4, id=code), lambda e: events.setdefault(e.request_id, e)
        )
    engine.run_until_idle()
    for code in cases:
        assert events[code].kind == "error" and events[code].code == code, events[code]


def test_an_exception_that_happens_to_have_a_code_is_an_engine_error(embedded, monkeypatch):
    """Only the engine's own refusals carry their code: any other exception's `.code` (an
    OSError subclass's, a library's) is no protocol code."""
    from engine.core.engine import Engine
    from engine.core.options import EngineOptions
    from engine.core.request import Request

    class Odd(RuntimeError):
        code = ErrorCode.BAD_REQUEST

    model, tok = embedded
    engine = Engine(model, tok, EngineOptions(num_blocks=4, block_size=16))

    def fail(*args, **kwargs):
        raise Odd("not a refusal")

    monkeypatch.setattr(engine.scheduler, "_try_admit", fail)
    events = []
    engine.submit(Request([5, 6, 7], max_tokens=4), events.append)
    engine.run_until_idle()
    assert events[-1].kind == "error" and events[-1].code == ErrorCode.ENGINE_ERROR


def test_a_refusal_before_the_engine_is_answered_by_its_type_never_its_message():
    """The daemon's error frame for a request refused while it was prepared: a typed refusal's
    own code, BAD_REQUEST for malformed input, ENGINE_ERROR for anything else, whatever the
    message says or whatever `.code` another exception happens to have."""
    from engine.core.request import ContextExceeded, EmptyPrompt, PoolFull, RequestRefused
    from engine.serve.daemon import refusal

    class Odd(RuntimeError):
        code = ErrorCode.BAD_REQUEST

    cases = [
        (EmptyPrompt("the context is exceeded"), ErrorCode.BAD_REQUEST),
        (ContextExceeded("a bad request"), ErrorCode.CONTEXT_EXCEEDED),
        (PoolFull("the prompt is empty"), ErrorCode.POOL_FULL),
        (RequestRefused("pool full", ErrorCode.SHUTTING_DOWN), ErrorCode.SHUTTING_DOWN),
        (ValueError("pool_full: the context is exceeded"), ErrorCode.BAD_REQUEST),
        (TypeError("unhashable"), ErrorCode.BAD_REQUEST),
        (Odd("context_exceeded"), ErrorCode.ENGINE_ERROR),
        (KeyError("bad_request"), ErrorCode.ENGINE_ERROR),
    ]
    for exc, code in cases:
        got, message = refusal(exc)
        assert got == code and str(exc) in message, (exc, got)


async def test_the_service_checks_a_prompt_against_the_context_once_per_contract(embedded):
    """The daemon's contract: a budget past the context ends the completion at its end. The
    OpenAI contract (`whole_budget`): the prompt and all of max_tokens must fit. Both refuse an
    empty prompt; token ids are checked by their length before their values."""
    from engine.core.request import ContextExceeded, EmptyPrompt
    from engine.serve.service import CompletionService, Prompt

    model, tok = embedded
    service = CompletionService(SimpleNamespace(tokenizer=tok, model=model), default_model_dir())
    context = service.context_length
    text = "x = 1\n"
    ids = tok.encode_prompt(text)
    room = context - len(ids)
    p = P.CompletionParams.from_params({"prompt": text, "max_tokens": room + 1})
    assert await service.prepare(p) == Prompt(ids, "")
    with pytest.raises(ContextExceeded, match="maximum context length"):
        await service.prepare(p, whole_budget=True)
    p.max_tokens = room
    assert await service.prepare(p, whole_budget=True) == Prompt(ids, "")
    with pytest.raises(EmptyPrompt):
        await service.prepare(P.CompletionParams.from_params({"prompt": ""}))
    with pytest.raises(ContextExceeded, match="maximum context length"):
        await service.prepare(P.CompletionParams.from_params({"prompt": text * context}))
    assert service.prepare_ids([5, 6], room) == Prompt([5, 6])
    with pytest.raises(ContextExceeded):
        service.prepare_ids([tok.vocab_size] * context, 1)  # too long, whatever its ids
    with pytest.raises(ValueError, match="token ids"):
        service.prepare_ids([5, tok.vocab_size], 1)
    with pytest.raises(EmptyPrompt):
        service.prepare_ids([], 1)


# -- huge prompts ------------------------------------------------------------------------------
async def test_an_8_mb_prompt_is_refused_by_its_size_and_memory_stays_put(shared):
    client = shared.client()
    await client.connect()
    await timed_completion(client, dict(FIM, max_tokens=4))  # the daemon's steady state first
    before = shared.rss_mb()
    huge = "x = compute(1, 2)  # a line of code\n" * (8_000_000 // 36)
    t0 = time.monotonic()
    asks = [timed_completion(client, {"prompt": huge, "max_tokens": 4}) for _ in range(3)]
    outcomes = await asyncio.gather(*asks, return_exceptions=True)
    seconds = time.monotonic() - t0
    after = shared.rss_mb()
    print(
        f"\n3 x 8 MB prompts refused in {seconds:.2f} s; daemon RSS {before:.0f} -> {after:.0f} MB"
    )
    assert seconds < 20  # by size alone, far sooner than tokenizing one would take
    for outcome in outcomes:
        assert isinstance(outcome, EngineError) and outcome.code == ErrorCode.CONTEXT_EXCEEDED, (
            outcome
        )
        assert "context length" in outcome.message
    assert after - before < RSS_BOUND_MB
    await client.close()


async def test_fim_with_8_mb_prefixes_completes_cut_without_memory_or_delay_for_others(shared):
    heavy = [shared.client() for _ in range(3)]
    victim = shared.client()
    for client in heavy + [victim]:
        await client.connect()
    await timed_completion(victim, dict(FIM, max_tokens=4))
    before = shared.rss_mb()
    prefix = "".join(f"value_{i} = compute({i}, 'argument')\n" for i in range(190_000)) + "total = "
    assert len(prefix) > 7_000_000
    big = [
        timed_completion(c, dict(prefix=prefix, suffix="\n" * 1000, max_tokens=8)) for c in heavy
    ]
    small = timed_completion(victim, dict(FIM, max_tokens=8))
    *outcomes, (victim_s, victim_result) = await asyncio.gather(*big, small)
    after = shared.rss_mb()
    print(
        f"\n3 x FIM with a {len(prefix) / 1e6:.1f} MB prefix: "
        f"{max(s for s, _ in outcomes):.2f} s, prompts "
        f"{[r['usage']['prompt_tokens'] for _, r in outcomes]} tokens; another client's completion "
        f"meanwhile {victim_s:.2f} s, its first token "
        f"{victim_result['usage']['first_token_ms']:.0f} ms after it was queued; "
        f"daemon RSS {before:.0f} -> {after:.0f} MB"
    )
    for _, result in outcomes:
        assert result["finish_reason"] in ("length", "eos", "stop")
        assert 100 < result["usage"]["prompt_tokens"] <= 4096
    assert after - before < RSS_BOUND_MB
    assert victim_s < FAIR_BOUND_S
    for client in heavy + [victim]:
        await client.close()


# -- cancels and parameters --------------------------------------------------------------------
def test_a_complete_and_its_cancel_in_one_write_computes_nothing(shared):
    peer = RawPeer(shared.socket)
    peer.send(frame(1, "stats"))
    requests_before = peer.read()["result"]["requests"]
    request = frame(2, "complete", dict(FIM, max_tokens=500, temperature=1.0, seed=3))
    peer.send(request + frame(3, "cancel", {"id": 2}))  # one write
    answers = {}
    while len(answers) < 2:
        message = peer.read()
        assert "delta" not in message, "a cancelled request streamed text"
        answers[message["id"]] = message
    assert answers[3]["result"] == {"cancelled": True}
    assert answers[2]["result"]["finish_reason"] == "cancelled"
    peer.send(frame(4, "stats"))
    assert peer.read()["result"]["requests"] == requests_before  # never reached the engine
    peer.close()


async def test_top_p_that_is_zero_in_float32_and_max_tokens_near_the_context_get_clear_errors(
    shared,
):
    client = shared.client()
    info = (await client.connect())["model"]
    with pytest.raises(EngineError) as err:
        await timed_completion(client, dict(FIM, max_tokens=4, temperature=1.0, top_p=1e-50))
    assert err.value.code == ErrorCode.BAD_REQUEST and "top_p" in err.value.message
    _, result = await timed_completion(
        client, dict(FIM, max_tokens=4, temperature=1.0, top_p=1e-45, seed=1)
    )
    assert result["finish_reason"] in (
        "length",
        "eos",
        "stop",
    )  # the smallest float32 still samples

    most = info["max_completion_tokens"]
    assert 0 < most < info["max_context"]
    with pytest.raises(EngineError) as err:
        await timed_completion(client, dict(FIM, max_tokens=info["max_context"] - 4))
    assert err.value.code == ErrorCode.CONTEXT_EXCEEDED and f"at most {most}" in err.value.message
    with pytest.raises(EngineError) as err:
        await client.warm(dict(FIM, max_tokens=most + 1))
    assert err.value.code == ErrorCode.CONTEXT_EXCEEDED
    long_prefix = "".join(f"v{i} = {i}\n" for i in range(2000))
    warmed = await client.warm(
        dict(FIM, prefix=long_prefix, max_tokens=most)
    )  # the prompt keeps its share
    least = info["max_context"] // 4  # cut in whole lines: at most a quarter of that goes unused
    assert least * 3 // 4 <= warmed["usage"]["prompt_tokens"] <= least
    await client.close()


async def test_the_per_connection_cap_refuses_at_once_and_frees_as_requests_end(shared):
    peer = RawPeer(shared.socket)
    cap = 16
    peer.send(*(frame(i, "warm", dict(FIM, prefix=f"x{i} = 1\n")) for i in range(1, cap + 6)))
    codes = []
    while len(codes) < cap + 5:
        message = peer.read()
        codes.append(message["error"]["code"] if "error" in message else "ok")
    assert codes.count(ErrorCode.TOO_MANY_REQUESTS) >= 5 and codes.count("ok") <= cap
    peer.send(frame(100, "warm", FIM))  # all ended: room again
    assert "result" in peer.read()
    peer.close()


# -- connections that never greet ----------------------------------------------------------------
def test_a_silent_connection_is_closed_and_does_not_keep_the_daemon_alive(tmp_path):
    daemon = start_daemon(tmp_path, hello_timeout_s=0.5, idle_timeout_s=5.0)
    try:
        t0 = time.monotonic()
        peer = RawPeer(daemon.socket, greet=False)
        message = peer.read()
        closed_after = time.monotonic() - t0
        assert message is not None and message["error"]["code"] == ErrorCode.BAD_REQUEST
        assert "no hello" in message["error"]["message"]
        assert peer.read() is None and closed_after < 10
        # A silent connection open at every moment: the daemon still leaves when idle.
        stop = threading.Event()

        def keep_one_silent():
            while not stop.is_set():
                try:
                    silent = RawPeer(daemon.socket, greet=False)
                    while silent.read() is not None:
                        pass
                    silent.close()
                except OSError:
                    return

        keeper = threading.Thread(target=keep_one_silent, daemon=True)
        keeper.start()
        daemon.process.wait(timeout=60)
        stop.set()
        print(f"\nsilent connection closed after {closed_after:.2f} s; the daemon left when idle")
        assert daemon.process.returncode == 0
    finally:
        daemon.stop()


def test_a_frame_over_64_kb_before_hello_is_refused_by_its_header(shared):
    """Until its hello is checked a peer may be anyone: it cannot make the daemon read (and hold)
    a frame of megabytes, while a greeted client still may send one."""
    padded = frame(
        0, "hello", {"version": P.PROTOCOL_VERSION, "pad": "x" * (P.MAX_HELLO_FRAME_BYTES + 1)}
    )
    peer = RawPeer(shared.socket, greet=False)
    peer.send(padded[: P.HEADER.size])  # the header alone is enough to refuse it
    message = peer.read()
    assert message["error"]["code"] == ErrorCode.BAD_FRAME
    assert str(P.MAX_HELLO_FRAME_BYTES) in message["error"]["message"]
    assert peer.read() is None  # closed
    peer.close()
    peer = RawPeer(shared.socket)  # greeted: a large frame is read as before
    long_prefix = "# " + "x" * 200_000 + "\n" + FIM["prefix"]
    peer.send(frame(1, "complete", dict(FIM, prefix=long_prefix, max_tokens=1)))
    while "delta" in (message := peer.read()):
        pass
    assert message["result"]["finish_reason"] in ("length", "eos", "stop")
    peer.close()


async def test_a_cancelled_build_keeps_its_builder_slot_until_its_thread_ends(embedded):
    """A peer that leaves mid-build cancels the task awaiting the build, not the build: its slot
    is given back only when the build's thread is done, so no more than `prompt_builders`
    prompts are ever tokenized at once, however many peers come and go."""
    from engine.serve.service import CompletionService

    _, tok = embedded
    service = CompletionService(
        SimpleNamespace(tokenizer=tok), default_model_dir(), prompt_builders=2
    )
    lock, release = threading.Lock(), threading.Event()
    started: list[int] = []
    state = {"now": 0, "most": 0}

    def slow_build(i):
        with lock:
            started.append(i)
            state["now"] += 1
            state["most"] = max(state["most"], state["now"])
        release.wait(30)
        with lock:
            state["now"] -= 1
        return [i], ""

    service._build_prompt = slow_build
    tasks = [asyncio.ensure_future(service.build_prompt(i)) for i in range(5)]
    cancelled: set[int] = set()
    deadline = time.monotonic() + 2  # a build let through would start within milliseconds
    while time.monotonic() < deadline:
        for i in set(started) - cancelled:  # each peer leaves once its build runs
            tasks[i].cancel()
            cancelled.add(i)
        await asyncio.sleep(0.01)
    print(
        f"\nbuilds started while their peers left: {sorted(started)}; "
        f"at most {state['most']} at once"
    )
    assert state["most"] <= 2 and len(started) == 2
    release.set()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(
        isinstance(r, asyncio.CancelledError) for i, r in enumerate(results) if i in cancelled
    )
    assert [r for i, r in enumerate(results) if i not in cancelled] == [
        ([i], "") for i in range(5) if i not in cancelled
    ]
    assert state["most"] <= 2
    assert await asyncio.wait_for(service.build_prompt(9), 10) == ([9], "")  # every slot came back


# -- the socket's path ---------------------------------------------------------------------------
def test_the_daemon_refuses_a_regular_file_at_its_socket_path_and_exits_non_zero(tmp_path):
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    planted = run / "engine.sock"
    planted.write_text("keep me")
    env = dict(os.environ, WD_ENGINE_DIR=str(run), XDG_STATE_HOME=str(tmp_path / "state"))
    command = [
        sys.executable,
        "-m",
        "engine.cli",
        "serve",
        "--socket",
        str(planted),
        "--log-file",
        str(tmp_path / "log"),
        "--model",
        str(default_model_dir()),
    ]
    process = subprocess.run(
        command, cwd=REPO, env=env, stdin=subprocess.DEVNULL, capture_output=True, timeout=180
    )  # killed if it ever serves
    assert process.returncode != 0
    assert f"{planted} exists and is a regular file" in process.stderr.decode()
    assert planted.read_text() == "keep me"


@pytest.mark.parametrize("occupant", ["regular file", "listening engine"])
def test_serve_checks_its_socket_path_before_it_loads_a_model(tmp_path, occupant):
    """A path in the way, or an engine already listening there, is refused before any model is
    loaded: here the model folder does not even exist, and the error names the socket."""
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    path = run / "engine.sock"
    listener = None
    if occupant == "regular file":
        path.write_text("keep me")
    else:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(path))
        listener.listen(1)
    env = dict(os.environ, WD_ENGINE_DIR=str(run), XDG_STATE_HOME=str(tmp_path / "state"))
    command = [sys.executable, "-m", "engine.cli", "serve", "--socket", str(path)]
    command += ["--log-file", str(tmp_path / "log"), "--model", str(tmp_path / "no-model")]
    try:
        process = subprocess.run(
            command, cwd=REPO, env=env, stdin=subprocess.DEVNULL, capture_output=True, timeout=60
        )
    finally:
        if listener is not None:
            listener.close()
    stderr = process.stderr.decode()
    assert process.returncode == 1, stderr
    expected = "exists and is a regular file" if listener is None else "already listening"
    assert expected in stderr and str(path) in stderr and "cannot load" not in stderr
    if listener is None:
        assert path.read_text() == "keep me"


@pytest.mark.parametrize("kind", ["file", "directory", "link", "dangling link"])
def test_nothing_but_a_stale_socket_is_replaced_at_the_socket_path(tmp_path, monkeypatch, kind):
    from engine.ipc.socket_path import UnsafeSocketPath, bind_socket

    monkeypatch.setenv("WD_ENGINE_DIR", str(tmp_path / "run"))
    target = tmp_path / "precious.txt"
    target.write_text("keep me")
    path = tmp_path / "engine.sock"
    if kind == "file":
        path.write_text("keep me too")
    elif kind == "directory":
        path.mkdir()
        (path / "inside").write_text("and me")
    else:
        path.symlink_to(target if kind == "link" else tmp_path / "nowhere")
    with pytest.raises(UnsafeSocketPath, match=str(path)):
        bind_socket(path)
    if kind == "file":
        assert path.read_text() == "keep me too"
    elif kind == "directory":
        assert (path / "inside").read_text() == "and me"
    else:
        assert (
            path.is_symlink()
            and target.read_text() == "keep me"
            and not (tmp_path / "nowhere").exists()
        )


def test_a_stale_socket_is_replaced_and_a_live_one_is_not(tmp_path, monkeypatch):
    from engine.ipc.socket_path import SocketInUse, bind_socket

    monkeypatch.setenv("WD_ENGINE_DIR", str(tmp_path / "run"))
    path = tmp_path / "engine.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))
    stale.close()  # the file stays, nobody listens: what a crash leaves
    listener, identity = bind_socket(path)
    assert oct(path.lstat().st_mode & 0o777) == oct(0o600)  # from the umask: no chmod
    with pytest.raises(SocketInUse, match="already listening"):
        bind_socket(path)
    assert _listening(path) and (path.lstat().st_dev, path.lstat().st_ino) == identity
    listener.close()


def test_a_bound_socket_listens_at_once_so_another_engine_never_takes_it_for_stale(tmp_path):
    """Between bind() and listen() a connect is refused, which another engine starting takes
    for a crashed one's leftover: it would unlink the socket, and the first engine, recording
    the path's identity later, would then own (and at its end delete) the newcomer's."""
    from engine.ipc.socket_path import (
        SocketInUse,
        bind_socket,
        prepare_socket_path,
        remove_own_socket,
    )

    path = tmp_path / "engine.sock"
    listener, identity = bind_socket(path)
    with pytest.raises(SocketInUse, match="already listening"):
        prepare_socket_path(path)  # what a second `serve` does first
    info = path.lstat()
    assert (info.st_dev, info.st_ino) == identity
    listener.close()
    remove_own_socket(path, identity)
    assert not path.exists()


def test_the_default_socket_path_is_in_a_private_runtime_directory(tmp_path, monkeypatch):
    """The daemon's default socket path comes from paths.socket_path(), which creates the
    runtime directory 0700 and refuses one that is not this user's own directory."""
    from engine.ipc import paths

    run = tmp_path / "run"
    monkeypatch.setenv("WD_ENGINE_DIR", str(run))
    assert paths.socket_path() == run / "engine.sock"
    assert run.lstat().st_mode & 0o777 == 0o700
    real = tmp_path / "elsewhere"
    real.mkdir(mode=0o700)
    run.rmdir()
    run.symlink_to(real)  # a link where the directory should be is refused, not followed
    with pytest.raises(paths.UnsafeRuntimeDir):
        paths.socket_path()
