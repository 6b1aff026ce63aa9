"""Context assembly: FIM split, budget trimming at boundaries, extra chunks, stable order."""

import pytest
from lsp_snippets import PROJECTS, split_cursor

from wd_lsp.context import CHUNK_KINDS, PREFIX_CUT_STEP, Budget, build_context
from wd_lsp.document import Document, Position
from wd_lsp.symbols import definitions, imports
from wd_lsp.workspace import Workspace

USED_NAME = {"go": "Distance"}


def open_project(language):
    (lib_uri, lib_id, lib_text), (main_uri, main_id, main_text) = PROJECTS[language]
    ws = Workspace(root="/proj")
    lib = ws.open(lib_uri, lib_text, lib_id)
    text, cursor = split_cursor(main_text)
    main = ws.open(main_uri, text, main_id)
    return ws, lib, main, cursor


@pytest.mark.parametrize("language", list(PROJECTS))
def test_context_per_language(language):
    ws, lib, main, cursor = open_project(language)
    pos = main.position_at(cursor)
    ctx = build_context(main, pos, open_documents=ws.documents(), root=ws.root)

    assert ctx.language == language
    assert ctx.prefix + ctx.suffix == main.text  # small file: nothing trimmed
    assert ctx.prefix == main.text[:cursor]
    assert not ctx.prefix_truncated and not ctx.suffix_truncated
    assert ctx.mid_line and ctx.line_suffix.startswith(")")
    assert ctx.path == main.path.removeprefix("/proj/")

    lib_path = lib.path.removeprefix("/proj/")
    defs = [c for c in ctx.chunks if c.kind == "definition" and c.path == lib_path]
    name = USED_NAME.get(language, "distance")
    assert any(name in c.text for c in defs), ctx.chunks
    outlines = [c for c in ctx.chunks if c.kind == "import"]
    assert [c.path for c in outlines] == [lib_path]
    # nothing of the current file's visible window is repeated as a chunk
    assert all(c.uri != main.uri for c in ctx.chunks)
    kinds = [CHUNK_KINDS.index(c.kind) for c in ctx.chunks]
    assert kinds == sorted(kinds)


@pytest.mark.parametrize("language", list(PROJECTS))
def test_symbols_per_language(language):
    ws, lib, main, _ = open_project(language)
    names = {d.name for d in definitions(lib)}
    assert USED_NAME.get(language, "distance") in names
    assert "Point" in names
    assert imports(main), "the main file's imports are found"


def test_definition_text_is_whole_lines():
    ws, lib, main, cursor = open_project("python")
    ctx = build_context(main, main.position_at(cursor), open_documents=[lib])
    dist = next(c for c in ctx.chunks if c.kind == "definition" and "def distance" in c.text)
    assert dist.text.startswith("def distance(a, b):")
    assert dist.text.endswith("** 0.5")


def test_plain_text_document_has_context_without_tree():
    doc = Document("file:///notes.txt", "alpha\nbeta gamma\ndelta\n", "plaintext")
    ctx = build_context(doc, Position(1, 4))
    assert ctx.language == "plaintext"
    assert ctx.prefix == "alpha\nbeta" and ctx.suffix == " gamma\ndelta\n"
    assert ctx.chunks == ()


def test_invalid_position_is_clamped_and_reported():
    doc = Document("file:///a.py", "x = 1\n", "python")
    ctx = build_context(doc, Position(7, 3))
    assert ctx.position_clamped
    assert ctx.offset == len(doc.text) and ctx.suffix == ""


def _long_python(n_functions: int) -> str:
    parts = []
    for i in range(n_functions):
        parts.append(f"def func_{i}(a, b):\n    total = a + b * {i}\n    return total - {i}\n\n\n")
    return "".join(parts)


def test_prefix_trimmed_at_line_start_within_budget():
    text = _long_python(200) + "def tail(x):\n    return func_3(x, "
    doc = Document("file:///big.py", text, "python")
    budget = Budget(prefix_tokens=300, suffix_tokens=50, extra_tokens=0)
    ctx = build_context(doc, doc.position_at(len(text)), budget=budget)
    assert ctx.prefix_truncated
    assert ctx.prefix_tokens <= 300
    assert text.endswith(ctx.prefix)
    start = len(text) - len(ctx.prefix)
    assert text[start - 1] == "\n"  # cut at a line start
    # snapped to a top-level definition, not into a function body
    assert ctx.prefix.startswith("def func_")


def test_prefix_cut_uses_a_real_tokenizer_count():
    text = _long_python(100) + "x = "
    doc = Document("file:///big.py", text, "python")

    def words(s):  # a crude but different tokenizer
        return len(s.split())

    ctx = build_context(
        doc, doc.position_at(len(text)), budget=Budget(prefix_tokens=120), count_tokens=words
    )
    assert ctx.prefix_truncated and words(ctx.prefix) <= 120


