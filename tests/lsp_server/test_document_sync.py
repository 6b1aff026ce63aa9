"""Document sync through the real server process, in every position encoding.

The property test drives `python -m wd_lsp` over its stdio with raw JSON-RPC (no engine) and,
after every `didChange`, compares the server's text (`wdLsp.documentState`) with a reference
model of LSP semantics written here. In-process tests check that the encoding used is the one
pygls advertises and that pygls keeps no copy of the documents. The end-to-end tests use the real
engine: ranges in UTF-8 units for a client that asks for them, and a completion in a document
with a lone surrogate.
"""

import asyncio
import copy
import hashlib
import itertools
import json
import os
import queue
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lsprotocol import types as T
from pytest_lsp import ClientServerConfig

from engine.ipc.client import EngineClient
from engine.models import default_model_dir

# ---- the reference model: LSP semantics, the slow and obvious way ----------------------------

LINE_END = re.compile(r"\r\n|\r|\n")  # nothing else ends a line in LSP
CODECS = {"utf-8": ("utf-8", 1), "utf-16": ("utf-16-le", 2), "utf-32": ("utf-32-le", 4)}


def ref_units(s: str, encoding: str) -> int:
    codec, width = CODECS[encoding]
    return len(s.encode(codec, "surrogatepass")) // width  # a lone surrogate: 3 bytes, 1 unit


def ref_lines(text: str) -> list[tuple[int, int]]:
    """(start, end of content) of each line."""
    spans, start = [], 0
    for m in LINE_END.finditer(text):
        spans.append((start, m.start()))
        start = m.end()
    return spans + [(start, len(text))]


def ref_offset(text: str, line: int, character: int, encoding: str) -> int:
    """A position past the last line is the end of the text; a character past the line's end is
    the line's end; one inside a character rounds down to that character's start."""
    spans = ref_lines(text)
    if line >= len(spans):
        return len(text)
    start, end = spans[line]
    column, i = 0, start
    while i < end and column + ref_units(text[i], encoding) <= character:
        column += ref_units(text[i], encoding)
        i += 1
    return i


# ---- a minimal synchronous LSP client over the server's stdio -------------------------------

REPLY_TIMEOUT_S = 60


class StdioClient:
    def __init__(self, env: dict, log_path):
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "wd_lsp"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=env,
        )
        self._inbox: queue.Queue = queue.Queue()
        self._ids = itertools.count(1)
        threading.Thread(target=self._read_forever, daemon=True).start()

    def _read_forever(self) -> None:
        out = self.proc.stdout
        while True:
            length = None
            while (line := out.readline()) not in (b"\r\n", b""):
                name, _, value = line.decode("ascii").partition(":")
                if name.lower() == "content-length":
                    length = int(value)
            if not line or length is None:
                self._inbox.put(None)  # the server closed its output
                return
            self._inbox.put(json.loads(out.read(length)))

    def _send(self, message: dict) -> None:
        # json.dumps escapes non-ASCII, so a lone surrogate travels as "\udc00", as JSON allows
        body = json.dumps({"jsonrpc": "2.0", **message}).encode("ascii")
        self.proc.stdin.write(b"Content-Length: %d\r\n\r\n" % len(body) + body)
        self.proc.stdin.flush()

    def notify(self, method: str, params) -> None:
        self._send({"method": method, "params": params})

    def request(self, method: str, params):
        msg_id = next(self._ids)
        self._send({"id": msg_id, "method": method, "params": params})
        while True:
            msg = self._inbox.get(timeout=REPLY_TIMEOUT_S)
            assert msg is not None, f"the server exited with {self.proc.wait(5)}"
            if "method" in msg and "id" in msg:  # a request from the server: accept it
                self._send({"id": msg["id"], "result": None})
            elif msg.get("id") == msg_id:
                assert "error" not in msg, msg["error"]
                return msg["result"]

    def close(self) -> None:
        self.request("shutdown", None)
        self.notify("exit", None)
        self.proc.wait(10)
        self._log.close()


# ---- the property test ------------------------------------------------------------------------

# Client capabilities per encoding: the client's first offer wins; saying nothing means UTF-16.
OFFERS = {"utf-8": ["utf-8", "utf-16"], "utf-16": None, "utf-32": ["utf-32", "utf-8"]}
NO_ENGINE = {"enabled": False, "warmOnChange": False, "engine": {"autoStart": False}}
PIECES = [
    "a",
    "bc",
    " ",
    "\t",
    "é",
    "中",
    "😀",
    "𝔘",
    "\n",
    "\r",
    "\r\n",
    "\f",
    "\v",
    "\u2028",
    "\u2029",
    "\u0085",
    "\x1c",
    "\udc00",
]  # only low surrogates: JSON never pairs them up
TEXT = st.lists(st.sampled_from(PIECES), max_size=12).map("".join)
NOTIFICATIONS = 10  # per example, each with several changes
MAX_CHANGES = 16
EXAMPLES = 180
EDITS_PER_ENCODING = 10_000  # in each encoding


