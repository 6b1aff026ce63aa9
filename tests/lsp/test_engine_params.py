"""What the server asks the engine for: beam search for single lines only, as configured, and
several completions (n) where a beam search runs; sampled extras without beams."""

import asyncio
from types import SimpleNamespace

import pytest

from engine.ipc.client import EngineError
from engine.ipc.protocol import FEATURES, CompletionParams
from wd_lsp.config import Settings, merge_settings
from wd_lsp.engine_link import EngineAnswer, EngineLink, Sampling
from wd_lsp.shape import StopRules


class RecordingClient:
    """Stands in for a current engine: its hello lists this release's features; it records the
    parameters and answers one line."""

    connected = False

    def __init__(self):
        self.params = []
        self.hello = {"model": {"name": "m"}, "features": list(FEATURES)}

    async def connect(self):
        self.connected = True
        return self.hello

    def disconnect(self):
        self.connected = False

    async def complete(self, params, reconnect=True):
        self.params.append(params)
        return OneLine()


class OneLine:
    result = {"finish_reason": "stop"}

    async def __aiter__(self):
        yield "x = 1"

    async def cancel(self):
        pass


def _link(settings: Settings, client: RecordingClient) -> EngineLink:
    """A link whose connection (and so the hello it reads) is `client`."""
    link = EngineLink(lambda *_: None, lambda *_: None)
    link.configure(settings)
    link._make_client = lambda: client
    return link


def _asked(settings: Settings, rules: StopRules) -> dict:
    client = RecordingClient()
    link = _link(settings, client)
    ctx = SimpleNamespace(prefix="def f():\n    ", suffix="\n", path="/p/a.py", chunks=())
    answer = asyncio.run(link.complete(ctx, rules, "doc"))
    assert answer.text == "x = 1"
    CompletionParams.from_params(client.params[0])  # the engine would accept it
    return client.params[0]


def test_single_lines_ask_for_beams_and_blocks_do_not():
    single = StopRules(multiline=False, stop_strings=("\n",))
    block = StopRules(multiline=True, max_lines=8)
    assert _asked(Settings(), single)["beams"] == 2  # the default
    assert "beams" not in _asked(Settings(), block)  # a block streams as greedy writes it
    greedy = merge_settings(Settings(), {"wdLsp": {"beams": 1}})
    assert "beams" not in _asked(greedy, single)
    assert _asked(merge_settings(Settings(), {"beams": 4}), single)["beams"] == 4


def test_bad_beam_settings_are_ignored_with_a_warning():
    warnings = []
    for bad in (0, 9, True, "4", 2.5):
        assert merge_settings(Settings(), {"beams": bad}, warnings.append).beams == 2
    assert len(warnings) == 5


class OldEngine(RecordingClient):
    """An engine daemon started by an older wd-lsp: its hello lists no features, and it refuses
    the 'beams' parameter."""

    def __init__(self):
        super().__init__()
        self.hello = {"model": {"name": "m"}}

    async def complete(self, params, reconnect=True):
        self.params.append(dict(params))
        if "beams" in params:
            raise EngineError("bad_request", "unknown parameters: beams")
        return OneLine()


def test_an_engine_that_predates_beams_gets_greedy_requests():
    """Decided from the hello, not from a refusal: such an engine is never sent beams."""
    engine = OldEngine()
    link = _link(Settings(), engine)
    ctx = SimpleNamespace(prefix="def f():\n    ", suffix="\n", path="/p/a.py", chunks=())
    single = StopRules(multiline=False, stop_strings=("\n",))
    for _ in range(2):
        assert asyncio.run(link.complete(ctx, single, "doc")).text == "x = 1"
    assert ["beams" in p for p in engine.params] == [False, False]


