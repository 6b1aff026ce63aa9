"""Inline answers over the wire, through the real server (`python -m wd_lsp` over stdio), engine
daemon and embedded model: the items' shape, several distinct suggestions, a selected completion
item, the acceptance commands and their statistics, the manual trigger without the debounce, and
the engine's start-up as `$/progress`."""

import asyncio
import os
import sys
import time
from pathlib import Path

import pytest
from lsprotocol import types as T
from pytest_lsp import ClientServerConfig, LspSpecificationWarning

from engine.ipc.client import EngineClient
from engine.models import default_model_dir

PY = '''import os


def list_python_files(root):
    """Return the Python files under root."""
    result = []
    for name in sorted(os.listdir(root)):
        if name.endswith(".py"):
            result.append(os.path.jo)
    return result


def count_lines(path):
    with open(path) as f:
        return len(f.
'''
URI = "file:///project/tools.py"
LINES = PY.split("\n")
JOIN_LINE = 8  # "            result.append(os.path.jo)"
JOIN_AT = LINES[JOIN_LINE].index("jo") + 2  # the cursor after "jo"
# Spots that complete a single line (the beam search, which finds several lines).
SPOTS = [
    (JOIN_LINE, JOIN_AT),
    (14, len(LINES[14])),  # "        return len(f."
    (6, len("    for name in ")),
    (5, len("    result = ")),
]


def caps(progress=True):
    return T.ClientCapabilities(
        text_document=T.TextDocumentClientCapabilities(
            inline_completion=T.InlineCompletionClientCapabilities(),
            completion=T.CompletionClientCapabilities(),
            synchronization=T.TextDocumentSyncClientCapabilities(),
        ),
        window=T.WindowClientCapabilities(work_done_progress=progress),
    )


def environment(tmp: Path) -> dict:
    return dict(
        os.environ,
        WD_ENGINE_DIR=str(tmp / "run"),
        XDG_STATE_HOME=str(tmp / "state"),
        WD_LSP_MODEL=str(default_model_dir()),
        WD_ENGINE_IDLE_TIMEOUT="60",
    )


async def stop_engine(env):
    try:
        engine = EngineClient(socket_path=Path(env["WD_ENGINE_DIR"]) / "engine.sock")
        await engine.request("shutdown", timeout=10)
        await engine.close()
    except Exception:  # noqa: BLE001 - already gone
        pass


@pytest.fixture(scope="module")
def engine_env(tmp_path_factory):
    """One engine for the module's servers: it stays resident between them."""
    env = environment(tmp_path_factory.mktemp("engine"))
    yield env
    asyncio.run(stop_engine(env))


async def start(env, progress=True, **settings):
    client = await ClientServerConfig(
        server_command=[sys.executable, "-m", "wd_lsp"], server_env=env
    ).start()
    options = dict({"debounceMs": 0, "maxTokens": 24, "warmOnChange": False}, **settings)
    client.init_result = await client.initialize_session(
        T.InitializeParams(
            capabilities=caps(progress), initialization_options=options, root_uri="file:///project"
        )
    )
    return client


@pytest.fixture
async def lsp(engine_env):
    client = await start(engine_env)
    await wait_until_ready(client)
    open_doc(client)
    yield client
    await client.shutdown_session()


def open_doc(client, text=PY, uri=URI):
    client.text_document_did_open(
        T.DidOpenTextDocumentParams(
            text_document=T.TextDocumentItem(uri=uri, language_id="python", version=1, text=text)
        )
    )


def inline(client, line, character, kind=T.InlineCompletionTriggerKind.Automatic, selected=None):
    return client.text_document_inline_completion_async(
        T.InlineCompletionParams(
            text_document=T.TextDocumentIdentifier(uri=URI),
            position=T.Position(line=line, character=character),
            context=T.InlineCompletionContext(trigger_kind=kind, selected_completion_info=selected),
        )
    )


async def command(client, name, *arguments):
    return await client.workspace_execute_command_async(
        T.ExecuteCommandParams(command=name, arguments=list(arguments))
    )


async def status(client):
    return await command(client, "wdLsp.status")


async def wait_until_ready(client, limit_s=120.0):
    deadline = time.monotonic() + limit_s
    while (await status(client))["engine"] != "ready":
        assert time.monotonic() < deadline, "the engine did not become ready"
        await asyncio.sleep(0.1)


def item_ids(items):
    return [item.command.arguments[0]["id"] for item in items]


