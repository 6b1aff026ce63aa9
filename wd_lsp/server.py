"""The language server: inline completions (LSP 3.18) from editor context, served by the engine.

Every handler is async and awaits only cancellable things, so the event loop never blocks and
`$/cancelRequest` stops work (the engine request included). A newer completion request for a
document supersedes the older one even when the client never cancels it. While the user types,
the engine is warmed with the prompt at the cursor, so the completion that follows only computes
the few new tokens.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
import uuid
from collections import deque

from lsprotocol import types as T
from pygls.capabilities import ServerCapabilitiesBuilder
from pygls.lsp.server import LanguageServer

from engine.ipc.client import EngineError, EngineUnavailable

from . import __version__
from .config import Settings, merge_settings
from .context import Budget, build_context
from .engine_link import EngineLink
from .postprocess import postprocess
from .protocol import WdProtocol
from .shape import decide_shape
from .suggestions import SuggestionMemory
from .text import units_len
from .workspace import Workspace

log = logging.getLogger(__name__)

CMD_STATUS = "wdLsp.status"
CMD_RESTART = "wdLsp.restartEngine"
CMD_DOCUMENT_STATE = "wdLsp.documentState"
STATUS_NOTIFICATION = "wdLsp/status"
WARM_DELAY_S = 0.03  # let a burst of keystrokes settle before warming


class WdLanguageServer(LanguageServer):
    def __init__(self):
        super().__init__("wd-lsp", __version__, protocol_cls=WdProtocol)
        self.settings = Settings()
        self.docs = Workspace()
        self.memory = SuggestionMemory()
        self.engine = EngineLink(self._on_engine_state, self._on_engine_progress)
        self.instance = uuid.uuid4().hex[:8]
        self.inflight: dict[str, asyncio.Task] = {}  # uri -> running completion
        self.warming: dict[str, asyncio.Task] = {}
        self.latencies_ms: deque[float] = deque(maxlen=200)
        self.overheads_ms: deque[float] = deque(maxlen=200)  # request time not spent in the engine
        self.counters = dict(
            requests=0, engine_calls=0, typing_through=0, empty=0, superseded=0, errors=0, warms=0
        )
        self._progress_token: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._shown_start_error: str | None = None  # told in a message box: not again

    def configure_backend(self) -> None:
        """Use the backend the settings ask for: the engine daemon or an OpenAI-compatible
        server."""
        wanted = EngineLink
        if self.settings.backend == "openai":
            from .openai_backend import OpenAIBackend as wanted  # httpx is imported only when used
        if not isinstance(self.engine, wanted):
            self.engine.disconnect()
            self.engine = wanted(self._on_engine_state, self._on_engine_progress)
        self.engine.configure(self.settings)

    # -- status ---------------------------------------------------------------------------------
    def log(self, message: str, level: T.MessageType = T.MessageType.Info) -> None:
        log.log(logging.ERROR if level == T.MessageType.Error else logging.INFO, message)
        try:
            self.window_log_message(T.LogMessageParams(type=level, message=message))
        except Exception:  # noqa: BLE001 - no client (yet) to tell
            pass

    def _show_error(self, message: str) -> None:
        try:
            self.window_show_message(T.ShowMessageParams(type=T.MessageType.Error, message=message))
        except Exception:  # noqa: BLE001 - no client (yet) to tell
            pass

    def _notify_status(self, state: str, message: str) -> None:
        try:
            self.protocol.notify(
                STATUS_NOTIFICATION,
                {
                    "state": state,
                    "message": message,
                    "lastLatencyMs": self.latencies_ms[-1] if self.latencies_ms else None,
                },
            )
        except Exception:  # noqa: BLE001
            pass

    def _on_engine_state(self, state: str, message: str) -> None:
        level = T.MessageType.Error if state == "error" else T.MessageType.Info
        self.log(message, level)
        self._notify_status(state, message)
        if state == "ready":
            self._shown_start_error = None
        start_error = getattr(self.engine, "start_error", None)
        if state == "error" and start_error and start_error != self._shown_start_error:
            # A log line is easily missed, and completions stay empty until this is fixed:
            # a model that cannot load, or does not fit the GPU, is shown once.
            self._shown_start_error = start_error
            self._show_error(f"wd-lsp: the engine could not start: {start_error}")
        if state in ("ready", "error") and self._progress_token:
            self.work_done_progress.end(
                self._progress_token, T.WorkDoneProgressEnd(message=message)
            )
            self._progress_token = None

    def _on_engine_progress(self, message: str) -> None:
        # Called from the spawning thread: hop onto the loop.
        self._loop.call_soon_threadsafe(self._progress, message)

    def _progress(self, message: str) -> None:
        self._notify_status("loading", message)
        try:
            if self._progress_token is None:
                self._progress_token = f"wd-lsp-engine-{uuid.uuid4().hex[:6]}"
                self.work_done_progress.create(self._progress_token)
                self.work_done_progress.begin(
                    self._progress_token,
                    T.WorkDoneProgressBegin(title="wd-lsp engine", message=message),
                )
            else:
                self.work_done_progress.report(
                    self._progress_token, T.WorkDoneProgressReport(message=message)
                )
        except Exception:  # noqa: BLE001 - progress is a courtesy; some clients refuse it
            pass

    def status(self) -> dict:
        lat = sorted(self.latencies_ms)
        return dict(
            version=__version__,
            enabled=self.settings.enabled,
            engine=self.engine.state,
            engineError=getattr(self.engine, "error", None),
            model=(self.engine.model_info or {}).get("name"),
            lastLatencyMs=self.latencies_ms[-1] if lat else None,
            p50LatencyMs=lat[len(lat) // 2] if lat else None,
            typingThroughHits=self.memory.hits,
            p50OverheadMs=sorted(self.overheads_ms)[len(self.overheads_ms) // 2]
            if self.overheads_ms
            else None,
            **self.counters,
        )

    # -- completions ----------------------------------------------------------------------------
    async def inline_items(self, uri: str, position: T.Position) -> list[tuple[str, T.Position]]:
        """[(insert text, cursor position)] — at most one suggestion; [] when there is none."""
        started = time.monotonic()
        self.counters["requests"] += 1
        doc = self.docs.get(uri)
        s = self.settings
        if (
            doc is None
            or not s.enabled
            or not s.language_enabled(doc.language_id or doc.language.name)
        ):
            return []
        if doc.decline_reason:
            self.log(f"no completion for {uri}: file is {doc.decline_reason}")
            return []
        offset = doc.resolve(position).offset
        cursor = doc.position_at(offset)
        rest = self.memory.continue_from(uri, doc.text, offset)
        if rest is not None:
            self.counters["typing_through"] += 1
            self._record_latency(started)
            return [(rest, cursor)]
        previous = self.inflight.get(uri)
        if previous is not None and not previous.done():
            previous.cancel()
            self.counters["superseded"] += 1
        # The text this request is about: an edit during the debounce or the engine call makes
        # the answer stale (its offset and cursor would point into changed text).
        task = asyncio.ensure_future(self._complete_at(doc, offset, started, doc.generation))
        self.inflight[uri] = task
        try:
            text = await task
        except asyncio.CancelledError:
            if not task.done():
                task.cancel()
            if asyncio.current_task().cancelling():
                raise
            return []  # superseded by a newer request
        finally:
            if self.inflight.get(uri) is task:
                del self.inflight[uri]
        if not text:
            self.counters["empty"] += 1
            return []
        self.memory.remember(uri, doc.text[:offset], offset, text)
        return [(text, cursor)]

    async def _complete_at(self, doc, offset: int, started: float, generation: int) -> str | None:
        s = self.settings
        if s.debounce_ms:
            await asyncio.sleep(s.debounce_ms / 1000)
        if doc.generation != generation:
            return None  # typed over during the debounce: a newer request is on its way
        try:
            await (
                self.engine.ensure_connected()
            )  # the budget fits the model the engine says it serves
        except EngineUnavailable:
            self.counters["errors"] += 1
            return None
        ctx = build_context(
            doc,
            doc.position_at(offset),
            open_documents=self.docs.documents(),
            recent_edits=self.docs.recent_edits(),
            budget=self._budget(),
            root=self.docs.root,
        )
        rules = decide_shape(ctx, s.multiline, s.max_lines)
        self.counters["engine_calls"] += 1
        engine_started = time.monotonic()
        try:
            answer = await self.engine.complete(ctx, rules, key=f"{self.instance}:{doc.uri}")
        except EngineUnavailable:
            self.counters["errors"] += 1
            return None
        except EngineError as exc:
            self.counters["errors"] += 1
            self.log(f"completion failed: {exc}", T.MessageType.Warning)
            return None
        if doc.generation != generation:
            return None  # the document changed while we waited: the answer is for old text
        engine_s = time.monotonic() - engine_started
        text = postprocess(answer.text, ctx, rules)
        self._record_latency(started)
        self.overheads_ms.append(self.latencies_ms[-1] - 1000 * engine_s - s.debounce_ms)
        return text

    def _budget(self) -> Budget:
        """The context budget, fitted to the engine's model once it has said what its context is."""
        info = self.engine.model_info or {}
        context = info.get("max_context")
        return Budget().fitted(
            context if isinstance(context, int) else None, self.settings.max_tokens
        )

    def _record_latency(self, started: float) -> None:
        self.latencies_ms.append(1000 * (time.monotonic() - started))
        if self.engine.state == "ready":
            self._notify_status("ready", f"last completion {self.latencies_ms[-1]:.0f} ms")

    # -- speculative warm -----------------------------------------------------------------------
    def schedule_warm(self, uri: str, offset: int) -> None:
        s = self.settings
        doc = self.docs.get(uri)
        if not (s.enabled and s.warm_on_change and doc is not None and not doc.decline_reason):
            return
        if not s.language_enabled(doc.language_id or doc.language.name):
            return
        if self.engine.state not in ("ready", "idle"):
            return
        previous = self.warming.get(uri)
        if previous is not None and not previous.done():
            previous.cancel()
        self.warming[uri] = asyncio.ensure_future(self._warm(doc, offset))

    async def _warm(self, doc, offset: int) -> None:
        await asyncio.sleep(WARM_DELAY_S)
        if self.inflight.get(doc.uri) is not None:
            return  # a completion is on its way: it computes the same prompt
        try:
            await self.engine.ensure_connected()
            ctx = build_context(
                doc,
                doc.position_at(min(offset, len(doc.text))),
                open_documents=self.docs.documents(),
                recent_edits=self.docs.recent_edits(),
                budget=self._budget(),
                root=self.docs.root,
            )
            self.counters["warms"] += 1
            await self.engine.warm(ctx, key=f"{self.instance}:{doc.uri}")
        except (EngineUnavailable, EngineError):
            pass