def test_a_beams_refusal_from_a_current_engine_is_an_error_not_a_fallback():
    """A current engine's "'beams' must be an integer in [1, 8]" is the client's error: it is
    raised, not taken for an engine without beams (no message text is read)."""
    engine = RecordingClient()
    link = _link(Settings(), engine)

    async def refuse(params, reconnect=True):
        engine.params.append(dict(params))
        raise EngineError("bad_request", "'beams' must be an integer in [1, 8]")

    engine.complete = refuse
    ctx = SimpleNamespace(prefix="def f():\n    ", suffix="\n", path="/p/a.py", chunks=())
    single = StopRules(multiline=False, stop_strings=("\n",))
    with pytest.raises(EngineError):
        asyncio.run(link.complete(ctx, single, "doc"))
    assert [p.get("beams") for p in engine.params] == [2]  # asked once, with beams, not retried


class SmallContextEngine:
    """Says on connecting that its model's context is 1,024 tokens; records what it is sent."""

    state = "ready"

    def __init__(self):
        self.model_info, self.contexts = None, []

    async def ensure_connected(self):
        self.model_info = {"name": "small", "max_context": 1024}

    async def complete(self, ctx, rules, key, n=1, sampling=None):
        self.contexts.append(ctx)
        return EngineAnswer("x = 1", False, None, None)


def test_the_first_request_already_fits_the_models_context():
    """The server connects before it cuts the context, so even its first request fits the model
    the engine serves, and the engine never cuts the prefix's start itself."""
    from wd_lsp.context import Budget
    from wd_lsp.server import WdLanguageServer
    from wd_lsp.workspace import Workspace

    server = WdLanguageServer()
    server.settings = merge_settings(Settings(), {"debounceMs": 0})
    server.engine = engine = SmallContextEngine()
    text = "".join(f"value_{i} = compute({i}, 'a fairly long argument')\n" for i in range(2000))
    server.docs = Workspace()
    doc = server.docs.open("file:///big.py", text, "python")
    asyncio.run(server._complete_at(doc, len(text) // 2, 0.0, doc.generation))
    fitted = Budget().fitted(1024, server.settings.max_tokens)
    (ctx,) = engine.contexts
    assert ctx.prefix_truncated and ctx.suffix_truncated
    assert ctx.prefix_tokens <= fitted.prefix_tokens < Budget().prefix_tokens
    assert len(ctx.prefix) <= fitted.prefix_tokens * fitted.chars_per_token


class Alternatives(RecordingClient):
    """A current engine whose result lists alternatives (and some junk, never taken on trust)."""

    async def complete(self, params, reconnect=True):
        self.params.append(params)
        answer = OneLine()
        answer.result = {"finish_reason": "stop", "alternatives": ["x = 2", 3, None, "x = 3"]}
        return answer


def test_several_completions_are_asked_for_with_beams_and_sampling_without():
    single = StopRules(multiline=False, stop_strings=("\n",))
    block = StopRules(multiline=True, max_lines=8)
    ctx = SimpleNamespace(prefix="def f():\n    ", suffix="\n", path="/p/a.py", chunks=())
    engine = Alternatives()
    link = _link(Settings(), engine)
    answer = asyncio.run(link.complete(ctx, single, "doc", n=3))
    assert answer.alternatives == ("x = 2", "x = 3")
    asyncio.run(link.complete(ctx, block, "doc", n=3))  # a block: no beams, so no n
    asyncio.run(link.complete(ctx, single, "doc", n=1))
    sampled = Sampling(temperature=0.8, top_p=0.95, seed=2)
    asyncio.run(link.complete(ctx, single, "doc#2", n=3, sampling=sampled))
    first, blockwise, one, sample = engine.params
    assert first["n"] == 3 and first["beams"] == 2
    assert "n" not in blockwise and "beams" not in blockwise and "n" not in one
    assert "beams" not in sample and "n" not in sample
    assert (sample["temperature"], sample["top_p"], sample["seed"]) == (0.8, 0.95, 2)
    for params in engine.params:
        CompletionParams.from_params(params)  # the engine would accept each
    # An engine that lists beams but not n (between the two releases) gets beams only.
    engine = Alternatives()
    engine.hello = {"model": {"name": "m"}, "features": ["beams"]}
    asyncio.run(_link(Settings(), engine).complete(ctx, single, "doc", n=3))
    assert engine.params[0]["beams"] == 2 and "n" not in engine.params[0]
