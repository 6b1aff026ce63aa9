"""The language server end to end over stdio, with the real engine daemon and the embedded model."""

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest
from lsprotocol import types as T
from pytest_lsp import ClientServerConfig

from engine.ipc.client import EngineClient
from engine.models import default_model_dir

PY = (
    '''import os


def list_python_files(root):
    """Return the Python files under root."""
    result = []
    for name in sorted(os.listdir(root)):
        if name.endswith(".py"):
            result.append(os.path.join(root, name))
    return result


def count_lines(path):
    with open(path) as f:
        return len(f.readlines())


class Counter:
    def __init__(self):
        self.total = 0

    def add(self, n):
'''
    + " " * 8  # the cursor's line: indented, empty
    + "\n"
)
URI = "file:///project/tools.py"
CAPS = T.ClientCapabilities(
    text_document=T.TextDocumentClientCapabilities(
        inline_completion=T.InlineCompletionClientCapabilities(),
        completion=T.CompletionClientCapabilities(),
        synchronization=T.TextDocumentSyncClientCapabilities(),
    ),
    window=T.WindowClientCapabilities(work_done_progress=True),
)


@pytest.fixture
async def lsp(tmp_path):
    env = dict(
        os.environ,
        WD_ENGINE_DIR=str(tmp_path / "run"),
        XDG_STATE_HOME=str(tmp_path / "state"),
        WD_LSP_MODEL=str(default_model_dir()),
        WD_ENGINE_IDLE_TIMEOUT="30",
    )
    client = await ClientServerConfig(
        server_command=[sys.executable, "-m", "wd_lsp"], server_env=env
    ).start()
    client.test_env = env
    result = await client.initialize_session(
        T.InitializeParams(
            capabilities=CAPS,
            initialization_options={"debounceMs": 0, "maxTokens": 24},
            root_uri="file:///project",
        )
    )
    client.init_result = result
    await wait_until_ready(client)
    yield client
    await client.shutdown_session()
    await _stop_engine(env)


def engine_at(env) -> EngineClient:
    """A client of the engine the server under test uses (it never starts one)."""
    return EngineClient(socket_path=Path(env["WD_ENGINE_DIR"]) / "engine.sock")


async def _stop_engine(env):
    try:
        engine = engine_at(env)
        await engine.request("shutdown", timeout=10)
        await engine.close()
    except Exception:  # noqa: BLE001 - already gone
        pass


async def engine_pid(env):
    engine = engine_at(env)
    pid = (await engine.request("health", timeout=10))["pid"]
    await engine.close()
    return pid


def open_doc(client, text=PY, uri=URI, language="python"):
    client.text_document_did_open(
        T.DidOpenTextDocumentParams(
            text_document=T.TextDocumentItem(uri=uri, language_id=language, version=1, text=text)
        )
    )


def inline(client, line, character, uri=URI):
    return client.text_document_inline_completion_async(
        T.InlineCompletionParams(
            text_document=T.TextDocumentIdentifier(uri=uri),
            position=T.Position(line=line, character=character),
            context=T.InlineCompletionContext(trigger_kind=T.InlineCompletionTriggerKind.Automatic),
        )
    )


async def status(client):
    return await client.workspace_execute_command_async(
        T.ExecuteCommandParams(command="wdLsp.status")
    )


async def wait_until_ready(client, limit_s=120.0):
    """Completions wait for a loading model only up to the request timeout: start once it has
    loaded."""
    deadline = asyncio.get_running_loop().time() + limit_s
    while (await status(client))["engine"] != "ready":
        assert asyncio.get_running_loop().time() < deadline, "the engine did not become ready"
        await asyncio.sleep(0.1)


def end_of_text(text):
    lines = text.split("\n")
    return len(lines) - 1, len(lines[-1])


