"""The language server's OpenAI-compatible backend against the engine's own HTTP endpoint: the
backend on its own (FIM template vs server-side suffix, cancellation, failures) and the whole
server over stdio with `backend: "openai"`."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import httpx
import pytest
from lsprotocol import types as T
from pytest_lsp import ClientServerConfig

from engine.ipc.client import EngineUnavailable
from wd_lsp.config import Settings, merge_settings
from wd_lsp.context import build_context
from wd_lsp.document import Document, Position
from wd_lsp.openai_backend import FIM_PREFIX, OpenAIBackend, fim_template_prompt
from wd_lsp.shape import StopRules

PY = (
    "import os\n\n\ndef add(a, b):\n    return a + b\n\n\n"
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        \n"
)
CURSOR = (10, 8)  # after the indentation of the last line
URI = "file:///project/point.py"
NO_STOPS = StopRules(multiline=True, max_lines=1000)


def settings_for(http_engine, **openai) -> Settings:
    raw = {
        "backend": "openai",
        "maxTokens": 12,
        "temperature": 0,
        "openai": {"baseUrl": http_engine.base_url, "apiKey": http_engine.token} | openai,
    }
    return merge_settings(Settings(), raw, warn=pytest.fail)


def context(cursor=CURSOR):
    return build_context(Document(URI, PY, "python"), Position(*cursor))


class States:
    def __init__(self):
        self.seen: list[tuple[str, str]] = []

    def __call__(self, state, message):
        self.seen.append((state, message))


async def raw_completion(http_engine, **body) -> dict:
    async with httpx.AsyncClient(timeout=30) as http:
        response = await http.post(
            f"{http_engine.base_url}/completions",
            json=body,
            headers={"Authorization": f"Bearer {http_engine.token}"},
        )
    response.raise_for_status()
    return response.json()


def test_settings_parse_and_reject_bad_values():
    warnings = []
    s = merge_settings(
        Settings(),
        {
            "backend": "openai",
            "openai": {
                "baseUrl": "http://gpu-box:8000/v1",
                "apiKey": "k",
                "model": "m",
                "fim": "suffix",
            },
        },
        warn=warnings.append,
    )
    assert (s.backend, s.openai.base_url, s.openai.api_key, s.openai.model, s.openai.fim) == (
        "openai",
        "http://gpu-box:8000/v1",
        "k",
        "m",
        "suffix",
    )
    assert not warnings
    s2 = merge_settings(
        s,
        {"backend": "cloud", "openai": {"fim": "psm", "baseUrl": "gpu-box:8000"}},
        warn=warnings.append,
    )
    assert s2 == s and len(warnings) == 3


def test_imports_no_torch():
    code = (
        "import sys\nimport wd_lsp.server, wd_lsp.openai_backend\n"
        "heavy = [m for m in ('torch', 'triton', 'numpy', 'transformers') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


async def test_template_and_suffix_fim_agree_with_the_endpoint(http_engine):
    ctx = context((10, 0))
    # The Qwen-Coder template written by the client and the `suffix` FIM built by the engine
    # are the same token sequence, so greedy decoding gives the same text both ways. (At a line
    # start: elsewhere the engine heals the token at the cursor, which a raw prompt cannot.)
    raw = await raw_completion(
        http_engine, prompt=fim_template_prompt(ctx), max_tokens=12, temperature=0
    )
    answers = []
    for fim in ("template", "suffix"):
        backend = OpenAIBackend(States(), lambda m: None)
        backend.configure(settings_for(http_engine, fim=fim))
        answer = await backend.complete(ctx, NO_STOPS, key="k")
        answers.append(answer.text)
        # the engine's listener lists its model's context (the test checkpoint's 512 tokens)
        assert backend.state == "ready" and backend.model_info == {
            "name": http_engine.model,
            "max_context": 512,
        }
        assert answer.usage["completion_tokens"] >= 1 and answer.first_token_ms is not None
        assert (await backend.stats())["requests"] == 1
        backend.disconnect()
    assert answers[0] == answers[1] == raw["choices"][0]["text"]


async def test_a_stop_rule_closes_the_stream(http_engine):
    ctx = context()
    backend = OpenAIBackend(States(), lambda m: None)
    backend.configure(merge_settings(settings_for(http_engine), {"maxTokens": 200}))
    full = (await backend.complete(ctx, NO_STOPS, key="k")).text
    if len(full) < 4:
        pytest.skip("the random model ended at once")
    stop = full[2:4]
    answer = await backend.complete(
        ctx, StopRules(multiline=True, max_lines=1000, stop_strings=(stop,)), key="k"
    )
    assert answer.text == full[: full.find(stop)]
    backend.disconnect()


async def test_cancelling_a_completion_cancels_the_engine_request(http_engine):
    before = (await http_engine.wait_idle())["cancelled"]
    backend = OpenAIBackend(States(), lambda m: None)
    s = merge_settings(settings_for(http_engine), {"maxTokens": 400})
    backend.configure(s)
    await backend.ensure_connected()
    # Long enough to still be decoding when cancelled (the model may end earlier at an eos).
    task = asyncio.ensure_future(backend.complete(context(), NO_STOPS, key="k"))
    for _ in range(200):
        if (await http_engine.stats())["running"]:
            break
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    stats = await http_engine.wait_idle()
    assert stats["running"] == 0
    assert (
        stats["cancelled"] == before + 1 or stats["completed"] > 0
    )  # cancelled, unless it had ended
    backend.disconnect()


async def test_failures_give_one_message_then_recover(http_engine):
    from engine.ipc.client import EngineUnavailable

    states = States()
    backend = OpenAIBackend(states, lambda m: None)
    backend.configure(settings_for(http_engine, apiKey="wrong"))
    for _ in range(3):
        with pytest.raises(EngineUnavailable):
            await backend.complete(context(), NO_STOPS, key="k")
    errors = [m for state, m in states.seen if state == "error"]
    assert len(errors) == 1 and "401" in errors[0]
    backend.configure(settings_for(http_engine))  # fixed in the settings: works again
    assert (await backend.complete(context(), NO_STOPS, key="k")).usage is not None
    assert backend.state == "ready"
    backend.configure(
        settings_for(http_engine, baseUrl="http://127.0.0.1:9/v1")
    )  # nothing listens there
    with pytest.raises(EngineUnavailable):
        await backend.complete(context(), NO_STOPS, key="k")
    assert backend.state == "error"
    backend.disconnect()


# -- the whole server over stdio ------------------------------------------------------------------
CAPS = T.ClientCapabilities(
    text_document=T.TextDocumentClientCapabilities(
        inline_completion=T.InlineCompletionClientCapabilities(),
        synchronization=T.TextDocumentSyncClientCapabilities(),
    )
)


@pytest.fixture
async def lsp(http_engine, tmp_path):
    env = dict(
        http_engine.env,
        XDG_STATE_HOME=str(tmp_path / "state"),
        WD_ENGINE_DIR=str(tmp_path / "no-engine"),
    )
    client = await ClientServerConfig(
        server_command=[sys.executable, "-m", "wd_lsp"], server_env=env
    ).start()
    options = {
        "debounceMs": 0,
        "maxTokens": 16,
        "backend": "openai",
        "openai": {"baseUrl": http_engine.base_url, "apiKey": http_engine.token},
    }
    await client.initialize_session(
        T.InitializeParams(
            capabilities=CAPS, initialization_options=options, root_uri="file:///project"
        )
    )
    yield client
    await client.shutdown_session()


def inline(client, line, character):
    return client.text_document_inline_completion_async(
        T.InlineCompletionParams(
            text_document=T.TextDocumentIdentifier(uri=URI),
            position=T.Position(line=line, character=character),
            context=T.InlineCompletionContext(trigger_kind=T.InlineCompletionTriggerKind.Automatic),
        )
    )


async def status(client):
    return await client.workspace_execute_command_async(
        T.ExecuteCommandParams(command="wdLsp.status")
    )


async def test_language_server_completes_through_the_http_endpoint(lsp, http_engine):
    before = (await http_engine.wait_idle())["requests"]
    lsp.text_document_did_open(
        T.DidOpenTextDocumentParams(
            text_document=T.TextDocumentItem(uri=URI, language_id="python", version=1, text=PY)
        )
    )
    for line, character in (CURSOR, (4, 4), (9, 8)):
        result = await inline(lsp, line, character)
        head = PY.split("\n")[line][:character]
        for item in result.items:
            # The item replaces the line's head with itself plus the suggestion.
            assert item.range.start == T.Position(line=line, character=0)
            assert item.range.end == T.Position(line=line, character=character)
            assert isinstance(item.insert_text, str) and item.insert_text.startswith(head)
            assert item.insert_text[len(head) :]
    s = await status(lsp)
    assert s["engine"] == "ready" and s["model"] == http_engine.model
    assert s["engine_calls"] == 3 and s["errors"] == 0
    assert s["engineStats"]["backend"] == "openai" and s["engineStats"]["requests"] == 3
    # The engine saw them (and no speculative warm-ups: the OpenAI backend sends none).
    assert (await http_engine.wait_idle())["requests"] == before + 3


async def test_language_server_with_a_bad_key_logs_once_and_answers_empty(lsp, http_engine):
    lsp.workspace_did_change_configuration(
        T.DidChangeConfigurationParams(settings={"wdLsp": {"openai": {"apiKey": "wrong"}}})
    )
    lsp.text_document_did_open(
        T.DidOpenTextDocumentParams(
            text_document=T.TextDocumentItem(uri=URI, language_id="python", version=1, text=PY)
        )
    )
    for _ in range(3):
        assert not (await inline(lsp, *CURSOR)).items
    await asyncio.sleep(0.1)
    errors = [m for m in lsp.log_messages if m.type == T.MessageType.Error]
    assert len(errors) == 1 and "401" in errors[0].message
    s = await status(lsp)
    assert s["engine"] == "error" and s["errors"] == 3
    lsp.workspace_did_change_configuration(
        T.DidChangeConfigurationParams(
            settings={"wdLsp": {"openai": {"apiKey": http_engine.token}}}
        )
    )
    await inline(lsp, *CURSOR)
    assert (await status(lsp))["engine"] == "ready"


@pytest.mark.parametrize("marker", ["<|fim_middle|>", "<|fim_suffix|>", "<|file_sep|>"])
async def test_a_server_that_writes_fim_markers_as_text_is_cut_there(marker):
    """Servers that do not end on the FIM markers (they cannot be told never to sample them)
    stream them as text: template-mode FIM cuts the completion there."""
    import json

    bodies = []

    def server(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/models"):
            return httpx.Response(200, json={"data": [{"id": "remote-coder"}]})
        bodies.append(json.loads(request.content))
        deltas = ["self.y", " = y", marker, "def other():"]
        events = "".join(
            f"data: {json.dumps({'choices': [{'text': d, 'index': 0}]})}\n\n" for d in deltas
        )
        return httpx.Response(
            200, text=events + "data: [DONE]\n\n", headers={"content-type": "text/event-stream"}
        )

    backend = OpenAIBackend(States(), lambda m: None)
    backend.configure(
        merge_settings(
            Settings(),
            {
                "backend": "openai",
                "maxTokens": 12,
                "openai": {"baseUrl": "http://remote.invalid/v1", "fim": "template"},
            },
            warn=pytest.fail,
        )
    )
    backend.http = httpx.AsyncClient(
        base_url="http://remote.invalid/v1", transport=httpx.MockTransport(server)
    )
    answer = await backend.complete(context(), NO_STOPS, key="k")
    assert answer.text == "self.y = y" and answer.stopped_early
    assert bodies[0]["prompt"].endswith("<|fim_middle|>") and len(bodies[0]["stop"]) == 4
    await backend.http.aclose()


@pytest.mark.parametrize(
    "card, context",
    [
        ({"id": "remote-coder", "max_model_len": 2048}, 2048),
        ({"id": "remote-coder"}, None),
        ({"id": "remote-coder", "max_model_len": "big"}, None),
    ],
)
async def test_the_models_context_comes_from_the_servers_model_list(card, context):
    """vLLM and the engine's listener give `max_model_len`: the language server fits its context
    budget to it; a server that does not say leaves the default budget."""

    def server(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"data": [{"id": "other", "max_model_len": 99}, card]})

    backend = OpenAIBackend(States(), lambda m: None)
    backend.configure(
        merge_settings(
            Settings(),
            {
                "backend": "openai",
                "openai": {"baseUrl": "http://remote.invalid/v1", "model": "remote-coder"},
            },
            warn=pytest.fail,
        )
    )
    backend.http = httpx.AsyncClient(
        base_url="http://remote.invalid/v1", transport=httpx.MockTransport(server)
    )
    await backend.ensure_connected()
    assert backend.model_info.get("max_context") == context
    await backend.http.aclose()


@pytest.mark.parametrize("refusals, answered", [(1, True), (2, False)])
async def test_a_prompt_refused_as_too_long_is_asked_again_with_half_the_prefix(refusals, answered):
    """The context budget estimates tokens from characters; where dense code makes the prompt
    longer than the model's context, the server says so and gets half the prefix once."""
    import json

    prompts = []

    def server(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/models"):
            return httpx.Response(
                200, json={"data": [{"id": "remote-coder", "max_model_len": 1024}]}
            )
        prompts.append(json.loads(request.content)["prompt"])
        if len(prompts) <= refusals:
            return httpx.Response(
                400,
                json={
                    "error": {
                        "message": "This model's maximum context length is 1024 "
                        "tokens; the prompt has 1100",
                        "code": 400,
                    }
                },
            )
        event = json.dumps({"choices": [{"text": "x = 1", "index": 0}]})
        return httpx.Response(
            200,
            text=f"data: {event}\n\ndata: [DONE]\n\n",
            headers={"content-type": "text/event-stream"},
        )

    backend = OpenAIBackend(States(), lambda m: None)
    backend.configure(
        merge_settings(
            Settings(),
            {
                "backend": "openai",
                "openai": {"baseUrl": "http://remote.invalid/v1", "fim": "template"},
            },
            warn=pytest.fail,
        )
    )
    backend.http = httpx.AsyncClient(
        base_url="http://remote.invalid/v1", transport=httpx.MockTransport(server)
    )
    ctx = context()
    if answered:
        assert (await backend.complete(ctx, NO_STOPS, key="k")).text == "x = 1"
    else:
        with pytest.raises(EngineUnavailable, match="maximum context length"):
            await backend.complete(ctx, NO_STOPS, key="k")
    assert len(prompts) == 2  # never more than one second try
    first, second = (p.split(FIM_PREFIX)[1].split("<|fim_suffix|>")[0] for p in prompts)
    assert ctx.prefix.endswith(second) and 0 < len(second) <= len(first) // 2 + 1
    # one request, retried once; the budget of the next ones fits a smaller context
    assert backend.counters == {"requests": 1, "errors": 0 if answered else 1, "context_retries": 1}
    assert backend.model_info["max_context"] == (819 if answered else 655)
    assert backend.state == "ready"  # not an outage
    await backend.http.aclose()


async def test_other_refusals_are_not_asked_again():
    requests = []

    def server(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/models"):
            return httpx.Response(200, json={"data": [{"id": "remote-coder"}]})
        requests.append(request)
        return httpx.Response(
            400, json={"error": {"message": "'temperature' must be a number", "code": 400}}
        )

    backend = OpenAIBackend(States(), lambda m: None)
    backend.configure(
        merge_settings(
            Settings(),
            {"backend": "openai", "openai": {"baseUrl": "http://remote.invalid/v1"}},
            warn=pytest.fail,
        )
    )
    backend.http = httpx.AsyncClient(
        base_url="http://remote.invalid/v1", transport=httpx.MockTransport(server)
    )
    with pytest.raises(EngineUnavailable, match="temperature"):
        await backend.complete(context(), NO_STOPS, key="k")
    assert len(requests) == 1 and backend.counters["context_retries"] == 0
    assert "max_context" not in backend.model_info
    await backend.http.aclose()
