"""Hostile and malformed requests to the OpenAI-compatible endpoint of a real `wd-engine serve`.

Each gets a 4xx status and an OpenAI-style error body, never a 500 or a traceback, and after each
one the daemon still completes a normal request and has logged no traceback.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from engine.serve.openai_http import HTTP_OWNER, MAX_BODY_BYTES, HttpOptions, OpenAIFrontend
from engine.serve.service import CompletionService

GOOD = {"prompt": "def add(a, b):\n    return", "max_tokens": 2, "temperature": 0}


def auth(http_engine) -> dict:
    return {"Authorization": f"Bearer {http_engine.token}"}


def post(http_engine, content: bytes, **kwargs) -> httpx.Response:
    headers = {"Content-Type": "application/json"} | auth(http_engine) | kwargs.pop("headers", {})
    return httpx.post(
        f"{http_engine.base_url}/completions",
        content=content,
        headers=headers,
        timeout=60,
        **kwargs,
    )


def post_json(http_engine, body: dict) -> httpx.Response:
    # json.dumps escapes lone surrogates ("\ud800"), as a JavaScript client's JSON.stringify does.
    return post(http_engine, json.dumps({"model": http_engine.model} | body).encode())


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert {"message", "type", "param", "code"} <= set(error)
    assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str)
    if param is not None:
        assert error["param"] == param
    return error


def engine_log(http_engine) -> Path:
    return Path(http_engine.env["XDG_STATE_HOME"]) / "wd-lsp" / "engine.log"


@pytest.fixture(autouse=True)
def still_serving(http_engine):
    """After each hostile request: a normal completion works and nothing logged a traceback."""
    log = engine_log(http_engine)
    start = log.stat().st_size
    yield
    response = post_json(http_engine, GOOD)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] in ("stop", "length")
    with log.open("rb") as f:
        f.seek(start)
        assert b"Traceback" not in f.read()


def port(http_engine) -> int:
    return httpx.URL(http_engine.base_url).port


def raw_head(http_engine, extra: str) -> bytes:
    return (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Authorization: Bearer {http_engine.token}\r\n"
        f"Content-Type: application/json\r\n{extra}\r\n"
    ).encode()


def read_response(sock: socket.socket) -> tuple[int, bytes]:
    """Status and body of one HTTP/1.1 response with a Content-Length."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, "the server closed the connection without an answer"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    length = next(
        int(line.split(":", 1)[1]) for line in lines if line.lower().startswith("content-length:")
    )
    while len(body) < length:
        body += sock.recv(65536)
    return int(lines[0].split()[1]), body


def http_inflight(http_engine) -> int:
    """HTTP requests the daemon is answering, from its stats over the msgpack socket."""
    return asyncio.run(http_engine.stats())["http_inflight"]


def wait_for(condition, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


# -- authentication --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "value",
    [
        "Bearer tökén".encode(),
        "Bearer tökén".encode("latin-1"),
        "Bearer test-http-tokén".encode(),  # the right token with a non-ASCII character added
        b"Bearer \xff\xfe",
    ],
)
def test_a_non_ascii_bearer_token_is_401(http_engine, value):
    response = post(http_engine, json.dumps(GOOD).encode(), headers={"Authorization": value})
    assert assert_openai_error(response, 401)["code"] == "invalid_api_key"
    models = httpx.get(f"{http_engine.base_url}/models", headers={"Authorization": value})
    assert_openai_error(models, 401)


# -- bodies that are not a usable JSON object ------------------------------------------------------
@pytest.mark.parametrize("opening, closing", [("[", "]"), ('{"a":', "}")])
def test_deeply_nested_json_is_400(http_engine, opening, closing):
    depth = 100_000
    body = '{"prompt": ' + opening * depth + "1" + closing * depth + "}"
    error = assert_openai_error(post(http_engine, body.encode()), 400)
    assert "deeply" in error["message"]


