"""Error mapping of the OpenAI-compatible endpoint, in process, with a stub engine that fails on
demand (a KV pool too small for a request can't be provoked with a tiny real model)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from engine.core.request import ContextExceeded, Event, RequestRefused
from engine.ipc.protocol import ErrorCode
from engine.serve.openai_http import HttpOptions, OpenAIFrontend
from engine.serve.service import CompletionService

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
    """The real service and endpoint over the stub engine; the tests replace the service's
    `_build_prompt` (the tokenizing part) to fail as they need."""
    engine = StubEngine()
    service = CompletionService(engine, Path("/models/stub-model"))
    service._build_prompt = lambda p: ([1, 2, 3], "")
    frontend = OpenAIFrontend(service, HttpOptions(token=token))
    client = httpx.AsyncClient(
        transport=httpx.ASGITransport(app=frontend.app, **transport), base_url="http://test"
    )
    return SimpleNamespace(engine=engine, service=service, frontend=frontend, client=client)


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
            ErrorCode.POOL_FULL,
            "request needs 40 KV blocks (640 tokens) but the pool has 8",
            503,
            "pool_full",
        ),
        (
            ErrorCode.ENGINE_ERROR,
            "engine error: RuntimeError: CUDA out of memory",
            503,
            "engine_error",
        ),
        (
            ErrorCode.CONTEXT_EXCEEDED,
            "prompt has 600 tokens; the model's context is 512",
            400,
            "context_length_exceeded",
        ),
        (ErrorCode.BAD_REQUEST, "empty prompt", 400, "bad_request"),
        (
            ErrorCode.TOO_MANY_REQUESTS,
            "this connection has 8 requests open",
            429,
            "rate_limit_exceeded",
        ),
        (ErrorCode.SHUTTING_DOWN, "the engine is shutting down", 503, "shutting_down"),
        # The status comes from the code alone: words in a message change nothing.
        (ErrorCode.ENGINE_ERROR, "the context of the pool: empty prompt", 503, "engine_error"),
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
            ContextExceeded("the prompt is longer than the context"),
            400,
            "context_length_exceeded",
        ),
        (RequestRefused("a path too long", ErrorCode.BAD_REQUEST), 400, "bad_request"),
        (ValueError("no FIM tokens in this vocabulary"), 400, None),
    ],
)
async def test_prompt_building_errors_map_by_their_code(stub, error, status, http_code):
    def refuse(p):
        raise error

    stub.service._build_prompt = refuse
    response = await post(stub)
    assert response.status_code == status and response.json()["error"]["code"] == http_code
    assert response.json()["error"]["message"] == str(error) and stub.frontend.inflight == 0


async def test_a_bug_is_a_500_in_openai_shape_without_a_traceback():
    stub = make_stub(raise_app_exceptions=False)

    def broken(p):
        raise RuntimeError("a bug with a secret path /home/someone")

    stub.service._build_prompt = broken
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
    stub.service.draining = True
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


async def test_the_prompt_and_max_tokens_must_fit_the_context(stub):
    """OpenAI's contract, checked by the service the msgpack path shares: the prompt (3 tokens
    here) and all of max_tokens fit the stub's 512-token context, or the request is a 400."""
    stub.engine.script = [Event("", "done", finish_reason="length", usage={})]
    assert (await post(stub, max_tokens=509)).status_code == 200
    over_budget = {
        "message": "this model's maximum context length is 512 tokens; the prompt has 3 and "
        "max_tokens asks for 510",
        "type": "invalid_request_error",
        "param": "max_tokens",
        "code": "context_length_exceeded",
    }
    response = await post(stub, max_tokens=510)
    assert response.status_code == 400 and response.json()["error"] == over_budget
    # A token-id prompt as long as the context: the same answer, with the phrase clients look for.
    response = await post(stub, prompt=[7] * 512, max_tokens=1)
    assert response.status_code == 400
    assert response.json()["error"] == over_budget | {
        "message": "this model's maximum context length is 512 tokens; the prompt has 512 and "
        "max_tokens asks for 1"
    }
    response = await post(stub, prompt=[], max_tokens=1)
    assert response.status_code == 400
    assert response.json()["error"] == {
        "message": "the prompt is empty",
        "type": "invalid_request_error",
        "param": "prompt",
        "code": None,
    }
    response = await post(stub, prompt=[7, 100], max_tokens=1)  # the stub's vocabulary is 100
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"
    assert stub.frontend.inflight == 0


def test_every_code_a_refusal_carries_has_an_http_answer():
    from engine.serve.openai_http import ENGINE_ERRORS

    refusals, unseen = [], [RequestRefused]
    while unseen:  # the typed refusals, however deep their classes
        refusals.append(unseen.pop())
        unseen += refusals[-1].__subclasses__()
    assert len(refusals) >= 4  # RequestRefused, EmptyPrompt, ContextExceeded, PoolFull at least
    for refusal in refusals:
        assert refusal.code in ENGINE_ERRORS, refusal
    for code, error in ENGINE_ERRORS.items():
        assert isinstance(code, ErrorCode) and 400 <= error.status < 600


def test_the_two_fronts_import_the_service_and_not_each_other():
    """The OpenAI endpoint never loads the daemon; the daemon loads starlette and uvicorn only
    when it starts the HTTP listener."""
    for front, absent in (
        ("engine.serve.openai_http", ("engine.serve.daemon",)),
        ("engine.serve.daemon", ("engine.serve.openai_http", "starlette", "uvicorn")),
    ):
        code = (
            f"import sys, {front}\n"
            "assert 'engine.serve.service' in sys.modules\n"
            f"loaded = [m for m in sys.modules if m.startswith({absent!r})]\n"
            "assert not loaded, loaded\n"
        )
        subprocess.run([sys.executable, "-c", code], check=True)