server = WdLanguageServer()


@server.feature(T.INITIALIZE)
def on_initialize(ls: WdLanguageServer, params: T.InitializeParams):
    ls._loop = asyncio.get_event_loop()
    # pygls advertises this choice (the client's first offer among utf-8/16/32, else utf-16) in the
    # initialize result; every document counts its positions in it.
    chosen = ServerCapabilitiesBuilder.choose_position_encoding(params.capabilities)
    ls.docs.encoding = str(getattr(chosen, "value", chosen))
    ls.settings = merge_settings(
        ls.settings, params.initialization_options, warn=lambda m: ls.log(m, T.MessageType.Warning)
    )
    root = params.root_uri or (
        params.workspace_folders[0].uri if params.workspace_folders else None
    )
    if root:
        from .document import uri_to_path

        ls.docs.root = uri_to_path(root)
    ls.configure_backend()


@server.feature(T.INITIALIZED)
async def on_initialized(ls: WdLanguageServer, params: T.InitializedParams):
    ls._notify_status("disabled" if not ls.settings.enabled else "starting", "wd-lsp started")
    if ls.settings.enabled:
        asyncio.ensure_future(
            _connect_quietly(ls)
        )  # start loading the model before the first keystroke


async def _connect_quietly(ls: WdLanguageServer) -> None:
    try:
        await ls.engine.ensure_connected()
    except (EngineUnavailable, EngineError):
        pass


