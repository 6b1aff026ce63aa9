"""The engine's wire protocol: length-prefixed msgpack frames. Imports no torch, so the language
server (and any other client) can use it.

Frame: 4-byte big-endian length, then a msgpack map. Client -> engine:
    {"id": int, "method": str, "params": map}
Engine -> client, for that id:
    {"id": id, "result": map}                    the answer (for `complete`: the final frame)
    {"id": id, "delta": str}                      streamed text of a `complete`, zero or more
    {"id": id, "error": {"code": str, "message": str}}
The first request on a connection must be `hello` with {"version": PROTOCOL_VERSION} (and
{"token": ...} on TCP), within a few seconds of connecting; anything else first is refused and
the connection closed. Every error carries one of the codes below, never to be inferred from its
message.

The hello's result is the engine's health, its model ("model") and "features": a list of the
optional request parameters this engine takes (`FEATURES`). A client sends such a parameter only
where the engine lists its feature: an engine started by an older release (daemons stay
resident) lists none, and refuses a parameter it does not know.

`complete` with "n" > 1 asks for several completions: the streamed text is the best, and the
final result's "alternatives" lists up to n - 1 others (strings, best first, distinct from the
streamed text and from each other, none blank). Only a beam search finds them (a single line, on
the lean CPU path); elsewhere the list is empty and the one streamed completion is the answer.
"""

from __future__ import annotations

import asyncio
import struct
from dataclasses import dataclass
from enum import StrEnum

import msgpack

PROTOCOL_VERSION = 1
# A beam search's rows go through one lean forward (engine.model.qwen3_moe.LEAN_MAX_ROWS).
MAX_BEAMS = 8
FEATURE_BEAMS = "beams"  # `complete` takes "beams" (beam search)
FEATURE_N = "n"  # `complete` takes "n" and its result may list "alternatives"
FEATURES = (FEATURE_BEAMS, FEATURE_N)  # what the hello's "features" lists
MAX_COMPLETIONS = 8  # the most "n" may ask for
MAX_FRAME_BYTES = 8 << 20  # a 5 MB file plus context fits; anything larger is refused
# Frames before a connection's hello: a hello is small, and until it is checked (a TCP peer's
# token) the peer may be anyone, who must not make the engine hold megabytes per connection.
MAX_HELLO_FRAME_BYTES = 64 << 10
HEADER = struct.Struct(">I")

METHODS = ("hello", "complete", "warm", "cancel", "stats", "health", "model_info", "shutdown")


def hello_features(hello: dict | None) -> frozenset[str]:
    """The features an engine's hello result lists; none for an engine from before they were
    listed (or a result that is not what this protocol sends: nothing is taken on trust)."""
    features = (hello or {}).get("features")
    if not isinstance(features, list):
        return frozenset()
    return frozenset(f for f in features if isinstance(f, str))


class ErrorCode(StrEnum):
    """Why a request or a frame was refused: the `code` of every error the engine sends, and of
    the error events inside it. A `StrEnum`, so the wire carries the plain string."""

    BAD_FRAME = "bad_frame"
    BAD_REQUEST = "bad_request"  # malformed fields, or an empty prompt
    UNKNOWN_METHOD = "unknown_method"
    UNAUTHORIZED = "unauthorized"
    VERSION_MISMATCH = "version_mismatch"
    POOL_FULL = "pool_full"  # the KV pool can never hold the request
    ENGINE_ERROR = "engine_error"
    SHUTTING_DOWN = "shutting_down"
    # The prompt (with max_tokens, where the contract asks) exceeds the model's context.
    CONTEXT_EXCEEDED = "context_exceeded"
    TOO_MANY_REQUESTS = "too_many_requests"  # the connection already has its cap of requests open
    SLOW_READER = "slow_reader"  # cancelled: its connection left too much output unread


PATH_MAX_CHARS = 4096  # a file path longer than any file system takes is not a path


class FrameError(ValueError):
    """A frame that cannot be read: too large, or not a msgpack map."""


def encode_frame(message: dict) -> bytes:
    body = msgpack.packb(message, use_bin_type=True)
    if len(body) > MAX_FRAME_BYTES:
        raise FrameError(f"frame of {len(body)} bytes exceeds the {MAX_FRAME_BYTES}-byte limit")
    return HEADER.pack(len(body)) + body