@pytest.mark.parametrize(
    "content", [b"{not json", b"", b"\xff\xfe\xfd", b'{"prompt": "x"', b"\xef\xbb\xbf{}"]
)
def test_a_body_that_is_not_json_is_400(http_engine, content):
    assert_openai_error(post(http_engine, content), 400)


@pytest.mark.parametrize("content", [b"[]", b'"def f():"', b"null", b"42", b'[{"prompt": "x"}]'])
def test_json_that_is_not_an_object_is_400(http_engine, content):
    error = assert_openai_error(post(http_engine, content), 400)
    assert "JSON object" in error["message"]


def test_a_body_declared_over_the_cap_is_413_before_it_is_read(http_engine):
    with socket.create_connection(("127.0.0.1", port(http_engine)), timeout=30) as sock:
        sock.sendall(
            raw_head(http_engine, f"Content-Length: {MAX_BODY_BYTES + 1}\r\n")
        )  # and no body
        status, body = read_response(sock)
    assert status == 413
    assert json.loads(body)["error"]["code"] == "request_too_large"


def test_a_streamed_body_over_the_cap_is_413(http_engine):
    """Chunked, with no length announced: read in pieces and refused once past the cap."""
    piece = b" " * (1 << 20)

    def chunks():
        yield b'{"prompt": "'
        for _ in range(MAX_BODY_BYTES // len(piece) + 1):
            yield piece
        yield b'"}'

    assert_openai_error(post(http_engine, chunks()), 413)


def test_a_client_that_leaves_inside_the_body_disturbs_nothing(http_engine):
    """The request is seen in flight, the client leaves, and the daemon ends the request (the
    log is then checked for a traceback, and a normal request must work)."""
    with socket.create_connection(("127.0.0.1", port(http_engine)), timeout=30) as sock:
        sock.sendall(raw_head(http_engine, "Content-Length: 1000\r\n") + b'{"prompt": "')
        wait_for(lambda: http_inflight(http_engine) == 1)  # its handler waits for the rest
    wait_for(lambda: http_inflight(http_engine) == 0)  # the disconnect is handled


# -- fields of the wrong type or out of range ------------------------------------------------------
@pytest.mark.parametrize(
    "field, value",
    [
        ("max_tokens", "x"),
        ("max_tokens", 2.5),
        ("max_tokens", True),
        ("prompt", 5),
        ("prompt", {}),
        ("prompt", None),
        ("prompt", [1.5]),
        ("prompt", [True, 2]),
        ("prompt", [-1]),
        ("prompt", [10**30]),
        ("prompt", [[1], [2]]),
        ("stop", {}),
        ("stop", [1]),
        ("stop", ["s"] * 17),
        ("temperature", "hot"),
        ("temperature", -1),
        ("top_p", []),
        ("seed", "1"),
        ("seed", -1),
        ("stream", "yes"),
        ("stream_options", 3),
        ("suffix", 5),
        ("model", 5),
        ("model", ["m"]),
        ("ignore_eos", "no"),
        ("logit_bias", {"1": 5}),
    ],
)
def test_a_field_of_the_wrong_type_is_400(http_engine, field, value):
    assert_openai_error(post_json(http_engine, GOOD | {field: value}), 400)


@pytest.mark.parametrize(
    "max_tokens", ["4097", "1000000", "100000000000000000000000000000", "1e999", "-1"]
)
def test_a_huge_or_negative_max_tokens_is_400(http_engine, max_tokens):
    body = f'{{"prompt": "x = ", "max_tokens": {max_tokens}}}'  # 1e999 reads as infinity
    assert_openai_error(post(http_engine, body.encode()), 400)


def test_a_token_id_prompt_longer_than_the_context_is_400(http_engine):
    error = assert_openai_error(
        post_json(http_engine, {"prompt": [1] * 200_000, "max_tokens": 1}), 400
    )
    assert error["code"] == "context_length_exceeded"


def test_a_text_prompt_far_over_the_context_is_400(http_engine):
    """Megabytes of text: refused by its size against the context (engine.serve.service measures it
    before tokenizing), with OpenAI's code for it."""
    body = {"prompt": "x = 1\n" * 1_000_000, "max_tokens": 1}
    error = assert_openai_error(post_json(http_engine, body), 400)
    assert error["code"] == "context_length_exceeded"


def test_a_fim_max_tokens_that_leaves_no_room_for_the_code_is_400(http_engine):
    body = {"prompt": "def f(", "suffix": ")\n", "max_tokens": 4096}
    assert (
        assert_openai_error(post_json(http_engine, body), 400)["code"] == "context_length_exceeded"
    )


@pytest.mark.parametrize(
    "field, value",
    [
        ("n", 2),
        ("best_of", 3),
        ("logprobs", 1),
        ("echo", True),
        ("presence_penalty", 0.5),
        ("frequency_penalty", 1),
    ],
)
def test_an_unsupported_option_is_a_clear_400(http_engine, field, value):
    error = assert_openai_error(post_json(http_engine, GOOD | {field: value}), 400, param=field)
    assert "not supported" in error["message"]


@pytest.mark.parametrize("name", ["another-model", "módel", "\ud800"])
def test_another_model_name_is_404_with_a_readable_message(http_engine, name):
    error = assert_openai_error(post_json(http_engine, GOOD | {"model": name}), 404)
    assert error["code"] == "model_not_found"


def test_unknown_paths_and_methods_get_openai_errors(http_engine):
    assert_openai_error(
        httpx.get(f"{http_engine.base_url}/completions", headers=auth(http_engine)), 405
    )
    assert_openai_error(
        httpx.post(f"{http_engine.base_url}/chat/nothing", headers=auth(http_engine)), 404
    )


# -- lone surrogates -------------------------------------------------------------------------------
@pytest.mark.parametrize("field", ["prompt", "suffix", "stop"])
def test_a_lone_surrogate_is_completed_as_a_replacement_character(http_engine, field):
    """JSON may escape half a UTF-16 pair ("\\ud800"); the text is completed as if each lone half
    were U+FFFD: the same prompt tokens and the same greedy text."""
    base = {
        "prompt": "def f():\n    s = 'é",
        "suffix": "'\n    return s\n",
        "stop": ["\n\n"],
        "max_tokens": 6,
        "temperature": 0,
    }

    def body(odd: str) -> dict:
        value = base[field]
        return base | {field: [value[0] + odd] if field == "stop" else value + odd}

    broken = post_json(http_engine, body("\ud800 \udc00x\ude00\ud83d"))
    assert broken.status_code == 200, broken.text
    replaced = post_json(http_engine, body("\ufffd \ufffdx\ufffd\ufffd")).json()
    assert broken.json()["choices"][0]["text"] == replaced["choices"][0]["text"]
    assert broken.json()["usage"]["prompt_tokens"] == replaced["usage"]["prompt_tokens"]


def test_a_lone_surrogate_in_a_streamed_request_is_completed(http_engine):
    content = json.dumps(GOOD | {"prompt": "x = '\udfff", "stream": True}).encode()
    with httpx.stream(
        "POST",
        f"{http_engine.base_url}/completions",
        headers=auth(http_engine),
        timeout=60,
        content=content,
    ) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and all("error" not in json.loads(x[6:]) for x in lines[:-1])


# -- clients that go away --------------------------------------------------------------------------
def test_a_streaming_client_that_resets_the_connection_cancels_its_request(http_engine):
    def stats() -> dict:
        return asyncio.run(http_engine.stats())

    before = asyncio.run(http_engine.wait_idle())["cancelled"]
    body = json.dumps(
        GOOD | {"model": http_engine.model, "max_tokens": 400, "ignore_eos": True, "stream": True}
    ).encode()
    sock = socket.create_connection(("127.0.0.1", port(http_engine)), timeout=30)
    try:
        sock.sendall(raw_head(http_engine, f"Content-Length: {len(body)}\r\n") + body)
        seen = b""
        while b"data: " not in seen:  # streaming has begun
            chunk = sock.recv(65536)
            assert chunk
            seen += chunk
        assert seen.startswith(b"HTTP/1.1 200")
    finally:
        sock.setsockopt(
            socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
        )  # close with a reset
        sock.close()
    wait_for(lambda: stats()["cancelled"] == before + 1)
    after = asyncio.run(http_engine.wait_idle())
    assert after["running"] == 0 and after["waiting"] == 0


# -- fairness: one owner, a cap on requests in flight ----------------------------------------------
def test_requests_over_the_http_cap_are_429_in_openai_shape(http_engine):
    """With the cap of streams in flight, one more is refused at once, and the cap frees as
    they end (their clients reset the connections)."""
    cap = HttpOptions().max_requests
    body = json.dumps(
        GOOD | {"model": http_engine.model, "max_tokens": 400, "ignore_eos": True, "stream": True}
    ).encode()
    socks = []
    try:
        for _ in range(cap):
            sock = socket.create_connection(("127.0.0.1", port(http_engine)), timeout=30)
            socks.append(sock)
            sock.sendall(raw_head(http_engine, f"Content-Length: {len(body)}\r\n") + body)
        for sock in socks:
            seen = b""
            while b"data: " not in seen:  # streaming has begun
                chunk = sock.recv(65536)
                assert chunk
                seen += chunk
        error = assert_openai_error(post_json(http_engine, GOOD), 429)
        assert error["code"] == "rate_limit_exceeded" and error["type"] == "rate_limit_error"
    finally:
        for sock in socks:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()
    wait_for(lambda: http_inflight(http_engine) == 0)
    asyncio.run(http_engine.wait_idle())


class HangingEngine:
    """Takes requests and never answers: they stay in flight until their clients go."""

    def __init__(self):
        self.requests, self.cancelled = [], []
        self.tokenizer = SimpleNamespace(vocab_size=100)
        self.model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=512))

    def submit(self, request, on_event):
        self.requests.append(request)

    def cancel(self, request_id, reason="cancelled"):
        self.cancelled.append(request_id)


