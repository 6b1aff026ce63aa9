"""One simulated editor: a language server process, one document, one typed segment.

Every request is recorded with the keystroke it answers, when its answer (or the probe's note of
the engine's first token) came, and what the user would have seen. Outcomes:
`shown` (non-empty ghost text for the current text), `empty`, `cancelled` (the editor cancelled
it), `stale` (answered after the text moved on: not shown), `error`.
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from dataclasses import asdict, dataclass

from .editors import EditorStyle
from .lsp_client import LspClient, LspError
from .probe_server import NOTIFICATION
from .script import Cadence, Key, Segment, keystrokes, utf16_len

SERVER_COMMAND = [sys.executable, "-m", "wd_lsp.bench.probe_server"]
ROOT_URI = "file:///bench"
REQUEST_CANCELLED = -32800


@dataclass
class RequestRecord:
    editor: str
    segment: str
    version: int
    typed_chars: int  # chars of the segment typed when the request was made
    context_chars: int  # chars before the cursor
    key_at: float  # monotonic time of the keystroke this request answers
    sent_at: float
    answer_at: float | None = None
    outcome: str = "pending"
    text: str = ""
    truth: str = ""  # what the user actually types next (for would-accept), first 400 chars
    first_token_at: float | None = None  # from the probe: None when no engine call answered
    usage: dict | None = None
    engine_ms: float | None = None  # server -> engine -> server, from the probe
    engine_first_token_ms: float | None = (
        None  # server's engine call -> first token, from the probe
    )
    deltas: int = 0  # streamed deltas (about one per token) and the seconds from first to last
    decode_s: float | None = None
    error: str | None = None

    @property
    def ghost_ms(self) -> float | None:
        return None if self.answer_at is None else 1000 * (self.answer_at - self.key_at)

    @property
    def first_token_ms(self) -> float | None:
        return None if self.first_token_at is None else 1000 * (self.first_token_at - self.key_at)

    @property
    def request_first_token_ms(self) -> float | None:
        """From the editor's request (after its own debounce) to the first token."""
        return None if self.first_token_at is None else 1000 * (self.first_token_at - self.sent_at)

    def as_dict(self) -> dict:
        return dict(
            asdict(self),
            ghost_ms=self.ghost_ms,
            first_token_ms=self.first_token_ms,
            request_first_token_ms=self.request_first_token_ms,
        )


async def replay_one(
    segment: Segment,
    style: EditorStyle,
    cadence: Cadence,
    init_options: dict,
    env: dict,
    seed: int = 0,
    stderr_path: str | None = None,
) -> tuple[list[RequestRecord], dict]:
    """A fresh editor types one segment: (records, the server's wdLsp.status at the end)."""
    editor = Editor(style, cadence, init_options, env, seed, stderr_path)
    try:
        await editor.start()
        records = await editor.type_segment(segment)
        return records, await editor.status()
    finally:
        await editor.close()