async def test_capabilities_advertise_inline_completion(lsp):
    caps = lsp.init_result.capabilities
    assert caps.inline_completion_provider is not None
    assert caps.completion_provider is not None
    assert caps.text_document_sync.change == T.TextDocumentSyncKind.Incremental
    assert "wdLsp.status" in caps.execute_command_provider.commands


async def test_inline_completions_at_several_positions(lsp):
    open_doc(lsp)
    line, char = end_of_text(PY)
    positions = [(line, char), (9, 4), (13, 8), (15, 0)]
    got_text = 0
    for line, char in positions:
        result = await inline(lsp, line, char)
        head = PY.split("\n")[line][:char]
        for item in result.items:
            # The item replaces the line's head with itself plus the suggestion.
            assert item.range.start == T.Position(line=line, character=0)
            assert item.range.end == T.Position(line=line, character=char)
            assert isinstance(item.insert_text, str) and item.insert_text.startswith(head)
            assert item.insert_text[len(head) :].strip()
            assert "\ufffd" not in item.insert_text
            got_text += 1
    assert got_text >= 2  # a trained model completes most of these spots
    s = await status(lsp)
    assert s["engine"] == "ready" and s["engine_calls"] >= len(positions)


async def test_typing_through_needs_no_engine_call(lsp):
    open_doc(lsp)
    line, char = end_of_text(PY)
    first = await inline(lsp, line, char)
    assert first.items, "the model had nothing to say at the end of a method header"
    head = PY.split("\n")[line][:char]
    suggestion = first.items[0].insert_text[len(head) :]
    calls = (await status(lsp))["engine_calls"]
    lsp.text_document_did_change(
        T.DidChangeTextDocumentParams(
            text_document=T.VersionedTextDocumentIdentifier(uri=URI, version=2),
            content_changes=[
                T.TextDocumentContentChangePartial(
                    range=T.Range(
                        start=T.Position(line=line, character=char),
                        end=T.Position(line=line, character=char),
                    ),
                    text=suggestion[0],
                )
            ],
        )
    )
    second = await inline(lsp, line, char + 1)
    # The same suggestion, shorter, with the same acceptance ID.
    assert second.items and second.items[0].insert_text == head + suggestion
    assert second.items[0].command == first.items[0].command
    s = await status(lsp)
    assert s["engine_calls"] == calls and s["typingThroughHits"] >= 1


async def test_cancel_and_supersede(lsp):
    open_doc(lsp)
    line, char = end_of_text(PY)
    await inline(lsp, 13, 8)  # the engine is up
    params = T.InlineCompletionParams(
        text_document=T.TextDocumentIdentifier(uri=URI),
        position=T.Position(line=line, character=char),
        context=T.InlineCompletionContext(trigger_kind=T.InlineCompletionTriggerKind.Automatic),
    )
    # An explicit $/cancelRequest: the server answers RequestCancelled and frees the engine's work.
    pending = asyncio.wrap_future(
        lsp.protocol.send_request("textDocument/inlineCompletion", params, msg_id="to-cancel")
    )
    await asyncio.sleep(0.05)
    lsp.protocol.notify("$/cancelRequest", T.CancelParams(id="to-cancel"))
    try:
        result = await pending
        assert isinstance(
            result.items, (list, tuple)
        )  # it may have finished before the cancel arrived
    except Exception as exc:  # noqa: BLE001
        assert "cancel" in str(exc).lower()
    # A newer request for the same document supersedes an older one nobody cancelled (as Neovim
    # does): the older gets an empty answer, never an error.
    older = asyncio.ensure_future(inline(lsp, 13, 8))
    await asyncio.sleep(0.01)
    newer = await inline(lsp, line, char)
    assert isinstance((await older).items, (list, tuple))
    assert isinstance(newer.items, (list, tuple))
    s = await status(lsp)
    assert s["engine"] == "ready" and s["superseded"] + s["typing_through"] >= 1