@pytest.fixture(scope="module", params=list(OFFERS))
def sync_server(request, tmp_path_factory):
    encoding = request.param
    tmp = tmp_path_factory.mktemp(f"sync-{encoding}")
    env = dict(os.environ, WD_ENGINE_DIR=str(tmp / "run"), XDG_STATE_HOME=str(tmp / "state"))
    client = StdioClient(env, tmp / "server.log")
    general = {"positionEncodings": OFFERS[encoding]} if OFFERS[encoding] else {}
    result = client.request(
        "initialize",
        {
            "processId": None,
            "rootUri": None,
            "capabilities": {"general": general},
            "initializationOptions": NO_ENGINE,
        },
    )
    assert result["capabilities"]["positionEncoding"] == encoding
    client.notify("initialized", {})
    yield client, encoding
    client.close()


def draw_position(data, text: str, encoding: str, lines=None) -> dict:
    """Any line up to two past the last; any character up to two past the line's end."""
    spans = ref_lines(text)
    line = data.draw(st.integers(0, len(spans) + 1) if lines is None else lines)
    width = ref_units(text[slice(*spans[line])], encoding) if line < len(spans) else 0
    return {"line": line, "character": data.draw(st.integers(0, width + 2))}


def draw_change(data, text: str, encoding: str) -> tuple[dict, str]:
    """One content change and the reference text after it."""
    if data.draw(st.integers(0, 19)) == 0:
        new_text = data.draw(TEXT)
        return {"text": new_text}, new_text
    start = draw_position(data, text, encoding)
    if data.draw(st.booleans()):
        end = start  # an insertion, the common case
    else:
        end = draw_position(data, text, encoding, st.integers(start["line"], start["line"] + 2))
    lo, hi = (ref_offset(text, p["line"], p["character"], encoding) for p in (start, end))
    if lo > hi:
        (start, lo), (end, hi) = (end, hi), (start, lo)
    inserted = data.draw(TEXT)
    change = {"range": {"start": start, "end": end}, "text": inserted}
    return change, text[:lo] + inserted + text[hi:]


def check_state(client: StdioClient, uri: str, text: str, version: int, encoding: str) -> None:
    state = client.request(
        "workspace/executeCommand", {"command": "wdLsp.documentState", "arguments": [uri, True]}
    )
    expected = dict(
        open=True,
        version=version,
        encoding=encoding,
        text=text,
        lineCount=len(ref_lines(text)),
        length=ref_units(text, encoding),
        sha256=hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest(),
    )
    assert {key: state.get(key) for key in expected} == expected


def test_server_text_equals_the_reference_after_every_change(sync_server):
    client, encoding = sync_server
    uris = (f"file:///sync/{encoding}/{n}.txt" for n in itertools.count())
    edits = 0

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(st.data())
    def run(data):
        nonlocal edits
        uri, text = next(uris), data.draw(TEXT)
        client.notify(
            "textDocument/didOpen",
            {"textDocument": {"uri": uri, "languageId": "plaintext", "version": 0, "text": text}},
        )
        check_state(client, uri, text, 0, encoding)
        for version in range(1, NOTIFICATIONS + 1):
            changes = []
            for _ in range(data.draw(st.integers(1, MAX_CHANGES))):
                change, text = draw_change(data, text, encoding)
                changes.append(change)
            client.notify(
                "textDocument/didChange",
                {"textDocument": {"uri": uri, "version": version}, "contentChanges": changes},
            )
            edits += len(changes)
            check_state(client, uri, text, version, encoding)
        client.notify("textDocument/didClose", {"textDocument": {"uri": uri}})

    run()
    print(f"{encoding}: {edits} edits, 0 mismatches")
    assert edits >= EDITS_PER_ENCODING


def test_document_state_of_an_unknown_document(sync_server):
    client, _ = sync_server
    state = client.request(
        "workspace/executeCommand",
        {"command": "wdLsp.documentState", "arguments": ["file:///never/opened.txt"]},
    )
    assert state == {"uri": "file:///never/opened.txt", "open": False}