@server.feature(T.WORKSPACE_DID_CHANGE_CONFIGURATION)
def on_configuration(ls: WdLanguageServer, params: T.DidChangeConfigurationParams):
    ls.settings = merge_settings(
        ls.settings, params.settings, warn=lambda m: ls.log(m, T.MessageType.Warning)
    )
    ls.configure_backend()
    ls._notify_status(
        "disabled" if not ls.settings.enabled else ls.engine.state, "settings updated"
    )


@server.feature(T.TEXT_DOCUMENT_DID_OPEN)
def on_open(ls: WdLanguageServer, params: T.DidOpenTextDocumentParams):
    d = params.text_document
    ls.docs.open(d.uri, d.text, d.language_id, d.version)


@server.feature(T.TEXT_DOCUMENT_DID_CHANGE)
def on_change(ls: WdLanguageServer, params: T.DidChangeTextDocumentParams):
    uri, version = params.text_document.uri, params.text_document.version
    doc = None
    for change in params.content_changes:
        if isinstance(change, T.TextDocumentContentChangePartial):
            doc = ls.docs.change(uri, change.text, change.range.start, change.range.end, version)
        else:
            doc = ls.docs.change(uri, change.text, version=version)
    if doc is None:
        return
    last = params.content_changes[-1] if params.content_changes else None
    if isinstance(last, T.TextDocumentContentChangePartial) and doc.last_change is not None:
        # The cursor is (almost always) right after the inserted text.
        ls.schedule_warm(uri, doc.last_change.new_end)