async def test_http_requests_share_one_owner_and_a_cap_on_those_in_flight():
    """Parallel HTTP requests are one client to the engine (one turn, one share of the pool, as
    a connection), not one each; past `max_requests` in flight they get 429."""
    engine = HangingEngine()

    service = CompletionService(engine, Path("stub-model"))
    service._build_prompt = lambda p: ([1, 2, 3], "")
    frontend = OpenAIFrontend(service, HttpOptions(token="t0ken", max_requests=3))
    client = httpx.AsyncClient(
        transport=httpx.ASGITransport(app=frontend.app), base_url="http://test"
    )
    headers = {"Authorization": "Bearer t0ken"}

    def post():
        return asyncio.ensure_future(
            client.post("/v1/completions", json={"prompt": "x"}, headers=headers)
        )

    async def submitted(n):
        async with asyncio.timeout(20):
            while len(engine.requests) < n:
                await asyncio.sleep(0.01)

    pending = [post() for _ in range(3)]
    await submitted(3)
    assert {r.owner for r in engine.requests} == {HTTP_OWNER}
    refused = await client.post("/v1/completions", json={"prompt": "x"}, headers=headers)
    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    unauthorized = await client.post(
        "/v1/completions", json={"prompt": "x"}, headers={"Authorization": "x"}
    )
    assert unauthorized.status_code == 401  # a refused token takes no place
    for task in pending:  # their clients go: the engine's work is cancelled, the places freed
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    assert sorted(engine.cancelled) == sorted(r.id for r in engine.requests)
    assert frontend.admitted == 0 and frontend.inflight == 0
    again = post()
    await submitted(4)
    again.cancel()
    await asyncio.gather(again, return_exceptions=True)
    await client.aclose()
