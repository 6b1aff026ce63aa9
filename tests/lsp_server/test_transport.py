"""A hostile client against the real server process: broken framing, bad JSON-RPC, the lifecycle.

Each test starts `python -m wd_lsp` with the engine off, writes raw bytes to its stdin and reads
framed messages from its stdout on a thread; every wait has a timeout, so a regression fails
instead of hanging. The framer is also checked in process, fed through reads of any size.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import queue
import random
import re
import socket
import stat
import subprocess
import sys
import threading
import tracemalloc
from pathlib import Path

import pytest

from wd_lsp.transport import CHUNK_BYTES, Framer

HANG_GUARD_S = 20  # only catches a hang; a healthy server answers in milliseconds
INIT_OPTIONS = {"enabled": False, "engine": {"autoStart": False}}
RSS_BOUND_BYTES = 1 << 30  # generous: allocating a declared 10^12-byte body would blow far past it


def frame(body: bytes, header: bytes = b"Content-Length") -> bytes:
    return header + b": %d\r\n\r\n" % len(body) + body


def encode(message: dict) -> bytes:
    return json.dumps(message).encode()


def request(msg_id, method: str, params) -> bytes:
    return frame(encode({"jsonrpc": "2.0", "id": msg_id, "method": method, "params": params}))


def notification(method: str, params=None) -> bytes:
    return frame(encode({"jsonrpc": "2.0", "method": method, "params": params}))


def inline_completion(msg_id: int) -> bytes:
    """An inline completion request for a document that is not open: the server answers no items."""
    params = {
        "textDocument": {"uri": "file:///nowhere.py"},
        "position": {"line": 0, "character": 0},
        "context": {"triggerKind": 1},
    }
    return request(msg_id, "textDocument/inlineCompletion", params)


class Responses:
    """The messages framed on a stream (the server's stdout or socket), read on a thread."""

    def __init__(self, stream, log):
        self.messages: queue.Queue[dict | None] = queue.Queue()
        self.skipped: list[dict] = []  # messages read past while waiting for another
        self._log = log
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream) -> None:
        while True:
            length = None
            while (line := stream.readline()) not in (b"\r\n", b""):
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            if not line or length is None:
                self.messages.put(None)
                return
            self.messages.put(json.loads(stream.read(length)))

    def response(self, msg_id) -> dict:
        """The next response with this id (None: an error about a message whose id is unknown)."""
        while True:
            try:
                message = self.messages.get(timeout=HANG_GUARD_S)
            except queue.Empty:
                pytest.fail(f"no response {msg_id!r} in {HANG_GUARD_S} s; log:\n{self._log()}")
            if message is None:
                pytest.fail(f"the server closed its output; log:\n{self._log()}")
            if "method" not in message and "id" in message and message["id"] == msg_id:
                return message
            self.skipped.append(message)


class ServerProcess:
    """`python -m wd_lsp [args]` with raw access to its input and framed access to its output."""

    def __init__(self, tmp_path: Path, *args: str):
        env = dict(
            os.environ, WD_ENGINE_DIR=str(tmp_path / "run"), XDG_STATE_HOME=str(tmp_path / "state")
        )
        self.log_path = tmp_path / "server.log"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "wd_lsp", "--log-file", str(self.log_path), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        self.out = Responses(self.proc.stdout, self.log)

    def send(self, data: bytes) -> None:
        self.proc.stdin.write(data)
        self.proc.stdin.flush()

    def response(self, msg_id) -> dict:
        return self.out.response(msg_id)

    def initialize(self) -> None:
        self.send(
            request(
                0,
                "initialize",
                {
                    "processId": None,
                    "rootUri": None,
                    "capabilities": {},
                    "initializationOptions": INIT_OPTIONS,
                },
            )
        )
        assert "result" in self.response(0)
        self.send(notification("initialized", {}))

    def answers(self, msg_id: int) -> None:
        """Assert that an inline completion request with this id gets its (empty) result."""
        self.send(inline_completion(msg_id))
        assert self.response(msg_id).get("result") == {"items": []}

    def exit_code(self) -> int:
        try:
            return self.proc.wait(timeout=HANG_GUARD_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the server did not exit; log:\n{self.log()}")

    def rss_bytes(self) -> int | None:
        try:
            status = Path(f"/proc/{self.proc.pid}/status").read_text()
        except OSError:
            return None
        return int(re.search(r"VmRSS:\s+(\d+) kB", status)[1]) * 1024

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:] if self.log_path.exists() else ""

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=HANG_GUARD_S)
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass


@pytest.fixture
def server(tmp_path):
    process = ServerProcess(tmp_path)
    process.initialize()
    yield process
    process.close()


def null_id_errors(process: ServerProcess) -> list[int]:
    return [
        m["error"]["code"] for m in process.out.skipped if m.get("id", 0) is None and "error" in m
    ]


def responses_skipped(process: ServerProcess) -> list[dict]:
    return [m for m in process.out.skipped if "method" not in m]


# -- framing ------------------------------------------------------------------------------------
@pytest.mark.parametrize("declared", [10**12, 2**63 - 1])
def test_huge_content_length_is_not_allocated_and_the_next_request_is_answered(server, declared):
    server.send(b"Content-Length: %d\r\n\r\n" % declared)
    server.answers(1)
    rss = server.rss_bytes()
    assert rss is None or rss < RSS_BOUND_BYTES
    assert "over the cap" in server.log()


def test_body_shorter_than_declared_does_not_swallow_the_next_message(server):
    short = b'{"jsonrpc": "2.0", "id": 1, "method": "textDocument/inlineCompletion"'
    server.send(b"Content-Length: 5000\r\n\r\n" + short)
    server.answers(2)  # read on from its header, without waiting for 5000 bytes
    assert null_id_errors(server) == [-32700]  # the cut body itself


def test_body_longer_than_declared_loses_only_itself(server):
    body = encode(
        {"jsonrpc": "2.0", "id": 1, "method": "textDocument/inlineCompletion", "params": {}}
    )
    server.send(b"Content-Length: %d\r\n\r\n" % (len(body) - 10) + body)
    server.answers(2)
    assert null_id_errors(server) == [-32700]


@pytest.mark.parametrize("header", [b"content-length", b"CONTENT-LENGTH", b"Content-length"])
def test_header_names_are_case_insensitive(server, header):
    body = inline_completion(1).split(b"\r\n\r\n", 1)[1]
    server.send(frame(body, header))
    assert server.response(1)["result"] == {"items": []}


def test_content_type_header_is_accepted_before_or_after_the_length(server):
    body = inline_completion(1).split(b"\r\n\r\n", 1)[1]
    kind = b"Content-Type: application/vscode-jsonrpc; charset=utf-8\r\n"
    server.send(kind + frame(body))
    server.send(
        b"Content-Length: %d\r\n" % len(body)
        + kind
        + b"\r\n"
        + body.replace(b'"id": 1', b'"id": 2')
    )
    assert server.response(1)["result"] == {"items": []}
    assert server.response(2)["result"] == {"items": []}


@pytest.mark.parametrize(
    "garbage",
    [
        b"garbage line\r\n",
        b"no line end at all",
        b"\x00\xff\xfe binary \r\n\r\n",
        b"Content-Length: abc\r\n\r\n",
        b"Content-Length: 12\r\nnot a header\r\n\r\n",
        b"Content-Length: 12\r\nContent-Length: 13\r\n\r\n",
    ],
)
def test_garbage_before_a_header_is_skipped(server, garbage):
    server.send(garbage)
    server.answers(1)
    server.answers(2)
    assert "dropped" in server.log()


# -- JSON-RPC errors ----------------------------------------------------------------------------
def test_malformed_json_gets_a_parse_error_with_null_id(server):
    server.send(frame(b'{"jsonrpc": "2.0", "id": 1, "method": '))
    assert server.response(None)["error"]["code"] == -32700
    server.answers(2)


def test_invalid_utf8_gets_a_parse_error(server):
    server.send(frame(b'{"jsonrpc": "2.0", "id": 1, "method": "\xff\xfe"}'))
    assert server.response(None)["error"]["code"] == -32700
    server.answers(2)


