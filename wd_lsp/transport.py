"""The LSP base protocol (header + JSON body framing) over stdio or TCP, robust to broken clients.

pygls' reader trusts the stream: it allocates whatever `Content-Length` says up front, matches
the header name case-sensitively, and after one malformed frame reads every later message from
the wrong offset. This reader splits the stream into bodies and recovers from bad framing; the
protocol (`WdProtocol.receive_body`) answers bodies that are not valid JSON-RPC.

Recovery rests on one fact: a header line `Content-Length: <digits>` followed by a raw line
break can never occur inside valid JSON (the name would have to sit in a string, and JSON strings
cannot hold a raw line break). So:

- Bytes outside a message (garbage lines, the tail of a body longer than declared) are dropped
  up to the next header name, found anywhere, in any case.
- A declared length over `MAX_BODY_BYTES` is not read as a body: the reader hunts for the next
  header instead, keeping only a few bytes. If the body is real, hunting discards exactly it (it
  cannot contain a header); if the length is a lie (10^12, 2^63-1), hunting finds the next message
  at once, where skipping the declared count would swallow every later message.
- A body that contains a header line was declared longer than it is: it ends where that header
  starts, so the next message is read without waiting for bytes that will never come. When the
  declared length ends inside such a header line (the body is short by fewer bytes than the line),
  the reader first takes the rest of the line (or the end of the stream): taking only the declared
  bytes would cut the header's name, and hunting would then skip the whole next message. A valid
  JSON body never ends in the start of a header line, so this never waits for bytes that may not
  come.

Each incident is logged once, when the reader is back in step (or at the end of the stream).
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import select
import sys
import threading
from collections.abc import Awaitable, Callable
from functools import partial

from pygls.io_ import StdoutWriter

from .protocol import WdProtocol

log = logging.getLogger(__name__)

# Far above the largest document the server keeps (document.DEFAULT_MAX_BYTES, 2 MiB, even as
# JSON-escaped UTF-16), yet small enough that one bad message cannot exhaust memory.
MAX_BODY_BYTES = 64 * 1024 * 1024
MAX_HEADER_BYTES = 8 * 1024  # LSP headers are two short lines
CHUNK_BYTES = 64 * 1024
_STDIN_QUEUE_CHUNKS = 4  # bounds what the stdin thread reads ahead of the parser

_HEADER_NAME = re.compile(rb"content-(?:length|type)", re.IGNORECASE)
_NAME_TAIL = len(b"content-length") - 1  # kept while hunting: a name may be split across reads
_NAME_SKIP = len(b"content-")  # dropped from a broken header block so hunting moves past it
_HEADER_LINE = re.compile(rb"([!#$%&'*+.^_`|~0-9A-Za-z-]+)[ \t]*:[ \t]*(.*?)[ \t]*\r?\n")
# A header line inside a body; bounded so that a match is at most _EMBED_SPAN bytes long.
_EMBEDDED_HEADER = re.compile(
    rb"content-length[ \t]{0,8}:[ \t]{0,8}\d{1,20}[ \t]{0,8}\r?\n", re.IGNORECASE
)
_EMBED_SPAN = 64
# The start of a header line cut off by the end of a body: a name prefix (shorter than a name) or a
# name followed by what the line may hold before its line break. Matched case-insensitively
# against what follows the body's last line break or closing bracket. No quote: a valid body (a
# JSON string at the top) may end in one.
_HEADER_NAMES = (b"content-length", b"content-type")
_HEADER_LINE_START = re.compile(
    rb'content-(?:length[ \t]*(?::[ \t]*\d*[ \t]*\r?)?|type[ \t]*(?::[^\r\n"]*\r?)?)', re.IGNORECASE
)
_MAX_LENGTH_DIGITS = 20  # more digits than this is over any cap; int() refuses ~4300+ digits
_HUGE_LENGTH = 10**_MAX_LENGTH_DIGITS


class Framer:
    """Splits a byte stream into LSP message bodies, dropping what cannot be framed."""

    def __init__(self, read: Callable[[], Awaitable[bytes]], max_body: int = MAX_BODY_BYTES):
        self._read = read  # the next chunk of the stream; b"" at its end
        self._max_body = max_body
        self._buf = bytearray()
        self._eof = False
        self._dropped = 0  # bytes dropped in the current incident
        self._noise = False  # whether any of them was not whitespace
        self._why: str | None = None  # what started the incident

    async def next_body(self) -> bytes | None:
        """The next message body, or None at the end of the stream."""
        while await self._hunt():
            header = await self._read_headers()
            if header is None:
                continue
            length, size = header
            if length > self._max_body:
                declared = length if length < _HUGE_LENGTH else f"10^{_MAX_LENGTH_DIGITS} or more"
                self._drop(
                    size,
                    f"a declared Content-Length of {declared} bytes, over the cap of "
                    f"{self._max_body}",
                )
                continue
            del self._buf[:size]
            self._report_drops()
            body = await self._read_body(length)
            if body is not None:
                return body
        self._report_drops()
        return None

    async def _fill(self) -> bool:
        if self._eof:
            return False
        chunk = await self._read()
        if not chunk:
            self._eof = True
            return False
        self._buf += chunk
        return True

    async def _hunt(self) -> bool:
        """Drop bytes up to the next header name; False at the end of the stream."""
        while (match := _HEADER_NAME.search(self._buf)) is None:
            self._drop(len(self._buf) - _NAME_TAIL, "bytes outside any message")
            if not await self._fill():
                self._drop(len(self._buf), "bytes outside any message")
                return False
        self._drop(match.start(), "bytes outside any message")
        return True

    async def _read_headers(self) -> tuple[int, int] | None:
        """(Content-Length, header block size) of the block at the buffer's start; None if
        broken."""
        start, length = 0, None
        while True:
            end = self._buf.find(b"\n", start)
            if end < 0:
                if len(self._buf) - start > MAX_HEADER_BYTES:
                    return self._broken("a header line with no end")
                if not await self._fill():
                    return self._broken("the end of the stream inside a header")
                continue
            line = bytes(self._buf[start : end + 1])
            start = end + 1
            if line in (b"\r\n", b"\n"):
                return (
                    (length, start)
                    if length is not None
                    else self._broken("a header without length")
                )
            match = _HEADER_LINE.fullmatch(line)
            if match is None or start > MAX_HEADER_BYTES:
                return self._broken("a malformed header")
            if (
                match[1].lower() == b"content-length"
            ):  # Content-Type and unknown headers are ignored
                value = match[2]
                if length is not None or not value.isdigit():
                    return self._broken("a malformed Content-Length")
                length = int(value) if len(value) <= _MAX_LENGTH_DIGITS else _HUGE_LENGTH

    def _broken(self, why: str) -> None:
        self._drop(_NAME_SKIP, why)
        return None

    async def _read_body(self, length: int) -> bytes | None:
        """`length` bytes, fewer where a header starts inside them; None at the end of the
        stream."""
        scanned = 0
        while True:
            cut = self._header_inside(scanned, length)
            if cut is not None:
                log.warning(
                    "a message body ended after %d of its declared %d bytes, where the next "
                    "header starts; reading on from that header",
                    cut,
                    length,
                )
                return self._take(cut)
            if len(self._buf) >= length and not self._ends_in_header_start(length):
                return self._take(length)
            scanned = max(0, len(self._buf) - _EMBED_SPAN)
            if not await self._fill():
                if len(self._buf) >= length:  # the header it seemed to start never came
                    return self._take(length)
                log.warning(
                    "the stream ended inside a message body (%d of %d bytes): dropped",
                    len(self._buf),
                    length,
                )
                self._buf.clear()
                return None

    def _header_inside(self, start: int, length: int) -> int | None:
        """Where a header line starts inside the first `length` buffered bytes, searched from
        `start`."""
        end = min(len(self._buf), length + _EMBED_SPAN)
        if self._buf.find(b"\n", start, min(len(self._buf), length)) < 0:
            # Without a line break in the body a header's own would lie past it: only its end
            # can hold one.
            start = max(start, length - _EMBED_SPAN)
        match = _EMBEDDED_HEADER.search(self._buf, start, end)
        return match.start() if match is not None and match.start() < length else None

    def _ends_in_header_start(self, length: int) -> bool:
        """Whether the first `length` buffered bytes end in the unfinished start of a header line
        whose end is not buffered yet (once it is, `_header_inside` finds a Content-Length line)."""
        if len(self._buf) >= length + _EMBED_SPAN:
            return False
        tail = bytes(self._buf[max(0, length - _EMBED_SPAN) : length])
        start = max(tail.rfind(b"\n"), tail.rfind(b"}"), tail.rfind(b"]")) + 1
        if start == 0:  # a header line starts after a line break or at the end of a JSON value
            return False
        return _is_header_line_start(tail[start:])

    def _take(self, n: int) -> bytes:
        body = bytes(self._buf[:n])
        del self._buf[:n]
        return body

    def _drop(self, n: int, why: str) -> None:
        if n <= 0:
            return
        self._noise = self._noise or bool(self._buf[:n].strip())
        del self._buf[:n]
        self._dropped += n
        self._why = self._why or why

    def _report_drops(self) -> None:
        if self._dropped:
            level = logging.WARNING if self._noise else logging.DEBUG
            log.log(
                level,
                "dropped %d bytes that are not a well-framed message (first: %s)",
                self._dropped,
                self._why,
            )
        self._dropped, self._noise, self._why = 0, False, None


def _is_header_line_start(text: bytes) -> bool:
    """Whether `text` (not empty) is how a Content-Length or Content-Type line starts."""
    lower = text.lower()
    if any(name.startswith(lower) for name in _HEADER_NAMES):
        return bool(text)
    return _HEADER_LINE_START.fullmatch(text) is not None


class StdinChunks:
    """Chunks of a file descriptor, read by a daemon thread: a blocked read never holds up the
    exit."""

    def __init__(self, fd: int):
        self._fd = fd
        self._room = threading.Semaphore(_STDIN_QUEUE_CHUNKS)  # the parser sets the pace
        self._queue: asyncio.Queue[bytes] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def read(self) -> bytes:
        if self._queue is None:
            self._loop = asyncio.get_running_loop()
            self._queue = asyncio.Queue()
            threading.Thread(target=self._pump, name="wd-lsp-stdin", daemon=True).start()
        chunk = await self._queue.get()
        self._room.release()
        return chunk

    def _pump(self) -> None:
        while True:
            self._room.acquire()
            chunk = self._read_chunk()
            try:
                self._loop.call_soon_threadsafe(self._queue.put_nowait, chunk)
            except RuntimeError:  # the loop is closed: nobody reads any more
                return
            if not chunk:
                return

    def _read_chunk(self) -> bytes:
        # os.read on the raw descriptor, not sys.stdin.buffer: a daemon thread blocked inside the
        # buffered reader's lock makes interpreter shutdown abort.
        while True:
            try:
                return os.read(self._fd, CHUNK_BYTES)
            except BlockingIOError:  # a descriptor some parent left non-blocking
                select.select([self._fd], [], [])
            except OSError as exc:
                log.error("reading the client's input failed: %s", exc)
                return b""


async def _pump_messages(protocol: WdProtocol, framer: Framer) -> None:
    while protocol.exit_code is None and (body := await framer.next_body()) is not None:
        try:
            protocol.receive_body(body)
        except BrokenPipeError:
            log.error("the connection to the client is lost")
            return
        except Exception:  # noqa: BLE001 - one message's failure must not end the session
            log.exception("failed to handle a message")
        await asyncio.sleep(0)  # let handlers run between messages that are already buffered


async def serve(protocol: WdProtocol, read: Callable[[], Awaitable[bytes]]) -> int:
    """Handle the messages of one connection until `exit` or its end; the process's exit code."""
    exited = asyncio.get_running_loop().create_future()
    protocol.on_exit = lambda code: exited.done() or exited.set_result(code)
    pump = asyncio.ensure_future(_pump_messages(protocol, Framer(read)))
    try:
        await asyncio.wait({pump, exited}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        protocol.on_exit = None
        pump.cancel()
    if pump.done() and not pump.cancelled() and pump.exception() is not None:
        raise pump.exception()
    if exited.done():
        return exited.result()
    log.info("the client closed the connection without `exit`")
    return protocol.lifecycle_exit_code()


def serve_stdio(server, stdin_fd: int | None = None, stdout=None) -> int:
    """Serve `server` (a pygls LanguageServer with a WdProtocol) over stdio; the exit code."""
    server.protocol.set_writer(StdoutWriter(stdout or sys.stdout.buffer))
    source = StdinChunks(sys.stdin.fileno() if stdin_fd is None else stdin_fd)
    try:
        return asyncio.run(serve(server.protocol, source.read))
    finally:
        server.shutdown()


def serve_tcp(server, host: str, port: int) -> int:
    """Serve one client connecting to host:port (port 0: any free port, logged); the exit code."""
    try:
        return asyncio.run(_serve_tcp(server.protocol, host, port))
    finally:
        server.shutdown()


async def _serve_tcp(protocol: WdProtocol, host: str, port: int) -> int:
    session = asyncio.get_running_loop().create_future()

    connected = False

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connected
        if connected:  # one client per process, as over stdio
            writer.close()
            return
        connected = True
        listener.close()
        protocol.set_writer(writer)
        try:
            session.set_result(await serve(protocol, partial(reader.read, CHUNK_BYTES)))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, which raises it
            if not session.done():
                session.set_exception(exc)
        finally:
            writer.close()

    listener = await asyncio.start_server(on_connect, host, port)
    for sock in listener.sockets:
        log.info("wd-lsp listening on %s:%d", *sock.getsockname()[:2])
    return await session