def decode_body(body: bytes) -> dict:
    try:
        message = msgpack.unpackb(body, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several types for malformed input
        raise FrameError(f"not a msgpack message: {type(exc).__name__}") from exc
    if not isinstance(message, dict):
        raise FrameError("a frame must hold a map")
    return message


async def read_frame(reader: asyncio.StreamReader, max_bytes: int = MAX_FRAME_BYTES) -> dict | None:
    """The next message, or None at a clean end of stream. Raises FrameError for a bad frame or
    one over `max_bytes`, refused by its header before its body is read (after which the stream
    is out of sync and should be closed)."""
    try:
        header = await reader.readexactly(HEADER.size)
    except asyncio.IncompleteReadError as exc:
        if exc.partial:
            raise FrameError("connection closed inside a frame header") from exc
        return None
    (length,) = HEADER.unpack(header)
    if length > max_bytes:
        raise FrameError(f"frame of {length} bytes exceeds the {max_bytes}-byte limit")
    try:
        body = await reader.readexactly(length)
    except asyncio.IncompleteReadError as exc:
        raise FrameError("connection closed inside a frame") from exc
    return decode_body(body)


def error_message(request_id, code: ErrorCode, message: str) -> dict:
    return {"id": request_id, "error": {"code": code, "message": message}}


@dataclass
class CompletionParams:
    """Parameters of `complete` and `warm`. Either `prompt` (plain text) or FIM pieces
    (`prefix`, `suffix`, optional context `chunks` [{path, text}] and the file's `path`)."""

    prefix: str | None = None
    suffix: str = ""
    prompt: str | None = None
    chunks: tuple = ()
    path: str | None = None
    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple = ()
    client: str | None = None
    deadline_ms: float | None = None
    fim_order: str = "auto"
    # > 1: beam search for a greedy completion (a single line), engine.decoding.beam_search.
    beams: int = 1
    # > 1: that many completions at most, the others as the result's "alternatives" (beams only).
    n: int = 1

    @classmethod
    def from_params(cls, params) -> CompletionParams:
        """Validate untrusted input; raises ValueError with a message fit for the client."""
        if not isinstance(params, dict):
            raise ValueError("params must be a map")
        known = set(cls.__dataclass_fields__)
        unknown = set(params) - known
        if unknown:
            raise ValueError(f"unknown parameters: {', '.join(sorted(map(str, unknown)))}")
        p = cls(**params)
        if p.prompt is None and p.prefix is None:
            raise ValueError("give either 'prompt' or 'prefix' (with 'suffix')")
        for name in ("prefix", "suffix", "prompt", "path", "client"):
            value = getattr(p, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"'{name}' must be a string")
        if (
            not isinstance(p.max_tokens, int)
            or isinstance(p.max_tokens, bool)
            or not 0 <= p.max_tokens <= 4096
        ):
            raise ValueError("'max_tokens' must be an integer in [0, 4096]")
        for name, lo, hi in (("temperature", 0.0, 10.0), ("top_p", 0.0, 1.0)):
            value = getattr(p, name)
            if (
                not isinstance(value, (int, float))
                or isinstance(value, bool)
                or not lo <= value <= hi
            ):
                raise ValueError(f"'{name}' must be a number in [{lo}, {hi}]")
        if _as_float32(p.top_p) == 0.0:  # sampling runs in float32: such a top_p keeps no token
            raise ValueError(
                f"'top_p' must be at least {FLOAT32_TINIEST:.1e}, float32's smallest positive "
                f"value (sampling computes in float32); {p.top_p!r} is 0 there"
            )
        if p.seed is not None and (
            not isinstance(p.seed, int) or isinstance(p.seed, bool) or not 0 <= p.seed < 2**63
        ):
            raise ValueError("'seed' must be an integer in [0, 2**63)")
        if (
            not isinstance(p.stop, (list, tuple))
            or not all(isinstance(s, str) for s in p.stop)
            or len(p.stop) > 16
        ):
            raise ValueError("'stop' must be a list of at most 16 strings")
        if not isinstance(p.chunks, (list, tuple)) or not all(
            isinstance(c, dict)
            and isinstance(c.get("path"), str)
            and isinstance(c.get("text"), str)
            for c in p.chunks
        ):
            raise ValueError("'chunks' must be a list of {path, text} maps")
        if any(
            len(path) > PATH_MAX_CHARS for path in [p.path or "", *(c["path"] for c in p.chunks)]
        ):
            raise ValueError(f"a 'path' must be at most {PATH_MAX_CHARS} characters")
        if p.deadline_ms is not None and (
            not isinstance(p.deadline_ms, (int, float)) or p.deadline_ms < 0
        ):
            raise ValueError("'deadline_ms' must be a non-negative number")
        if (
            not isinstance(p.beams, int)
            or isinstance(p.beams, bool)
            or not 1 <= p.beams <= MAX_BEAMS
        ):
            raise ValueError(f"'beams' must be an integer in [1, {MAX_BEAMS}]")
        if not isinstance(p.n, int) or isinstance(p.n, bool) or not 1 <= p.n <= MAX_COMPLETIONS:
            raise ValueError(f"'n' must be an integer in [1, {MAX_COMPLETIONS}]")
        if p.fim_order not in ("auto", "psm", "spm"):
            raise ValueError("'fim_order' must be auto, psm or spm")
        p.stop, p.chunks = tuple(p.stop), tuple(p.chunks)
        return p


FLOAT32_TINIEST = 1.401298464324817e-45  # the smallest positive float32 (a subnormal)


def _as_float32(value: float) -> float:
    return struct.unpack("<f", struct.pack("<f", value))[0]