async def test_items_replace_the_line_head_and_several_are_distinct(lsp):
    caps = lsp.init_result.capabilities
    assert {"wdLsp.accepted", "wdLsp.shown"} <= set(caps.execute_command_provider.commands)
    counts = []
    for line, char in SPOTS:
        result = await inline(lsp, line, char)
        head = LINES[line][:char]
        texts = []
        for item in result.items:
            assert item.range == T.Range(
                start=T.Position(line=line, character=0),
                end=T.Position(line=line, character=char),
            )
            assert item.insert_text.startswith(head) and item.insert_text[len(head) :].strip()
            assert "\n" not in item.insert_text  # single-line spots
            texts.append(item.insert_text)
            assert item.command.command == "wdLsp.accepted"
            assert item.command.arguments[0]["kind"] == "full"
        assert len(set(texts)) == len(texts) <= 3
        assert len(set(item_ids(result.items))) == len(result.items)
        counts.append(len(result.items))
    assert max(counts) >= 2, counts  # the beam search finished other lines somewhere
    assert (await status(lsp))["suggestions"] == 3
    lsp.workspace_did_change_configuration(
        T.DidChangeConfigurationParams(settings={"wdLsp": {"suggestions": 1}})
    )
    for line, char in SPOTS:
        assert len((await inline(lsp, line, char)).items) <= 1


async def test_a_selected_completion_item_is_extended(lsp):
    # The menu has "join" selected over "jo": the suggestion continues "os.path.join".
    sel = T.SelectedCompletionInfo(
        range=T.Range(
            start=T.Position(line=JOIN_LINE, character=JOIN_AT - 2),
            end=T.Position(line=JOIN_LINE, character=JOIN_AT),
        ),
        text="join",
    )
    result = await inline(lsp, JOIN_LINE, JOIN_AT, selected=sel)
    assert result.items, "no suggestion after os.path.join"
    for item in result.items:
        assert item.insert_text.startswith("            result.append(os.path.join")
        assert item.range.start == T.Position(line=JOIN_LINE, character=0)
        assert item.range.end == T.Position(line=JOIN_LINE, character=JOIN_AT)
    # A selected item over the whole word, the cursor inside it: the items replace up to its end.
    inside = T.SelectedCompletionInfo(
        range=T.Range(
            start=T.Position(line=JOIN_LINE, character=JOIN_AT - 2),
            end=T.Position(line=JOIN_LINE, character=JOIN_AT),
        ),
        text="join",
    )
    result = await inline(lsp, JOIN_LINE, JOIN_AT - 1, selected=inside)
    for item in result.items:
        assert item.range.end == T.Position(line=JOIN_LINE, character=JOIN_AT)
        assert item.insert_text.startswith("            result.append(os.path.join")
    # One on another line does not fit: ignored, the answer is the plain one.
    elsewhere = T.SelectedCompletionInfo(
        range=T.Range(start=T.Position(line=1, character=0), end=T.Position(line=1, character=0)),
        text="x",
    )
    result = await inline(lsp, JOIN_LINE, JOIN_AT, selected=elsewhere)
    for item in result.items:
        assert item.insert_text.startswith("            result.append(os.path.jo")
        assert item.range.end == T.Position(line=JOIN_LINE, character=JOIN_AT)
    s = await status(lsp)
    assert s["selected"] == 2 and s["errors"] == 0


async def test_acceptance_statistics_count_each_item_once(lsp):
    items = []
    for line, char in SPOTS:
        items += (await inline(lsp, line, char)).items
        if len(items) >= 2:
            break
    assert len(items) >= 2
    first, second = item_ids(items[:2])
    assert (await command(lsp, "wdLsp.shown", {"id": first}))["counted"]
    assert not (await command(lsp, "wdLsp.shown", {"id": first}))["counted"]  # again: ignored
    assert (await command(lsp, "wdLsp.shown", {"id": second}))["counted"]
    assert (await command(lsp, "wdLsp.accepted", {"id": first, "kind": "word"}))["counted"]
    # What the editor runs on accepting the item: the item's own command.
    accept = items[0].command
    assert (await command(lsp, accept.command, *accept.arguments))["counted"]
    assert not (await command(lsp, accept.command, *accept.arguments))["counted"]
    for bad in ({"id": "unknown"}, {"kind": "full"}, "text", {"id": second, "kind": "all"}):
        assert not (await command(lsp, "wdLsp.accepted", bad))["counted"]
    assert not (await command(lsp, "wdLsp.shown"))["counted"]
    s = await status(lsp)
    assert s["acceptance"] == {
        "python": {"shown": 2, "accepted": 1, "partialWord": 1, "partialLine": 0}
    }