class InProcess:
    """The server module's own instance, driven message by message without a process."""

    def __init__(self, server):
        self.server, self.proto, self.sent = server, server.protocol, []
        self.proto.set_writer(self, include_headers=False)

    def write(self, data):
        self.sent.append(json.loads(data))

    def close(self):
        pass

    def handle(self, **fields):
        message = self.proto.structure_message({"jsonrpc": "2.0", **fields})
        self.proto.handle_message(message)
        return message

    def initialize(self, offer):
        general = {"positionEncodings": offer} if offer is not None else {}
        self.handle(
            id=len(self.sent) + 1,
            method="initialize",
            params={
                "processId": None,
                "rootUri": None,
                "capabilities": {"general": general},
                "initializationOptions": NO_ENGINE,
            },
        )
        return self.sent[-1]["result"]["capabilities"]["positionEncoding"]


@pytest.fixture
def in_process():
    from wd_lsp.server import server
    from wd_lsp.workspace import Workspace

    saved = server.docs, server.settings
    server.docs = Workspace()
    yield InProcess(server)
    server.docs, server.settings = saved


@pytest.mark.parametrize(
    "offer, chosen",
    [
        (["utf-8", "utf-16"], "utf-8"),
        (["utf-32", "utf-8"], "utf-32"),
        (["utf-16", "utf-8"], "utf-16"),
        (["utf-7", "utf-32"], "utf-32"),
        (["utf-7"], "utf-16"),
        ([], "utf-16"),
        (None, "utf-16"),
    ],
)
async def test_the_encoding_used_is_the_one_advertised(in_process, offer, chosen):
    assert in_process.initialize(offer) == chosen
    assert in_process.server.docs.encoding == chosen
    in_process.handle(
        method="textDocument/didOpen",
        params={
            "textDocument": {
                "uri": "file:///a.txt",
                "languageId": "plaintext",
                "version": 1,
                "text": "x",
            }
        },
    )
    assert in_process.server.docs.get("file:///a.txt").encoding == chosen


async def test_pygls_keeps_no_copy_and_leaves_the_params_alone(in_process):
    """The change reaches our handler as the client sent it, and pygls' own workspace (which
    splits lines by `str.splitlines`) never holds the document."""
    assert in_process.initialize(["utf-8"]) == "utf-8"
    uri = "file:///inproc.txt"
    in_process.handle(
        method="textDocument/didOpen",
        params={
            "textDocument": {
                "uri": uri,
                "languageId": "plaintext",
                "version": 1,
                "text": "é😀\fz\n",
            }
        },
    )
    after_emoji = {"line": 0, "character": 6}  # é is 2 bytes, 😀 4
    params = {
        "textDocument": {"uri": uri, "version": 2},
        "contentChanges": [{"range": {"start": after_emoji, "end": after_emoji}, "text": "x"}],
    }
    change = in_process.handle(method="textDocument/didChange", params=copy.deepcopy(params))
    assert in_process.proto._converter.unstructure(change.params) == params
    assert in_process.server.docs.get(uri).text == "é😀x\fz\n"
    assert not in_process.proto.workspace.text_documents


# ---- end to end with the engine ---------------------------------------------------------------

PY = (
    """import os


def count_lines(path):
    with open(path) as f:
        return len(f.readlines())


class Counter:
    def __init__(self):
        self.total = 0

    def add(self, n):
"""
    + " " * 8  # the cursor's line: indented, empty
    + "\n"
)
CAPS = dict(
    text_document=T.TextDocumentClientCapabilities(
        inline_completion=T.InlineCompletionClientCapabilities(),
        completion=T.CompletionClientCapabilities(),
        synchronization=T.TextDocumentSyncClientCapabilities(),
    ),
    window=T.WindowClientCapabilities(work_done_progress=True),
)


@pytest.fixture(scope="module")
def engine_env(tmp_path_factory):
    """One engine for the module's servers: it stays resident between them."""
    tmp = tmp_path_factory.mktemp("engine")
    env = dict(
        os.environ,
        WD_ENGINE_DIR=str(tmp / "run"),
        XDG_STATE_HOME=str(tmp / "state"),
        WD_LSP_MODEL=str(default_model_dir()),
        WD_ENGINE_IDLE_TIMEOUT="60",
    )
    yield env

    async def stop():
        try:
            engine = EngineClient(socket_path=Path(env["WD_ENGINE_DIR"]) / "engine.sock")
            await engine.request("shutdown", timeout=10)
            await engine.close()
        except Exception:  # noqa: BLE001 - already gone
            pass

    asyncio.run(stop())


async def start_client(env, encodings=None):
    client = await ClientServerConfig(
        server_command=[sys.executable, "-m", "wd_lsp"], server_env=env
    ).start()
    general = T.GeneralClientCapabilities(position_encodings=encodings) if encodings else None
    client.init_result = await client.initialize_session(
        T.InitializeParams(
            capabilities=T.ClientCapabilities(general=general, **CAPS),
            initialization_options={"debounceMs": 0, "maxTokens": 24, "warmOnChange": False},
            root_uri="file:///project",
        )
    )
    return client


