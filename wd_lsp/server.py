"""The language server: inline completions (LSP 3.18) from editor context, served by the engine.

Every handler is async and awaits only cancellable things, so the event loop never blocks and
`$/cancelRequest` stops work (the engine request included). A newer completion request for a
document supersedes the older one even when the client never cancels it. While the user types,
the engine is warmed with the prompt at the cursor, so the completion that follows only computes
the few new tokens.

An inline answer holds up to `suggestions` distinct items, best first (`wd_lsp.answer` has their
shape; each carries the `wdLsp.accepted` command with its ID, `wd_lsp.acceptance`). Where they
come from:
- every inline request asks the engine for `suggestions` completions; a beam search (a single
  line on the CPU engine) returns the other lines it finished, within a margin of the best, for
  a few more beam steps (engine.decoding.beam_search);
- a request the user asked for (trigger kind Invoked: a manual trigger, or an editor asking for
  more to cycle through) also samples `suggestions - 1` completions beside it. Requests made while
  typing never do: the extra sequences would slow the first suggestion (on the CPU the engine
  computes every row, and a lone greedy sequence is the one it speculates on).
The texts are post-processed, then empty and repeated ones dropped.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
import uuid
from collections import deque
from dataclasses import dataclass

from lsprotocol import types as T
from pygls.capabilities import ServerCapabilitiesBuilder
from pygls.lsp.server import LanguageServer

from engine.ipc.client import EngineError, EngineUnavailable

from . import __version__
from .acceptance import AcceptanceStats, command_argument
from .answer import Selected, distinct, select_item, with_selected
from .config import Settings, merge_settings
from .context import Budget, build_context
from .debounce import Debounce
from .engine_link import EngineLink, Sampling
from .postprocess import postprocess
from .progress import EngineProgress
from .protocol import WdProtocol
from .shape import decide_shape
from .suggestions import SuggestionMemory
from .text import units_len
from .workspace import Workspace

log = logging.getLogger(__name__)

CMD_STATUS = "wdLsp.status"
CMD_RESTART = "wdLsp.restartEngine"
CMD_DOCUMENT_STATE = "wdLsp.documentState"
CMD_ACCEPTED = "wdLsp.accepted"
CMD_SHOWN = "wdLsp.shown"
STATUS_NOTIFICATION = "wdLsp/status"
WARM_DELAY_S = 0.03  # let a burst of keystrokes settle before warming
# The extra suggestions of an Invoked request: sampled, reproducibly (seeds 1, 2, ...).
SAMPLE_TEMPERATURE, SAMPLE_TOP_P = 0.8, 0.95


@dataclass
class Answer:
    """Suggestions at a cursor, and what an item replaces: the line from its start to `end`
    (the cursor, or the end of a selected completion item's range), which reads `head`."""

    cursor: T.Position
    end: T.Position
    head: str
    suggestions: list[tuple[str, str | None]]  # (text, acceptance ID), best first

    def inline_items(self) -> list[T.InlineCompletionItem]:
        start = T.Position(line=self.end.line, character=0)
        return [
            T.InlineCompletionItem(
                insert_text=self.head + text,
                range=T.Range(start=start, end=self.end),
                command=None
                if item_id is None
                else T.Command(
                    title="wd-lsp accepted",
                    command=CMD_ACCEPTED,
                    arguments=[{"id": item_id, "kind": "full"}],
                ),
            )
            for text, item_id in self.suggestions
        ]


class WdLanguageServer(LanguageServer):
    def __init__(self):
        super().__init__("wd-lsp", __version__, protocol_cls=WdProtocol)
        self.settings = Settings()
        self.docs = Workspace()
        self.memory = SuggestionMemory()
        self.acceptance = AcceptanceStats()
        self.debounce = Debounce()
        self.engine = EngineLink(self._on_engine_state, self._on_engine_progress)
        self.instance = uuid.uuid4().hex[:8]
        self.inflight: dict[str, asyncio.Task] = {}  # uri -> running completion
        self.warming: dict[str, asyncio.Task] = {}
        self.latencies_ms: deque[float] = deque(maxlen=200)
        self.overheads_ms: deque[float] = deque(maxlen=200)  # request time not spent in the engine
        self.counters = dict(
            requests=0,
            engine_calls=0,
            typing_through=0,
            empty=0,
            superseded=0,
            errors=0,
            warms=0,
            invoked=0,
            sampled=0,
            selected=0,
        )
        self.progress = EngineProgress(
            lambda method, params: self.protocol.send_request(method, params),
            lambda method, params: self.protocol.notify(method, params),
        )
        self.engine_message: str | None = None  # the last thing the engine's state said
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
        self.engine_message = message
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
        if state in ("ready", "error"):
            self.progress.end(message)

    def _on_engine_progress(self, message: str) -> None:
        # Called from the spawning thread: hop onto the loop.
        self._loop.call_soon_threadsafe(self._progress, message)

    def _progress(self, message: str) -> None:
        self.engine_message = message
        self._notify_status("loading", message)
        if self.engine.state != "ready":  # else a late message: its progress has ended
            self.progress.report(message)

    def status(self) -> dict:
        lat = sorted(self.latencies_ms)
        return dict(
            version=__version__,
            enabled=self.settings.enabled,
            engine=self.engine.state,
            engineError=getattr(self.engine, "error", None),
            engineMessage=self.engine_message,
            model=(self.engine.model_info or {}).get("name"),
            lastLatencyMs=self.latencies_ms[-1] if lat else None,
            p50LatencyMs=lat[len(lat) // 2] if lat else None,
            typingThroughHits=self.memory.hits,
            p50OverheadMs=sorted(self.overheads_ms)[len(self.overheads_ms) // 2]
            if self.overheads_ms
            else None,
            debounce=self.settings.debounce,
            lastDebounceMs=self.debounce.last_wait_ms,
            suggestions=self.settings.suggestions,
            acceptance=self.acceptance.summary(),
            **self.counters,
        )

    # -- completions ----------------------------------------------------------------------------
    async def answer(
        self,
        uri: str,
        position: T.Position,
        *,
        n: int = 1,
        invoked: bool = False,
        selected=None,
    ) -> Answer | None:
        """Up to `n` suggestions at `position`, best first, each with an acceptance ID; None when
        there is none. `selected`: a selected completion item (`selectedCompletionInfo`), ignored
        where it does not fit."""
        started = time.monotonic()
        self.counters["requests"] += 1
        self.counters["invoked"] += invoked
        doc = self.docs.get(uri)
        s = self.settings
        if (
            doc is None
            or not s.enabled
            or not s.language_enabled(doc.language_id or doc.language.name)
        ):
            return None
        if doc.decline_reason:
            self.log(f"no completion for {uri}: file is {doc.decline_reason}")
            return None
        offset = doc.resolve(position).offset
        cursor = _lsp_position(doc.position_at(offset))
        line_start = doc.line_start(doc.line_at(offset))
        sel = select_item(doc, offset, selected) if selected is not None else None
        if sel is not None:
            self.counters["selected"] += 1
            answer = Answer(cursor, _lsp_position(doc.position_at(sel.end)), sel.head, [])
        else:
            answer = Answer(cursor, cursor, doc.text[line_start:offset], [])
            # An Invoked request asks for fresh suggestions (a manual trigger, or more to cycle).
            rests = [] if invoked else self.memory.continue_from(uri, doc.text, offset)
            if rests:
                self.counters["typing_through"] += 1
                self._record_latency(started)
                answer.suggestions = rests[:n]
                return answer
        previous = self.inflight.get(uri)
        if previous is not None and not previous.done():
            previous.cancel()
            self.counters["superseded"] += 1
        # The text this request is about: an edit during the debounce or the engine call makes
        # the answer stale (its offset and cursor would point into changed text).
        task = asyncio.ensure_future(
            self._complete_at(doc, offset, started, doc.generation, n, invoked, sel)
        )
        self.inflight[uri] = task
        try:
            texts = await task
        except asyncio.CancelledError:
            if not task.done():
                task.cancel()
            if asyncio.current_task().cancelling():
                raise
            return None  # superseded by a newer request
        finally:
            if self.inflight.get(uri) is task:
                del self.inflight[uri]
        if not texts:
            self.counters["empty"] += 1
            return None
        language = doc.language_id or doc.language.name
        answer.suggestions = [(text, self.acceptance.issue(language)) for text in texts]
        if sel is None:
            self.memory.remember(uri, doc.text[:offset], offset, answer.suggestions)
        return answer

    async def _complete_at(
        self,
        doc,
        offset: int,
        started: float,
        generation: int,
        n: int = 1,
        invoked: bool = False,
        sel: Selected | None = None,
    ) -> list[str] | None:
        s = self.settings
        wait_s = self.debounce.remaining_s(doc.uri, s.debounce, s.debounce_ms, invoked)
        if wait_s > 0:
            await asyncio.sleep(wait_s)
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
            doc.position_at(sel.end if sel is not None else offset),
            open_documents=self.docs.documents(),
            recent_edits=self.docs.recent_edits(),
            budget=self._budget(),
            root=self.docs.root,
        )
        if sel is not None:
            ctx = with_selected(ctx, sel)
            if ctx is None:
                return None  # the item's range lies before the prompt's start
        rules = decide_shape(ctx, s.multiline, s.max_lines)
        self.counters["engine_calls"] += 1
        key = f"{self.instance}:{doc.uri}"
        calls = [self.engine.complete(ctx, rules, key=key, n=n)]
        if invoked and n > 1:
            self.counters["sampled"] += n - 1
            calls += [
                self.engine.complete(
                    ctx,
                    rules,
                    key=f"{key}#sample{seed}",
                    sampling=Sampling(SAMPLE_TEMPERATURE, SAMPLE_TOP_P, seed),
                )
                for seed in range(1, n)
            ]
        engine_started = time.monotonic()
        answers = await asyncio.gather(*calls, return_exceptions=True)
        main = answers[0]
        if isinstance(main, EngineUnavailable):
            self.counters["errors"] += 1
            return None
        if isinstance(main, EngineError):
            self.counters["errors"] += 1
            self.log(f"completion failed: {main}", T.MessageType.Warning)
            return None
        if isinstance(main, BaseException):
            raise main
        if doc.generation != generation:
            return None  # the document changed while we waited: the answer is for old text
        engine_s = time.monotonic() - engine_started
        self.debounce.engine_took(1000 * engine_s)
        found = [main.text, *main.alternatives]
        found += [a.text for a in answers[1:] if not isinstance(a, BaseException)]
        texts = distinct(postprocess(text, ctx, rules) for text in found)[:n]
        self._record_latency(started)
        self.overheads_ms.append(self.latencies_ms[-1] - 1000 * engine_s - 1000 * max(wait_s, 0.0))
        return texts

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


def _lsp_position(pos) -> T.Position:
    return T.Position(line=pos.line, character=pos.character)


server = WdLanguageServer()


@server.feature(T.INITIALIZE)
def on_initialize(ls: WdLanguageServer, params: T.InitializeParams):
    ls._loop = asyncio.get_event_loop()
    # pygls advertises this choice (the client's first offer among utf-8/16/32, else utf-16) in the
    # initialize result; every document counts its positions in it.
    chosen = ServerCapabilitiesBuilder.choose_position_encoding(params.capabilities)
    ls.docs.encoding = str(getattr(chosen, "value", chosen))
    window = params.capabilities.window
    ls.progress.supported = bool(window is not None and window.work_done_progress)
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
    ls.debounce.edited(uri)
    last = params.content_changes[-1] if params.content_changes else None
    if isinstance(last, T.TextDocumentContentChangePartial) and doc.last_change is not None:
        # The cursor is (almost always) right after the inserted text.
        ls.schedule_warm(uri, doc.last_change.new_end)


@server.feature(T.TEXT_DOCUMENT_DID_CLOSE)
def on_close(ls: WdLanguageServer, params: T.DidCloseTextDocumentParams):
    ls.docs.close(params.text_document.uri)
    ls.memory.forget(params.text_document.uri)
    ls.debounce.forget(params.text_document.uri)


@server.feature(T.TEXT_DOCUMENT_INLINE_COMPLETION, T.InlineCompletionOptions())
async def on_inline_completion(ls: WdLanguageServer, params: T.InlineCompletionParams):
    context = params.context
    invoked = context is not None and context.trigger_kind == T.InlineCompletionTriggerKind.Invoked
    selected = context.selected_completion_info if context is not None else None
    try:
        answer = await ls.answer(
            params.text_document.uri,
            params.position,
            n=ls.settings.suggestions,
            invoked=invoked,
            selected=selected,
        )
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - a completion bug must never break the editor
        log.exception("inline completion failed")
        ls.log(f"inline completion failed: {exc}", T.MessageType.Error)
        return T.InlineCompletionList(items=[])
    return T.InlineCompletionList(items=answer.inline_items() if answer is not None else [])


@server.feature(T.TEXT_DOCUMENT_COMPLETION, T.CompletionOptions(trigger_characters=[".", "(", " "]))
async def on_completion(ls: WdLanguageServer, params: T.CompletionParams):
    """For clients without inline completion: the suggestion as one completion item."""
    try:
        answer = await ls.answer(params.text_document.uri, params.position)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001
        log.exception("completion failed")
        ls.log(f"completion failed: {exc}", T.MessageType.Error)
        answer = None
    out = []
    for text, _ in answer.suggestions if answer is not None else ():
        pos = answer.cursor
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


@server.command(CMD_ACCEPTED)
def cmd_accepted(ls: WdLanguageServer, *args):
    """An item was accepted: [{"id": ID, "kind": "full" | "word" | "line"}] (kind "full" if
    left out). Counted once per item and kind; anything else is ignored."""
    arg = command_argument(args)
    if arg is None:
        log.debug("wdLsp.accepted without a map argument: ignored")
        return {"counted": False}
    return {"counted": ls.acceptance.accepted(arg.get("id"), arg.get("kind", "full"))}


@server.command(CMD_SHOWN)
def cmd_shown(ls: WdLanguageServer, *args):
    """An item was displayed: [{"id": ID}]. Counted once per item."""
    arg = command_argument(args)
    if arg is None:
        log.debug("wdLsp.shown without a map argument: ignored")
        return {"counted": False}
    return {"counted": ls.acceptance.shown(arg.get("id"))}


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