async def test_an_invoked_request_skips_the_debounce_and_samples_more(lsp):
    lsp.workspace_did_change_configuration(
        T.DidChangeConfigurationParams(
            settings={"wdLsp": {"debounce": "fixed", "debounceMs": 1500}}
        )
    )
    line, char = SPOTS[1]
    started = time.monotonic()
    first = await inline(lsp, line, char)
    assert time.monotonic() - started >= 1.5
    shown = {item.insert_text[char : char + 1] for item in first.items}
    typed = next(c for c in "QZXJ" if c not in shown)
    assert (await status(lsp))["lastDebounceMs"] == 1500
    lsp.text_document_did_change(  # no typing-through: another text at the cursor
        T.DidChangeTextDocumentParams(
            text_document=T.VersionedTextDocumentIdentifier(uri=URI, version=2),
            content_changes=[
                T.TextDocumentContentChangePartial(
                    range=T.Range(
                        start=T.Position(line=line, character=char),
                        end=T.Position(line=line, character=char),
                    ),
                    text=typed,
                )
            ],
        )
    )
    started = time.monotonic()
    result = await inline(lsp, line, char + 1, kind=T.InlineCompletionTriggerKind.Invoked)
    waited = time.monotonic() - started
    s = await status(lsp)
    assert s["lastDebounceMs"] == 0 and s["invoked"] == 1 and s["sampled"] == 2
    assert waited < 1.5 + 10  # never the debounce; bounded by the engine's answer
    texts = [item.insert_text for item in result.items]
    assert len(set(texts)) == len(texts) <= 3
    assert s["debounce"] == "fixed" and s["errors"] == 0


async def test_engine_start_progress_reaches_a_client_that_supports_it(tmp_path, recwarn):
    env = environment(tmp_path)  # no engine yet: the server starts one
    client = await start(env)
    try:
        open_doc(client)
        # The first completion waits for the loading engine (briefly) and answers.
        result = await inline(client, *SPOTS[0])
        assert isinstance(result.items, (list, tuple))
        await wait_until_ready(client)
        reports = {t: r for t, r in client.progress_reports.items() if r}
        assert len(reports) == 1, reports
        (values,) = reports.values()
        kinds = [v.kind for v in values]
        assert kinds[0] == "begin" and kinds[-1] == "end" and set(kinds[1:-1]) <= {"report"}
        assert values[0].title == "wd-lsp engine" and "engine" in values[0].message
        s = await status(client)
        assert s["engine"] == "ready" and s["engineMessage"]
        # The token was created before any progress used it.
        assert not [w for w in recwarn if issubclass(w.category, LspSpecificationWarning)]
    finally:
        await client.shutdown_session()
        await stop_engine(env)


async def test_no_progress_for_a_client_without_work_done_progress(tmp_path):
    env = environment(tmp_path)
    client = await start(env, progress=False)
    try:
        await wait_until_ready(client)
        assert client.progress_reports == {}
    finally:
        await client.shutdown_session()
        await stop_engine(env)


async def test_the_adaptive_debounce_follows_the_typing(lsp):
    assert (await status(lsp))["debounce"] == "adaptive"
    line, char = SPOTS[2]
    await inline(lsp, line, char)
    assert (await status(lsp))["lastDebounceMs"] == 0  # no typing seen yet: debounceMs
    typed = "zq_items"  # nothing the model suggests: no typing-through
    for version, c in enumerate(typed, start=2):  # typed fast, a key every 20 ms or so
        at = T.Position(line=line, character=char + version - 2)
        lsp.text_document_did_change(
            T.DidChangeTextDocumentParams(
                text_document=T.VersionedTextDocumentIdentifier(uri=URI, version=version),
                content_changes=[
                    T.TextDocumentContentChangePartial(range=T.Range(start=at, end=at), text=c)
                ],
            )
        )
        await asyncio.sleep(0.02)
    await inline(lsp, line, char + len(typed), kind=T.InlineCompletionTriggerKind.Automatic)
    s = await status(lsp)
    # About one and a half keystrokes (or the engine's time, if less), never the cap.
    assert 0 < s["lastDebounceMs"] < 400 and s["errors"] == 0