def open_doc(client, uri, text):
    client.text_document_did_open(
        T.DidOpenTextDocumentParams(
            text_document=T.TextDocumentItem(uri=uri, language_id="python", version=1, text=text)
        )
    )


def inline(client, uri, line, character):
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


async def wait_for_engine(client):
    """The server connects at `initialized`; completions are empty while the model loads."""
    for _ in range(1200):  # loading imports torch: slow on a busy CI machine
        if (await status(client))["engine"] == "ready":
            return
        await asyncio.sleep(0.1)
    raise AssertionError("the engine did not become ready")


async def test_utf8_client_gets_ranges_in_bytes(engine_env):
    client = await start_client(
        engine_env, [T.PositionEncodingKind.Utf8, T.PositionEncodingKind.Utf16]
    )
    try:
        assert client.init_result.capabilities.position_encoding == "utf-8"
        uri = "file:///project/counter.py"
        # The cursor line has non-ASCII text before the cursor; the method header gets some too.
        last = '        label = "añadir 😀"; self.total += n  # ñ'
        body = "    def add(self, n):  # 中\n" + last + "\n        "
        text = PY.replace("    def add(self, n):\n        \n", body)
        open_doc(client, uri, text)
        await wait_for_engine(client)
        line = text.count("\n")  # the cursor: the end of the text
        # An edit in UTF-8 units: replace "ñ" (2 bytes) at the end of the line before the cursor's.
        column = len(last.encode()) - 2
        client.text_document_did_change(
            T.DidChangeTextDocumentParams(
                text_document=T.VersionedTextDocumentIdentifier(uri=uri, version=2),
                content_changes=[
                    T.TextDocumentContentChangePartial(
                        range=T.Range(
                            start=T.Position(line=line - 1, character=column),
                            end=T.Position(line=line - 1, character=column + 2),
                        ),
                        text="n",
                    )
                ],
            )
        )
        text = text.replace("# ñ\n", "# n\n")
        state = await client.workspace_execute_command_async(
            T.ExecuteCommandParams(command="wdLsp.documentState", arguments=[uri, True])
        )
        assert state["text"] == text and state["encoding"] == "utf-8"

        # The completion's range is where the cursor is, in bytes: a request past the line's end
        # clamps to it, and comes back in bytes too.
        assert (await inline(client, uri, line, 8)).items, "no completion in a method body"
        text = text + "x = 'ü'"  # a line whose bytes and UTF-16 units differ
        after_indent = T.Position(line=line, character=8)
        client.text_document_did_change(
            T.DidChangeTextDocumentParams(
                text_document=T.VersionedTextDocumentIdentifier(uri=uri, version=3),
                content_changes=[
                    T.TextDocumentContentChangePartial(
                        range=T.Range(start=after_indent, end=after_indent), text="x = 'ü'"
                    )
                ],
            )
        )
        cursor = T.Position(line=line, character=8 + len("x = 'ü'".encode()))
        result = await inline(client, uri, line, 500)
        for item in result.items:
            # From the line's start to the cursor (in bytes), the line's head first in the text.
            assert item.range.start == T.Position(line=line, character=0)
            assert item.range.end == cursor and item.insert_text.startswith("        x = 'ü'")
        completion = await client.text_document_completion_async(
            T.CompletionParams(
                text_document=T.TextDocumentIdentifier(uri=uri),
                position=T.Position(line=line, character=500),
            )
        )
        for item in completion.items:
            assert item.text_edit.range.start == cursor
        assert result.items and completion.items
        assert (await status(client))["errors"] == 0
    finally:
        await client.shutdown_session()


@pytest.mark.parametrize("where", ["text", "uri"])
async def test_lone_surrogate_in_the_document_still_completes(engine_env, where):
    client = await start_client(engine_env)
    try:
        if where == "text":
            uri = "file:///project/surrogate.py"
            text = PY.replace("import os\n", 'import os\n\nMARK = "\ud800"\n')
        else:  # the key the engine schedules by holds the uri: the request must still be sent
            uri, text = "file:///project/surr\udc80ogate.py", PY
        open_doc(client, uri, text)
        state = await client.workspace_execute_command_async(
            T.ExecuteCommandParams(command="wdLsp.documentState", arguments=[uri, True])
        )
        assert state["text"] == text  # the server keeps what the client sent
        await wait_for_engine(client)
        end = T.Position(line=text.count("\n"), character=0)  # PY ends with a line break
        result = await inline(client, uri, end.line, end.character)
        assert result.items and result.items[0].insert_text.strip()
        assert result.items[0].range.start == result.items[0].range.end == end
        s = await status(client)
        assert s["errors"] == 0 and s["engine_calls"] >= 1
    finally:
        await client.shutdown_session()