def test_deeply_nested_json_gets_a_parse_error_and_the_server_lives(server):
    server.send(frame(b"[" * 100_000))
    assert server.response(None)["error"]["code"] == -32700
    deep_params = b"[" * 100_000 + b"]" * 100_000
    server.send(
        frame(b'{"jsonrpc": "2.0", "id": 1, "method": "x", "params": ' + deep_params + b"}")
    )
    assert server.response(None)["error"]["code"] == -32700
    server.answers(2)


def test_invalid_params_get_an_invalid_params_error(server):
    params = {
        "textDocument": {"uri": "file:///nowhere.py"},
        "context": {"triggerKind": 1},
    }  # no position
    server.send(request(1, "textDocument/inlineCompletion", params))
    error = server.response(1)["error"]
    assert error["code"] == -32602 and "position" in error["message"]
    server.send(request(2, "textDocument/completion", {"textDocument": 5, "position": "x"}))
    assert server.response(2)["error"]["code"] == -32602
    server.answers(3)


def test_a_notification_with_invalid_params_is_dropped_quietly(server):
    server.send(notification("textDocument/didOpen", {"textDocument": {"uri": 7}}))
    server.answers(1)
    assert null_id_errors(server) == []


def test_unknown_request_is_method_not_found_and_unknown_notification_ignored(server):
    server.send(notification("$/noSuchNotification", {}))
    server.send(request(1, "noSuch/method", {}))
    assert server.response(1)["error"]["code"] == -32601
    server.answers(2)
    assert responses_skipped(server) == []  # no answer to the notification


@pytest.mark.parametrize(
    "message, answered_id",
    [
        (b"[]", None),
        (b'"just a string"', None),
        (b'{"id": 1, "method": "shutdown"}', 1),  # no "jsonrpc"
        (b'{"jsonrpc": "2.0", "id": 1, "method": 5}', 1),
        (b'{"jsonrpc": "2.0", "id": [1], "method": "shutdown"}', None),
        (b'{"jsonrpc": "2.0", "id": 1, "method": "shutdown", "params": 3}', 1),
    ],
)
def test_invalid_request_objects_get_an_invalid_request_error(server, message, answered_id):
    server.send(frame(message))
    assert server.response(answered_id)["error"]["code"] == -32600
    server.answers(2)


# -- lifecycle ----------------------------------------------------------------------------------
def test_requests_after_shutdown_get_invalid_request(server):
    server.send(request(1, "shutdown", None))
    assert server.response(1)["result"] is None
    server.send(inline_completion(2))
    assert server.response(2)["error"]["code"] == -32600
    server.send(request(3, "noSuch/method", {}))
    assert server.response(3)["error"]["code"] == -32600
    server.send(frame(encode({"jsonrpc": "2.0", "id": 99, "result": None})))  # a late response
    server.send(notification("textDocument/didClose", {"textDocument": {"uri": "file:///a.py"}}))
    server.send(notification("exit"))
    assert server.exit_code() == 0
    assert "notification 'textDocument/didClose' after shutdown: ignored" in server.log()
    assert "None after shutdown" not in server.log()


def test_exit_without_shutdown_exits_1(server):
    server.send(notification("exit"))
    assert server.exit_code() == 1  # stdin stays open: the server must not wait for its end


def test_shutdown_then_exit_exits_0(server):
    server.send(request(1, "shutdown", None))
    server.response(1)
    server.send(notification("exit"))
    assert server.exit_code() == 0


def test_end_of_input_without_exit_ends_the_process(server):
    server.proc.stdin.close()
    assert server.exit_code() == 1  # no shutdown: as if `exit` had come alone


def test_tcp_mode_recovers_from_a_huge_length_and_exits_with_the_spec_code(tmp_path):
    process = ServerProcess(tmp_path, "--tcp", "127.0.0.1:0")
    try:
        port = _logged_port(process)
        with socket.create_connection(("127.0.0.1", port), timeout=HANG_GUARD_S) as sock:
            sock.sendall(b"content-length: 1000000000000\r\n\r\n" + request(1, "shutdown", None))
            assert Responses(sock.makefile("rb"), process.log).response(1)["result"] is None
            sock.sendall(notification("exit"))
            assert process.exit_code() == 0
    finally:
        process.close()


def _logged_port(process: ServerProcess) -> int:
    for _ in range(HANG_GUARD_S * 20):
        if found := re.search(r"listening on [\d.]+:(\d+)", process.log()):
            return int(found[1])
        if process.proc.poll() is not None:
            break
        threading.Event().wait(0.05)
    pytest.fail(f"the server did not log its port; log:\n{process.log()}")