async def test_plain_completion_for_clients_without_inline(lsp):
    open_doc(lsp)
    line, char = end_of_text(PY)
    result = await lsp.text_document_completion_async(
        T.CompletionParams(
            text_document=T.TextDocumentIdentifier(uri=URI),
            position=T.Position(line=line, character=char),
        )
    )
    assert result.is_incomplete
    for item in result.items:
        assert item.text_edit.range.start == T.Position(line=line, character=char)


async def test_huge_binary_and_invalid_positions_are_handled(lsp):
    huge = "x = 1\n" * (5 * 1024 * 1024 // 6)
    open_doc(lsp, huge, uri="file:///project/huge.py")
    assert not (await inline(lsp, 10, 0, uri="file:///project/huge.py")).items
    open_doc(lsp, "abc\x00\x01\x02def\n" * 100, uri="file:///project/blob.py")
    assert not (await inline(lsp, 1, 2, uri="file:///project/blob.py")).items
    open_doc(lsp)
    result = await inline(lsp, 10_000, 500)  # past the end: clamped to the end of the file
    for item in result.items:
        assert item.range.start.line == end_of_text(PY)[0]
    assert not (await inline(lsp, 0, 0, uri="file:///never/opened.py")).items
    assert (await status(lsp))["engine"] == "ready"  # the server is still fine


async def test_disabled_by_configuration(lsp):
    open_doc(lsp)
    lsp.workspace_did_change_configuration(
        T.DidChangeConfigurationParams(settings={"wdLsp": {"enabled": False}})
    )
    line, char = end_of_text(PY)
    assert not (await inline(lsp, line, char)).items
    lsp.workspace_did_change_configuration(
        T.DidChangeConfigurationParams(settings={"wdLsp": {"enabled": True, "bogus": 1}})
    )
    assert (await status(lsp))["enabled"] is True


async def test_engine_killed_mid_request_gives_empty_then_recovers(lsp):
    open_doc(lsp)
    line, char = end_of_text(PY)
    await inline(lsp, line, char)  # the engine is up
    pid = await engine_pid(lsp.test_env)
    pending = asyncio.ensure_future(inline(lsp, 13, 8))
    os.kill(pid, signal.SIGKILL)
    result = await pending
    assert isinstance(result.items, (list, tuple))
    # The server restarts the engine by itself; requests answer again.
    for _ in range(600):  # a respawn imports torch and loads the model: slow on a busy CI machine
        if (await status(lsp))["engine"] == "ready":
            break
        await asyncio.sleep(0.1)
    assert (await status(lsp))["engine"] == "ready"
    calls = (await status(lsp))["engine_calls"]
    result = await inline(lsp, 9, 4)
    assert (
        isinstance(result.items, (list, tuple)) and (await status(lsp))["engine_calls"] == calls + 1
    )
    assert await engine_pid(lsp.test_env) != pid


async def test_suggestions_inside_auto_closed_brackets_keep_the_line_balanced(lsp):
    # One edit per document: an unclosed bracket elsewhere would legitimately allow a closer.
    cases = [
        (
            "            result.append(os.path.join(root, name))",
            "            result.append(os.path.join()",
            "join(",
        ),
        ("        return len(f.readlines())", "        return len(f.read())", "len("),
    ]
    for n, (old, new, before_cursor) in enumerate(cases):
        text = PY.replace(old, new)  # the editor auto-closed "(" after the user typed it
        uri = f"file:///project/brackets{n}.py"
        open_doc(lsp, text, uri=uri)
        lines = text.split("\n")
        line = next(i for i, l in enumerate(lines) if l == new)
        char = new.index(before_cursor) + len(before_cursor)
        result = await inline(lsp, line, char, uri=uri)
        for item in result.items:
            completed = item.insert_text.split("\n")[0] + lines[line][char:]
            # No suggestion closes what the rest of the line (or the auto-closed ")") closes.
            assert completed.count("(") >= completed.count(")"), completed
