"""Inline answers inside the server, with a stand-in engine: the items' shape (the line's head
replaced with itself plus the suggestion), several distinct suggestions best first, sampled extras
only for a request the user asked for, a selected completion item applied (or ignored where it
does not fit), typing-through over every suggestion, and the settings."""

import asyncio
from types import SimpleNamespace

import pytest
from lsprotocol import types as T

from wd_lsp.answer import distinct, select_item, with_selected
from wd_lsp.config import Settings, merge_settings
from wd_lsp.context import build_context
from wd_lsp.document import UTF16, Document
from wd_lsp.engine_link import EngineAnswer
from wd_lsp.server import CMD_ACCEPTED, SAMPLE_TEMPERATURE, Answer, WdLanguageServer
from wd_lsp.workspace import Workspace

TEXT = "import os\n\n\ndef main(path):\n    names = os.lis\n    return names\n"
LINE = 4  # "    names = os.lis"
CURSOR = T.Position(line=LINE, character=len("    names = os.lis"))


def selected(start: int, end: int, text: str, line: int = LINE):
    return T.SelectedCompletionInfo(
        range=T.Range(
            start=T.Position(line=line, character=start), end=T.Position(line=line, character=end)
        ),
        text=text,
    )


# -- a selected completion item ---------------------------------------------------------------


def test_a_selected_item_replaces_its_range_on_the_cursor_line():
    doc = Document("file:///a.py", TEXT, "python")
    cursor = doc.offset_at(CURSOR)
    # The word before the cursor ("lis") is replaced by the item's "listdir".
    sel = select_item(doc, cursor, selected(15, 18, "listdir"))
    assert sel.head == "    names = os.listdir" and sel.end == cursor and sel.replaced == 3
    # A range past the cursor (the whole word, cursor inside it): the answer replaces it all.
    text = TEXT.replace("os.lis\n", "os.lisdir\n")
    doc = Document("file:///a.py", text, "python")
    sel = select_item(
        doc, doc.offset_at(T.Position(line=LINE, character=18)), selected(15, 21, "listdir")
    )
    assert sel.head == "    names = os.listdir" and doc.position_at(sel.end).character == 21
    # The cursor past the range: what lies between stays.
    doc = Document("file:///a.py", TEXT, "python")
    sel = select_item(doc, cursor, selected(12, 14, "sys"))
    assert sel.head == "    names = sys.lis" and sel.applied == "sys.lis"


@pytest.mark.parametrize(
    "info",
    [
        selected(0, 3, "foo", line=3),  # another line
        selected(15, 12, "x"),  # ends before it starts
        selected(15, 18, "list\ndir"),  # a line break in its text
        selected(15, 99, "listdir"),  # past the line's end
        selected(19, 19, "x"),  # past the cursor (the line's end)
        T.SelectedCompletionInfo(
            range=T.Range(
                start=T.Position(line=4, character=15), end=T.Position(line=5, character=1)
            ),
            text="x",
        ),  # over two lines
    ],
)
def test_a_selected_item_that_does_not_fit_is_ignored(info):
    doc = Document("file:///a.py", TEXT, "python")
    assert select_item(doc, doc.offset_at(CURSOR), info) is None


def test_a_selected_item_starting_after_the_cursor_is_ignored():
    doc = Document("file:///a.py", TEXT, "python")
    cursor = doc.offset_at(T.Position(line=LINE, character=10))
    assert select_item(doc, cursor, selected(15, 18, "listdir")) is None


def test_a_selected_item_counts_positions_in_the_negotiated_encoding():
    text = "s = '😀' + na\n"
    doc = Document("file:///a.py", text, "python", encoding=UTF16)
    end = len("s = '😀' + na") + 1  # the emoji is two UTF-16 units
    cursor = doc.offset_at(T.Position(line=0, character=end))
    sel = select_item(doc, cursor, selected(end - 2, end, "name", line=0))
    assert sel.head == "s = '😀' + name"
    # Inside the surrogate pair: not a position of this text.
    assert select_item(doc, cursor, selected(6, end, "x", line=0)) is None


def test_the_context_sees_the_selected_item_applied():
    doc = Document("file:///a.py", TEXT, "python")
    sel = select_item(doc, doc.offset_at(CURSOR), selected(15, 18, "listdir"))
    ctx = with_selected(build_context(doc, doc.position_at(sel.end)), sel)
    assert (
        ctx.prefix.endswith("    names = os.listdir")
        and ctx.line_prefix == "    names = os.listdir"
    )
    assert ctx.suffix.startswith("\n    return names")


def test_distinct_keeps_the_order_and_drops_empty_and_repeated_texts():
    assert distinct(["a", None, "b", "", "a", "  ", "c", "b"]) == ["a", "b", "c"]


# -- the answer ---------------------------------------------------------------------------------


def test_items_replace_the_line_head_and_carry_the_accept_command():
    answer = Answer(
        T.Position(line=3, character=6),
        T.Position(line=3, character=6),
        "    x.",
        [("foo()", "id-1"), ("bar", "id-2")],
    )
    first, second = answer.inline_items()
    assert first.range == T.Range(
        start=T.Position(line=3, character=0), end=T.Position(line=3, character=6)
    )
    assert first.insert_text == "    x.foo()" and second.insert_text == "    x.bar"
    assert first.command.command == CMD_ACCEPTED
    assert first.command.arguments == [{"id": "id-1", "kind": "full"}]
    assert second.command.arguments == [{"id": "id-2", "kind": "full"}]