# -- the server's log ----------------------------------------------------------------------------
def test_the_log_file_is_private(server):
    server.answers(1)  # the log may hold requests' params, document text included
    server.send(request(2, "shutdown", None) + notification("exit"))
    assert server.exit_code() == 0 and "exit (code 0)" in server.log()
    assert stat.S_IMODE(os.lstat(server.log_path).st_mode) == 0o600


def test_the_log_is_never_written_through_a_symlink(tmp_path):
    target = tmp_path / "precious.txt"
    target.write_text("keep me\n")
    (tmp_path / "server.log").symlink_to(target)
    process = ServerProcess(tmp_path)
    try:
        process.initialize()  # it serves, logging to stderr instead
        process.answers(1)
        process.send(request(2, "shutdown", None) + notification("exit"))  # both logged
        assert process.exit_code() == 0
    finally:
        process.close()
    assert target.read_text() == "keep me\n" and (tmp_path / "server.log").is_symlink()


# -- the framer in process ------------------------------------------------------------------------
def _bodies(stream: bytes, read_size: int, max_body: int = 1 << 20) -> list[bytes]:
    return _framed([stream[i : i + read_size] for i in range(0, len(stream), read_size)], max_body)


def _framed(chunks: list[bytes], max_body: int = 1 << 20) -> list[bytes]:
    chunks = list(chunks)

    async def read() -> bytes:
        return chunks.pop(0) if chunks else b""

    async def collect() -> list[bytes]:
        framer, out = Framer(read, max_body=max_body), []
        while (body := await framer.next_body()) is not None:
            out.append(body)
        return out

    return asyncio.run(collect())


A, B, C = (
    encode({"jsonrpc": "2.0", "id": i, "method": "m", "params": {"text": "x\r\n" * i}})
    for i in (1, 2, 3)
)


@pytest.mark.parametrize("read_size", [1, 2, 7, 64, 1 << 16])
def test_framer_splits_well_formed_messages_read_in_any_pieces(read_size):
    pretty = json.dumps(json.loads(B), indent=2).replace("\n", "\r\n").encode()  # raw line breaks
    assert _bodies(frame(A) + frame(pretty) + frame(C, b"content-length"), read_size) == [
        A,
        pretty,
        C,
    ]


@pytest.mark.parametrize("read_size", [1, 5, 1 << 16])
def test_framer_recovers_from_each_framing_fault(read_size):
    stream = (
        b"junk\r\n"
        + frame(A)
        + b"Content-Length: 99999999999\r\n\r\n"
        + frame(B)
        + b'Content-Length: 500\r\n\r\n{"cut": '
        + frame(C)
        + b"Content-Length: 3\r\n\r\n"
        + A
    )
    assert _bodies(stream, read_size, max_body=1000) == [A, B, b'{"cut": ', C, A[:3]]


def test_framer_logs_one_line_per_incident(caplog):
    garbage = b"x" * 200_000
    with caplog.at_level(logging.WARNING, logger="wd_lsp.transport"):
        assert _bodies(garbage + frame(A) + garbage + frame(B), read_size=1000) == [A, B]
    drops = [r for r in caplog.records if "dropped" in r.getMessage()]
    assert len(drops) == 2 and all("200000 bytes" in r.getMessage() for r in drops)


@pytest.mark.parametrize(
    "digits", [b"1" + b"0" * 29, b"9" * 5000]
)  # past int64; past int()'s digit limit
def test_framer_skips_lengths_of_any_number_of_digits(digits):
    assert _bodies(b"Content-Length: " + digits + b"\r\n\r\n" + frame(A), read_size=100) == [A]


def test_framer_hunts_through_a_lying_length_in_bounded_memory():
    garbage = [b"y" * CHUNK_BYTES] * 320  # 20 MiB after a header that declares 10^12 bytes
    tracemalloc.start()
    try:
        assert _framed([b"Content-Length: 1000000000000\r\n\r\n", *garbage, frame(A)]) == [A]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 * CHUNK_BYTES


