"""The engine's OpenAI-compatible endpoint, through the official `openai` client and raw HTTP,
against a real `wd-engine serve --http-port` process."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from engine.ipc.client import EngineClient

CODE = (
    "def add(a, b):\n    return a + b\n\n\n"
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n"
)


@pytest.fixture
def client(http_engine):
    return openai.OpenAI(base_url=http_engine.base_url, api_key=http_engine.token, max_retries=0)


@pytest.fixture
def aclient(http_engine):
    return openai.AsyncOpenAI(
        base_url=http_engine.base_url, api_key=http_engine.token, max_retries=0
    )


def test_models_and_health(client, http_engine):
    models = client.models.list()
    assert [m.id for m in models.data] == [http_engine.model]
    assert client.models.retrieve(http_engine.model).id == http_engine.model
    # Health answers without the token (load balancers probe it) and tells nothing else.
    health = httpx.get(http_engine.base_url.removesuffix("/v1") + "/health")
    assert health.status_code == 200 and health.json() == {"status": "ok"}


def test_completion_not_streamed(client, http_engine):
    result = client.completions.create(
        model=http_engine.model, prompt=CODE, max_tokens=8, temperature=0
    )
    assert result.object == "text_completion" and result.model == http_engine.model
    choice = result.choices[0]
    assert isinstance(choice.text, str) and choice.finish_reason in ("stop", "length")
    assert 0 < result.usage.completion_tokens <= 8
    assert result.usage.total_tokens == result.usage.prompt_tokens + result.usage.completion_tokens
    if choice.finish_reason == "length":
        assert result.usage.completion_tokens == 8


def test_streamed_equals_not_streamed(client, http_engine):
    whole = client.completions.create(
        model=http_engine.model, prompt=CODE, max_tokens=12, temperature=0
    )
    chunks = list(
        client.completions.create(
            model=http_engine.model,
            prompt=CODE,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    finishes = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finishes == [whole.choices[0].finish_reason]
    assert (
        chunks[-1].choices == []
        and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    )
    # The same prompt again: served from the prefix cache the first request filled.
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0


async def test_async_client_streams(aclient, http_engine):
    stream = await aclient.completions.create(
        model=http_engine.model,
        prompt=CODE,
        max_tokens=6,
        stream=True,
        temperature=0.8,
        top_p=0.9,
        seed=7,
        stop=["\n\n"],
    )
    texts = [chunk.choices[0].text async for chunk in stream]
    assert "\n\n" not in "".join(texts)


async def test_fim_suffix_shares_the_msgpack_prefix_cache(client, http_engine):
    """`suffix` gives a FIM prompt, laid out as the msgpack path lays it out: the same engine,
    so a msgpack request right after hits the blocks the HTTP request cached, and agrees."""
    prefix, suffix = CODE + "        self.", "\n\np = Point(1, 2)\nprint(p.x + p.y)\n"
    http = client.completions.create(
        model=http_engine.model, prompt=prefix, suffix=suffix, max_tokens=10, temperature=0
    )
    engine = EngineClient(socket_path=http_engine.socket)
    try:
        stream = await engine.complete(dict(prefix=prefix, suffix=suffix, max_tokens=10))
        text = "".join([d async for d in stream])
    finally:
        await engine.close()
    assert text == http.choices[0].text
    assert stream.result["usage"]["cached_tokens"] > 0
    assert stream.result["usage"]["prompt_tokens"] == http.usage.prompt_tokens


def test_auth_refused_without_the_token(http_engine):
    for key in ("wrong-token", ""):
        bad = openai.OpenAI(base_url=http_engine.base_url, api_key=key or "x", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.completions.create(model=http_engine.model, prompt="x", max_tokens=2)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
    raw = httpx.post(f"{http_engine.base_url}/completions", json={"prompt": "x", "max_tokens": 2})
    assert raw.status_code == 401 and raw.headers["www-authenticate"] == "Bearer"
    assert raw.json()["error"]["code"] == "invalid_api_key"


def test_bad_parameters_are_400_and_unknown_model_404(client, http_engine):
    model = http_engine.model
    for kwargs in (
        dict(max_tokens=-1),
        dict(temperature=-0.5),
        dict(n=2),
        dict(echo=True),
        dict(logprobs=2),
        dict(top_p=0),
        dict(prompt=["a", "b"]),
        dict(max_tokens=100_000),
    ):
        args = dict(model=model, prompt="x", max_tokens=2) | kwargs
        with pytest.raises(openai.BadRequestError):
            client.completions.create(**args)
    with pytest.raises(openai.BadRequestError, match="context length"):
        client.completions.create(model=model, prompt="x = 1\n" * 400, max_tokens=200)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="another-model", prompt="x", max_tokens=2)
    headers = {"Authorization": f"Bearer {http_engine.token}"}
    assert (
        httpx.post(
            f"{http_engine.base_url}/completions", content=b"{not json", headers=headers
        ).status_code
        == 400
    )


def test_token_ids_as_prompt(client, http_engine):
    result = client.completions.create(
        model=http_engine.model, prompt=[5, 6, 7, 8], max_tokens=3, temperature=0
    )
    assert result.usage.prompt_tokens == 4


async def test_client_disconnect_cancels_the_engine_request(http_engine):
    before = (await http_engine.wait_idle())["cancelled"]
    headers = {"Authorization": f"Bearer {http_engine.token}"}
    body = {
        "model": http_engine.model,
        "prompt": CODE,
        "max_tokens": 400,
        "stream": True,
        "ignore_eos": True,
    }
    async with httpx.AsyncClient(timeout=30) as http:
        async with http.stream(
            "POST", f"{http_engine.base_url}/completions", json=body, headers=headers
        ) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data:"):
                    assert json.loads(line[5:])["choices"][0]["finish_reason"] is None
                    break  # leaving the block closes the connection mid-stream
    stats = await http_engine.wait_idle()
    assert stats["running"] == 0 and stats["cancelled"] == before + 1

    # Not streamed: the client gives up waiting once the engine runs the request (a fixed
    # client timeout would race the engine, which on a fast machine finishes first).
    before = stats["cancelled"]
    async with httpx.AsyncClient(timeout=30) as http:
        post = asyncio.create_task(
            http.post(
                f"{http_engine.base_url}/completions",
                json=dict(body, stream=False),
                headers=headers,
            )
        )
        while (await http_engine.stats())["running"] == 0 and not post.done():
            await asyncio.sleep(0.005)
        assert not post.done(), "the request ended before the client could give up on it"
        post.cancel()
        with pytest.raises(asyncio.CancelledError):
            await post
    stats = await http_engine.wait_idle()
    assert stats["running"] == 0 and stats["cancelled"] == before + 1
