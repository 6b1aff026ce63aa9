"""Error mapping of the OpenAI-compatible endpoint, in process, with a stub engine that fails on
demand (a KV pool too small for a request can't be provoked with a tiny real model)."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from engine.openai_http import HttpOptions, OpenAIFrontend
from engine.scheduler import Event

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
            on_event(Event(request.id, event.kind, event.text, event.finish_reason, event.usage, event.error))

    def cancel(self, request_id, reason="cancelled"):
        self.cancelled.append(request_id)


@pytest.fixture
def stub():
    engine = StubEngine()
    server = SimpleNamespace(engine=engine, draining=False, model_dir=Path("/models/stub-model"),
                             last_client_seen=time.monotonic(), _build_prompt=lambda p: ([1, 2, 3], ""))
    frontend = OpenAIFrontend(server, HttpOptions(token=TOKEN))
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=frontend.app), base_url="http://test")
    return SimpleNamespace(engine=engine, server=server, frontend=frontend, client=client)


async def post(stub, **body):
    return await stub.client.post("/v1/completions", json={"prompt": "x", "max_tokens": 4} | body, headers=AUTH)


@pytest.mark.parametrize("message, status, code", [
    ("request needs 40 KV blocks (640 tokens) but the pool has 8", 503, "pool_full"),
    ("engine error: RuntimeError: CUDA out of memory", 503, "engine_error"),
    ("prompt has 600 tokens; the model's context is 512", 400, None),
])
async def test_engine_errors_map_to_status_codes(stub, message, status, code):
    stub.engine.script = [Event("", "error", error=message)]
    for stream in (False, True):
        response = await post(stub, stream=stream)
        assert response.status_code == status
        assert response.json()["error"]["message"] == message and response.json()["error"]["code"] == code
    assert stub.frontend.inflight == 0


async def test_an_error_after_streaming_began_comes_as_an_event(stub):
    stub.engine.script = [Event("", "delta", text="ab"), Event("", "error", error="engine error: boom")]
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
        stub.engine.script = [Event("", "delta", text="y"), Event("", "done", finish_reason=reason, usage=usage)]
        body = (await post(stub)).json()
        assert body["choices"][0] == {"text": "y", "index": 0, "logprobs": None, "finish_reason": expected}
        assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4,
                                 "prompt_tokens_details": {"cached_tokens": 2}}
        assert body["model"] == "stub-model"