def over_declared(body: bytes, extra: int) -> bytes:
    """`body` framed with a Content-Length `extra` bytes too long."""
    return b"Content-Length: %d\r\n\r\n" % (len(body) + extra) + body


def test_framer_keeps_the_next_header_whole_when_a_length_ends_inside_it():
    # The declared length ends 5 bytes into the next header line, and the first read stops 12
    # bytes into it: the body must not take the header's first bytes and lose the message.
    stream = over_declared(A, 5) + frame(B) + frame(C)
    split = len(stream) - len(frame(B) + frame(C)) + 12
    assert _framed([stream[:split], stream[split:]]) == [A, B, C]


@pytest.mark.parametrize(
    "body",
    [
        A,
        b"{}\r\n",
        b'{"text": "}Content-Le"}',
        b'["x", "]content-length: 12"]',
        b'"}content-type: a"',
    ],
)
def test_framer_never_waits_for_more_after_a_complete_valid_body(body):
    async def first_body() -> bytes:
        chunks = [frame(body)]

        async def read() -> bytes:
            if chunks:
                return chunks.pop(0)
            await asyncio.Event().wait()  # the client waits for an answer: nothing more comes

        async with asyncio.timeout(HANG_GUARD_S):
            return await Framer(read).next_body()

    assert asyncio.run(first_body()) == body


def _faulty_streams() -> list[tuple[str, bytes, list[bytes]]]:
    """(fault, stream, the bodies expected of it): a faulty message, then B and C well framed."""
    typed_b = b"Content-Type: application/vscode-jsonrpc; charset=utf-8\r\n" + frame(B)
    cases = [
        (f"over by {d}", over_declared(A, d) + frame(B) + frame(C), [A, B, C])
        for d in range(1, len(frame(B)) - len(B) + 8)
    ]
    cases += [
        (f"over by {d}, Content-Type first", over_declared(A, d) + typed_b + frame(C), None)
        for d in range(1, len(typed_b) - len(B) + 8)
    ]
    cases += [
        (f"under by {d}", over_declared(A, -d) + frame(B) + frame(C), [A[:-d], B, C])
        for d in (1, 2, 10, 40)
    ]
    cases += [
        (f"garbage {junk!r}", frame(A) + junk + frame(B) + frame(C), [A, B, C])
        for junk in (
            b"junk\r\n",
            b"Content-Length: abc\r\n\r\n",
            b"Content-Length: 99999999999\r\n\r\n",
            b"content-le",
            b"}Content-Le\r\n",
        )
    ]
    return cases


def _split_runs(stream: bytes, rng: random.Random) -> list[list[bytes]]:
    """The stream read 1 byte at a time, in two pieces at every point, and in random pieces."""
    runs = [[stream[i : i + 1] for i in range(len(stream))]]
    runs += [[stream[:i], stream[i:]] for i in range(1, len(stream))]
    for _ in range(40):
        cuts = sorted(rng.sample(range(1, len(stream)), rng.randint(1, 12)))
        runs.append([stream[i:j] for i, j in zip([0, *cuts], [*cuts, len(stream)])])
    return runs


def test_framer_delivers_every_valid_message_after_a_faulty_one_however_the_reads_split():
    rng = random.Random(20261204)
    failures = []
    for fault, stream, expected in _faulty_streams():
        runs = _split_runs(stream, rng)
        for chunks, bodies in zip(runs, _framed_many(runs, max_body=1000)):
            good = (
                bodies == expected
                if expected
                else bodies[-2:] == [B, C] and bodies[0].startswith(A)
            )
            if not good:
                failures.append((fault, f"{len(chunks)} reads", bodies))
    assert not failures, f"{len(failures)} runs lost a message; first: {failures[0]}"


def _framed_many(runs: list[list[bytes]], max_body: int) -> list[list[bytes]]:
    """What the framer makes of each run of chunks, all in one event loop."""

    async def one(chunks: list[bytes]) -> list[bytes]:
        pending = list(chunks)

        async def read() -> bytes:
            return pending.pop(0) if pending else b""

        framer, out = Framer(read, max_body=max_body), []
        while (body := await framer.next_body()) is not None:
            out.append(body)
        return out

    async def run_all() -> list[list[bytes]]:
        return [await one(chunks) for chunks in runs]

    return asyncio.run(run_all())