@server.feature(T.TEXT_DOCUMENT_DID_CLOSE)
def on_close(ls: WdLanguageServer, params: T.DidCloseTextDocumentParams):
    ls.docs.close(params.text_document.uri)
    ls.memory.forget(params.text_document.uri)


@server.feature(T.TEXT_DOCUMENT_INLINE_COMPLETION, T.InlineCompletionOptions())
async def on_inline_completion(ls: WdLanguageServer, params: T.InlineCompletionParams):
    try:
        items = await ls.inline_items(params.text_document.uri, params.position)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - a completion bug must never break the editor
        log.exception("inline completion failed")
        ls.log(f"inline completion failed: {exc}", T.MessageType.Error)
        return T.InlineCompletionList(items=[])
    return T.InlineCompletionList(
        items=[
            T.InlineCompletionItem(insert_text=text, range=T.Range(start=pos, end=pos))
            for text, pos in items
        ]
    )


@server.feature(T.TEXT_DOCUMENT_COMPLETION, T.CompletionOptions(trigger_characters=[".", "(", " "]))
async def on_completion(ls: WdLanguageServer, params: T.CompletionParams):
    """For clients without inline completion: the suggestion as one completion item."""
    try:
        items = await ls.inline_items(params.text_document.uri, params.position)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001
        log.exception("completion failed")
        ls.log(f"completion failed: {exc}", T.MessageType.Error)
        items = []
    out = []
    for text, pos in items:
        first = text.split("\n", 1)[0].strip() or text.strip()
        out.append(
            T.CompletionItem(
                label=first[:60],
                kind=T.CompletionItemKind.Text,
                detail="wd-lsp",
                sort_text="0",
                filter_text=first,
                insert_text_format=T.InsertTextFormat.PlainText,
                text_edit=T.TextEdit(range=T.Range(start=pos, end=pos), new_text=text),
            )
        )
    return T.CompletionList(is_incomplete=True, items=out)


@server.command(CMD_STATUS)
async def cmd_status(ls: WdLanguageServer, *args):
    status = ls.status()
    try:
        status["engineStats"] = await ls.engine.stats()
    except (EngineUnavailable, EngineError):
        status["engineStats"] = {}
    return status


@server.command(CMD_RESTART)
async def cmd_restart(ls: WdLanguageServer, *args):
    ls.log("restarting the engine")
    try:
        await ls.engine.restart()
    except (EngineUnavailable, EngineError) as exc:
        return {"ok": False, "error": str(exc)}
    return {"ok": True, "engine": ls.engine.state}


@server.command(CMD_DOCUMENT_STATE)
async def cmd_document_state(ls: WdLanguageServer, *args):
    """The server's view of an open document, to compare with the editor's. Arguments: the uri,
    then optionally `true` to include the text. `length` is in the negotiated encoding's units;
    `sha256` is of the text's UTF-8 (a lone surrogate as its three-byte WTF-8 form)."""
    uri = args[0] if args and isinstance(args[0], str) else None
    doc = ls.docs.get(uri) if uri is not None else None
    if doc is None:
        return {"uri": uri, "open": False}
    state = dict(
        uri=uri,
        open=True,
        version=doc.version,
        encoding=doc.encoding,
        lineCount=doc.line_count,
        length=units_len(doc.text, doc.encoding),
        sha256=hashlib.sha256(doc.source_bytes).hexdigest(),
    )
    if len(args) > 1 and args[1] is True:
        state["text"] = doc.text
    return state


@server.feature(T.SHUTDOWN)
def on_shutdown(ls: WdLanguageServer, *args):
    # pygls cancels pending requests; a speculative warm is no request, and it would reconnect.
    for task in ls.warming.values():
        task.cancel()
    # Only drop our connection: the daemon stays resident for other editors until its idle timeout.
    ls.engine.disconnect()


@server.feature(T.EXIT)
def on_exit(ls: WdLanguageServer, *args):
    # `exit` may come without `shutdown`: drop the engine connection either way (a no-op if gone).
    ls.engine.disconnect()
