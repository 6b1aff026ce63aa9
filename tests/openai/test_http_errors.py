"""Error mapping of the OpenAI-compatible endpoint, in process, with a stub engine that fails on
demand (a KV pool too small for a request can't be provoked with a tiny real model)."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from engine.core.scheduler import Event
from engine.ipc import protocol as P
from engine.serve.openai_http import HttpOptions, OpenAIFrontend

TOKEN = "t0ken"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


class StubEngine:
    def __init__(self):
        self.script: list[Event] = []  # what the next request answers
        self.cancelled: list[str] = []
        self.tokenizer = SimpleNamespace(vocab_size=100)
        self.model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=512))

    def submit(self, request, on_event):
        for event in self.script:
            on_event(dataclasses.replace(event, request_id=request.id))

    def cancel(self, request_id, reason="cancelled"):
        self.cancelled.append(request_id)


def make_stub(token: str = TOKEN, **transport):
    engine = StubEngine()
    server = SimpleNamespace(
        engine=engine,
        draining=False,
        model_dir=Path("/models/stub-model"),
        last_client_seen=time.monotonic(),
        _build_prompt=lambda p: ([1, 2, 3], ""),
    )

    async def build_prompt(p):  # as EngineServer.build_prompt: the tests replace _build_prompt
        return server._build_prompt(p)

    server.build_prompt = build_prompt
    frontend = OpenAIFrontend(server, HttpOptions(token=token))
    client = httpx.AsyncClient(
        transport=httpx.ASGITransport(app=frontend.app, **transport), base_url="http://test"
    )
    return SimpleNamespace(engine=engine, server=server, frontend=frontend, client=client)


@pytest.fixture
def stub():
    return make_stub()


async def post(stub, **body):
    body = {"prompt": "x", "max_tokens": 4} | body
    return await stub.client.post("/v1/completions", json=body, headers=AUTH)


@pytest.mark.parametrize(
    "code, message, status, http_code",
    [
        (
            P.POOL_FULL,
            "request needs 40 KV blocks (640 tokens) but the pool has 8",
            503,
            "pool_full",
        ),
        (P.ENGINE_ERROR, "engine error: RuntimeError: CUDA out of memory", 503, "engine_error"),
        (
            P.CONTEXT_EXCEEDED,
            "prompt has 600 tokens; the model's context is 512",
            400,
            "context_length_exceeded",
        ),
        (P.BAD_REQUEST, "empty prompt", 400, "bad_request"),
        (P.TOO_MANY_REQUESTS, "this connection has 8 requests open", 429, "rate_limit_exceeded"),
        (P.SHUTTING_DOWN, "the engine is shutting down", 503, "shutting_down"),
        # The status comes from the code alone: words in a message change nothing.
        (P.ENGINE_ERROR, "the context of the pool: empty prompt", 503, "engine_error"),
        (None, "prompt has 600 tokens; the model's context is 512", 503, "engine_error"),
        ("a_code_from_a_newer_engine", "something new", 503, "engine_error"),
    ],
)
async def test_engine_errors_map_to_status_codes_by_their_code(
    stub, code, message, status, http_code
):
    stub.engine.script = [Event("", "error", error=message, code=code)]
    for stream in (False, True):
        response = await post(stub, stream=stream)
        assert response.status_code == status
        error = response.json()["error"]
        assert error["message"] == message and error["code"] == http_code
    assert stub.frontend.inflight == 0


@pytest.mark.parametrize(
    "error, status, http_code",
    [
        (
            P.RequestError(P.CONTEXT_EXCEEDED, "the prompt is longer than the context"),
            400,
            "context_length_exceeded",
        ),
        (P.RequestError(P.BAD_REQUEST, "a path too long"), 400, "bad_request"),
        (ValueError("no FIM tokens in this vocabulary"), 400, None),
    ],
)
async def test_prompt_building_errors_map_by_their_code(stub, error, status, http_code):
    def refuse(p):
        raise error

    stub.server._build_prompt = refuse
    response = await post(stub)
    assert response.status_code == status and response.json()["error"]["code"] == http_code
    assert response.json()["error"]["message"] == str(error) and stub.frontend.inflight == 0


async def test_a_bug_is_a_500_in_openai_shape_without_a_traceback():
    stub = make_stub(raise_app_exceptions=False)

    def broken(p):
        raise RuntimeError("a bug with a secret path /home/someone")

    stub.server._build_prompt = broken
    response = await post(stub)
    assert response.status_code == 500 and response.json()["error"]["code"] == "internal_error"
    assert "Traceback" not in response.text and "/home/someone" not in response.text


async def test_a_non_ascii_token_of_the_engine_is_compared_as_utf8_bytes():
    stub = make_stub(token="jeton-été")
    stub.engine.script = [Event("", "done", finish_reason="length", usage={})]
    body = {"prompt": "x", "max_tokens": 1}
    good = {"Authorization": "Bearer jeton-été".encode()}
    assert (await stub.client.post("/v1/completions", json=body, headers=good)).status_code == 200
    for wrong in ("Bearer jeton-été".encode("latin-1"), b"Bearer jeton-ete", b"Bearer \xff"):
        response = await stub.client.post(
            "/v1/completions", json=body, headers={"Authorization": wrong}
        )
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"


async def test_an_empty_engine_token_admits_nobody():
    stub = make_stub(token="")
    response = await stub.client.post(
        "/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer "}
    )
    assert response.status_code == 401


async def test_an_error_after_streaming_began_comes_as_an_event(stub):
    stub.engine.script = [
        Event("", "delta", text="ab"),
        Event("", "error", error="engine error: boom"),
    ]
    response = await post(stub, stream=True)
    assert response.status_code == 200
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert '"text": "ab"' in events[0] and '"engine_error"' in events[1] and events[-1] == "[DONE]"
    assert stub.frontend.inflight == 0 and stub.engine.cancelled  # the engine was told, harmlessly


async def test_draining_refuses_new_work(stub):
    stub.server.draining = True
    response = await post(stub)
    assert response.status_code == 503 and response.json()["error"]["code"] == "shutting_down"
    assert (await stub.client.get("/health")).status_code == 503


async def test_done_maps_finish_reasons_and_usage(stub):
    usage = dict(prompt_tokens=3, cached_tokens=2, completion_tokens=1)
    for reason, expected in (("length", "length"), ("eos", "stop"), ("stop", "stop")):
        stub.engine.script = [
            Event("", "delta", text="y"),
            Event("", "done", finish_reason=reason, usage=usage),
        ]
        body = (await post(stub)).json()
        assert body["choices"][0] == {
            "text": "y",
            "index": 0,
            "logprobs": None,
            "finish_reason": expected,
        }
        assert body["usage"] == {
            "prompt_tokens": 3,
            "completion_tokens": 1,
            "total_tokens": 4,
            "prompt_tokens_details": {"cached_tokens": 2},
        }
        assert body["model"] == "stub-model"