class Editor:
    """One editor window: a language server process it talks to, documents typed one by one."""

    def __init__(
        self,
        style: EditorStyle,
        cadence: Cadence,
        init_options: dict,
        env: dict,
        seed: int = 0,
        stderr_path: str | None = None,
    ):
        self.style, self.cadence = style, cadence
        self.init_options, self.env, self.stderr_path = init_options, env, stderr_path
        self.rng = random.Random(seed)
        self.records: list[RequestRecord] = []
        self.open: dict[int, tuple[RequestRecord, asyncio.Future]] = {}  # msg id -> request
        self.by_version: dict[tuple[str, int], RequestRecord] = {}
        self._timer: asyncio.TimerHandle | None = None
        self.client: LspClient | None = None

    async def start(self) -> None:
        self.client = await LspClient.start(SERVER_COMMAND, self.env, self.stderr_path)
        self.client.on_notification = self._on_notification
        await self.client.initialize(self.init_options, ROOT_URI)
        await self._wait_engine_ready()

    async def status(self) -> dict:
        return (
            await self.client.request(
                "workspace/executeCommand", {"command": "wdLsp.status", "arguments": []}
            )
            or {}
        )

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()

    async def _wait_engine_ready(self, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if (await self.status()).get("engine") == "ready":
                return
            await asyncio.sleep(0.1)
        raise RuntimeError("the language server did not reach the engine")

    async def type_segment(self, segment: Segment) -> list[RequestRecord]:
        """Open the segment's document, type it, wait for the last answers, close it."""
        first = len(self.records)
        self.segment = segment
        self.typed_docs = getattr(self, "typed_docs", 0) + 1
        self.uri = f"{ROOT_URI}/{self.typed_docs}/{segment.name}"  # a new document each time
        self.version, self.typed = 1, 0
        self.line, self.character = segment.before.count("\n"), 0
        self.key_at = 0.0
        self.client.notify(
            "textDocument/didOpen",
            {
                "textDocument": {
                    "uri": self.uri,
                    "languageId": "python",
                    "version": self.version,
                    "text": segment.before + segment.after,
                }
            },
        )
        await self._type(keystrokes(segment, self.cadence, self.rng))
        await self._settle()
        if self._timer is not None:
            self._timer.cancel()
        self.client.notify("textDocument/didClose", {"textDocument": {"uri": self.uri}})
        return self.records[first:]

    # -- typing ---------------------------------------------------------------------------------
    async def _type(self, keys: list[Key]) -> None:
        at = time.monotonic()
        for key in keys:
            at += key.delay_ms / 1000  # an absolute schedule: slow handling doesn't slow the typist
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            if key.text:
                self._press(key.text)

    def _press(self, text: str) -> None:
        start = {"line": self.line, "character": self.character}
        self.version += 1
        self.typed += len(text)
        if "\n" in text:
            self.line += text.count("\n")
            self.character = utf16_len(text.rsplit("\n", 1)[1])
        else:
            self.character += utf16_len(text)
        self.key_at = self.client.notify(
            "textDocument/didChange",
            {
                "textDocument": {"uri": self.uri, "version": self.version},
                "contentChanges": [{"range": {"start": start, "end": start}, "text": text}],
            },
        )
        if self.style.debounce_ms:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = asyncio.get_running_loop().call_later(
                self.style.debounce_ms / 1000, self._ask
            )
        else:
            self._ask()

    def _ask(self) -> None:
        if self.style.cancels_previous:
            for msg_id, (record, _) in list(self.open.items()):
                record.outcome = "cancelled"
                self.client.cancel(msg_id)
        record = RequestRecord(
            editor=self.style.name,
            segment=self.segment.name,
            version=self.version,
            typed_chars=self.typed,
            context_chars=len(self.segment.before) + self.typed,
            key_at=self.key_at,
            sent_at=0.0,
            truth=self.segment.truth_after(self.typed)[:400],
        )
        msg_id, future = self.client.send_request(
            "textDocument/inlineCompletion",
            {
                "textDocument": {"uri": self.uri},
                "position": {"line": self.line, "character": self.character},
                "context": {"triggerKind": 2},
            },
        )  # Automatic
        record.sent_at = time.monotonic()
        self.records.append(record)
        self.by_version[(self.uri, self.version)] = record
        self.open[msg_id] = (record, future)
        future.add_done_callback(lambda f, m=msg_id: self._on_answer(m, f))

    def _on_answer(self, msg_id: int, future: asyncio.Future) -> None:
        record, _ = self.open.pop(msg_id)
        try:
            result, at = future.result()
        except LspError as exc:
            record.answer_at = time.monotonic()
            if record.outcome != "cancelled":
                record.outcome = "cancelled" if exc.code == REQUEST_CANCELLED else "error"
                record.error = str(exc)
            return
        except ConnectionError as exc:
            record.outcome, record.error = "error", str(exc)
            return
        record.answer_at = at
        if record.outcome == "cancelled":
            return  # answered after the cancel was sent: the editor ignores it
        items = (result or {}).get("items", []) if isinstance(result, dict) else (result or [])
        text = items[0].get("insertText", "") if items else ""
        text = text if isinstance(text, str) else text.get("value", "")
        record.text = text
        if record.version != self.version or record.segment != self.segment.name:
            record.outcome = "stale"
        else:
            record.outcome = "shown" if text else "empty"

    def _on_notification(self, method: str, params: dict, at: float) -> None:
        if method != NOTIFICATION:
            return
        record = self.by_version.get((params.get("uri"), params.get("version")))
        if record is None:
            return
        record.first_token_at = params.get("firstTokenAt")
        record.usage = params.get("usage")
        if params.get("submittedAt") and params.get("doneAt"):
            record.engine_ms = 1000 * (params["doneAt"] - params["submittedAt"])
        record.deltas, record.decode_s = params.get("deltas") or 0, params.get("decodeS")
        if params.get("submittedAt") and params.get("firstTokenAt"):
            record.engine_first_token_ms = 1000 * (params["firstTokenAt"] - params["submittedAt"])

    async def _settle(self, timeout_s: float = 60.0) -> None:
        """Wait for the last answers (nothing is cancelled at the end: the user stopped typing)."""
        deadline = time.monotonic() + timeout_s
        while self.open and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for record, _ in self.open.values():
            record.outcome, record.error = "error", "no answer"