def test_prefix_start_stays_put_while_typing():
    # No syntax boundaries in plain text: the cut moves only in PREFIX_CUT_STEP-line steps.
    lines = [f"line {i} of some prose that goes on" for i in range(400)]
    doc = Document("file:///a.txt", "\n".join(lines) + "\n", "plaintext")
    budget = Budget(prefix_tokens=500, suffix_tokens=10, extra_tokens=0)
    starts = set()
    for ch in "typing more words here":
        end = doc.position_at(len(doc.text))
        doc.apply_change(ch, end, end)
        ctx = build_context(doc, doc.position_at(len(doc.text)), budget=budget)
        starts.add(ctx.prefix_start_line)
        assert ctx.prefix_start_line % PREFIX_CUT_STEP == 0
    assert len(starts) == 1


def test_suffix_trimmed_at_line_end_and_keeps_the_cursor_line():
    text = "value = compute(" + ")\n" + _long_python(100)
    doc = Document("file:///a.py", text, "python")
    ctx = build_context(doc, Position(0, 16), budget=Budget(suffix_tokens=100))
    assert ctx.suffix.startswith(")\n")
    assert ctx.suffix_truncated and ctx.suffix.endswith("\n")
    assert ctx.suffix_tokens <= 100


def test_one_enormous_line_is_cut_at_a_space():
    text = "var a = " + " ".join(f"x{i}" for i in range(5000))
    doc = Document("file:///min.js", text, "javascript")
    ctx = build_context(doc, doc.position_at(len(text)), budget=Budget(prefix_tokens=100))
    assert ctx.prefix_tokens <= 100 and ctx.prefix.startswith("x")


def test_recent_edits_from_other_files_come_last():
    ws, lib, main, cursor = open_project("python")
    other = ws.open("file:///proj/pkg/notes.py", "A = 1\nB = 2\nC = 3\n", "python")
    ws.change(other.uri, "42", Position(1, 4), Position(1, 5))
    ctx = build_context(
        main,
        main.position_at(cursor),
        open_documents=ws.documents(),
        recent_edits=ws.recent_edits(),
        root=ws.root,
    )
    assert ctx.chunks[-1].kind == "recent_edit"
    assert "B = 42" in ctx.chunks[-1].text


def test_extra_budget_is_respected():
    ws, lib, main, cursor = open_project("python")
    ctx = build_context(
        main,
        main.position_at(cursor),
        open_documents=ws.documents(),
        budget=Budget(extra_tokens=20),
    )
    assert ctx.extra_tokens <= 20


def test_binary_document_gets_no_symbols():
    doc = Document("file:///a.py", "\x00\x01def f(): pass\n", "python")
    ctx = build_context(doc, Position(0, 2))
    assert ctx.declined == "binary" and ctx.chunks == ()


def test_far_definition_in_the_same_file_is_a_chunk():
    text = "def far_helper(n):\n    return n * 2\n\n\n" + _long_python(150) + "x = far_helper("
    doc = Document("file:///a.py", text, "python")
    ctx = build_context(doc, doc.position_at(len(text)), budget=Budget(prefix_tokens=200))
    assert ctx.prefix_truncated and "def far_helper" not in ctx.prefix
    assert any(c.kind == "definition" and c.text.startswith("def far_helper") for c in ctx.chunks)


def test_region_cached_definitions_follow_edits():
    text = _long_python(60)
    doc = Document("file:///a.py", text, "python")
    for i, line in enumerate([10, 150, 151, 20, 290]):
        lo, hi = max(0, line - 20), line + 20
        pos = Position(line, 0)
        doc.apply_change(f"def new_{i}():\n    pass\n", pos, pos)
        full = [d for d in definitions(doc) if d.end_line < lo or d.start_line > hi]
        from wd_lsp.symbols import definitions_outside, imports, imports_around

        assert definitions_outside(doc, lo, hi) == full
        assert imports_around(doc, lo, hi) == imports(doc)


def test_a_budget_fitted_to_a_short_context_leaves_room_for_the_reply():
    base = Budget()
    assert base.fitted(None, 64) == base
    assert base.fitted(1 << 20, 64) == base  # a long context keeps the defaults
    small = base.fitted(1024, 64)
    room = 1024 - 64 - 8
    assert small.suffix_tokens == room // 4
    assert 0 < small.prefix_tokens < base.prefix_tokens
    assert small.prefix_tokens + small.suffix_tokens + small.extra_tokens <= room
    assert base.fitted(2048, 64).prefix_tokens > small.prefix_tokens
    none = base.fitted(32, 64)  # no room at all: an empty context, not a negative budget
    assert none.prefix_tokens == none.suffix_tokens == none.extra_tokens == 0