class StandIn:
    """An engine that answers with given texts and records what it is asked."""

    state = "ready"
    model_info = {"name": "stand-in", "max_context": 4096}

    def __init__(self, text="dir(path)", alternatives=("dir(path)", "dir()", "   ", "walk(path)")):
        self.text, self.alternatives, self.calls = text, tuple(alternatives), []

    async def ensure_connected(self):
        return self

    async def complete(self, ctx, rules, key, n=1, sampling=None):
        self.calls.append(SimpleNamespace(ctx=ctx, key=key, n=n, sampling=sampling))
        if sampling is not None:
            return EngineAnswer(f"dir(path)[{sampling.seed}:]", False, None, None)
        return EngineAnswer(self.text, False, None, None, self.alternatives)


def server_with(engine, text=TEXT, **settings):
    server = WdLanguageServer()
    server.settings = merge_settings(Settings(), dict({"debounceMs": 0}, **settings))
    server.engine = engine
    server.docs = Workspace()
    server.docs.open("file:///a.py", text, "python")
    return server


def ask(server, position=CURSOR, **kw):
    kw.setdefault("n", server.settings.suggestions)
    return asyncio.run(server.answer("file:///a.py", position, **kw))


def test_several_distinct_suggestions_best_first_each_with_its_id():
    engine = StandIn()
    server = server_with(engine)
    answer = ask(server)
    assert [t for t, _ in answer.suggestions] == ["dir(path)", "dir()", "walk(path)"]
    ids = [i for _, i in answer.suggestions]
    assert len(set(ids)) == 3 and all(ids)
    (call,) = engine.calls  # one engine request, asking for three
    assert call.n == 3 and call.sampling is None
    assert answer.head == "    names = os.lis" and answer.end == CURSOR
    # One suggestion asked for: one.
    server = server_with(StandIn(), suggestions=1)
    assert [t for t, _ in ask(server).suggestions] == ["dir(path)"]


def test_only_an_invoked_request_samples_extra_suggestions():
    engine = StandIn(alternatives=())
    server = server_with(engine)
    assert [t for t, _ in ask(server).suggestions] == ["dir(path)"]
    assert len(engine.calls) == 1
    engine.calls.clear()
    answer = ask(server, invoked=True)  # fresh suggestions, never the remembered ones
    assert [t for t, _ in answer.suggestions] == ["dir(path)", "dir(path)[1:]", "dir(path)[2:]"]
    main, *extra = engine.calls
    assert main.sampling is None and main.n == 3
    assert [c.sampling.seed for c in extra] == [1, 2]
    assert all(c.sampling.temperature == SAMPLE_TEMPERATURE for c in extra)
    assert len({c.key for c in engine.calls}) == 3  # none supersedes another in the engine
    assert server.status()["invoked"] == 1 and server.status()["sampled"] == 2


def test_a_selected_item_shapes_the_prompt_and_the_answer():
    engine = StandIn(text="(path)", alternatives=())
    server = server_with(engine)
    answer = ask(server, selected=selected(15, 18, "listdir"))
    (call,) = engine.calls
    assert call.ctx.line_prefix == "    names = os.listdir"
    assert call.ctx.prefix.endswith("names = os.listdir")
    (item,) = answer.inline_items()
    assert item.insert_text == "    names = os.listdir(path)"
    assert item.range.start == T.Position(line=LINE, character=0) and item.range.end == CURSOR
    assert server.status()["selected"] == 1


def test_a_selected_item_that_does_not_fit_is_answered_as_if_absent():
    engine = StandIn(alternatives=())
    server = server_with(engine)
    answer = ask(server, selected=selected(0, 3, "foo", line=1))
    assert answer.head == "    names = os.lis" and answer.end == CURSOR
    assert engine.calls[0].ctx.line_prefix == "    names = os.lis"


def test_typing_through_any_suggestion_keeps_its_id():
    engine = StandIn()
    server = server_with(engine)
    first = ask(server)
    ids = dict(first.suggestions)
    server.docs.change(
        "file:///a.py",
        "d",
        T.Position(line=LINE, character=18),
        T.Position(line=LINE, character=18),
    )
    again = ask(server, T.Position(line=LINE, character=19))
    assert len(engine.calls) == 1  # no engine call
    assert again.suggestions == [
        ("ir(path)", ids["dir(path)"]),
        ("ir()", ids["dir()"]),
    ]
    assert again.head == "    names = os.lisd"


def test_suggestions_and_debounce_settings():
    warnings = []
    s = merge_settings(Settings(), {"suggestions": 5, "debounce": "fixed"}, warnings.append)
    assert s.suggestions == 5 and s.debounce == "fixed" and not warnings
    assert Settings().suggestions == 3 and Settings().debounce == "adaptive"
    for bad in ({"suggestions": 0}, {"suggestions": 9}, {"suggestions": True}, {"debounce": "x"}):
        assert merge_settings(s, bad, warnings.append) == s
    assert len(warnings) == 4
