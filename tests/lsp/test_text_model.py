"""The text model in each position encoding: units, line ends, clamping, edits inside characters.

Expected columns are worked out by hand in the comments; the property tests compare with
Python's own encoders.
"""

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wd_lsp.context import build_context
from wd_lsp.document import Document, Position
from wd_lsp.text import UTF8, UTF16, UTF32, units_len, units_to_index
from wd_lsp.workspace import Workspace

ENCODINGS = [UTF8, UTF16, UTF32]


def doc_in(encoding: str, text: str, language: str = "plaintext") -> Document:
    return Document("file:///t.txt", text, language, encoding=encoding)


# ---- units of non-ASCII and astral characters ------------------------------------------------

MIXED = 'a = "é中😀x"\n'  # before x: 'a = "' then é (2 bytes), 中 (3 bytes), 😀 (4 bytes, 2 units)


@pytest.mark.parametrize(
    "encoding, column", [(UTF8, 5 + 2 + 3 + 4), (UTF16, 5 + 1 + 1 + 2), (UTF32, 5 + 3)]
)
def test_column_of_a_character_after_non_ascii(encoding, column):
    doc = doc_in(encoding, MIXED)
    x = MIXED.index("x")
    assert doc.resolve(Position(0, column)).offset == x
    assert doc.position_at(x) == Position(0, column)
    assert doc.position_at(len(MIXED)) == Position(1, 0)


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_every_offset_round_trips(encoding):
    text = "é😀\r\nb中\rc\n\f\u2028d\u0085😀"
    doc = doc_in(encoding, text)
    for offset in range(len(text) + 1):
        if text[offset - 1 : offset + 1] == "\r\n":
            continue  # between "\r" and "\n": not addressable
        resolved = doc.resolve(doc.position_at(offset))
        assert (resolved.offset, resolved.clamped) == (offset, False)


@pytest.mark.parametrize(
    "encoding, inside, start",
    [
        (UTF16, 6, 5),  # between the halves of 😀 (columns 5..7)
        (UTF8, 6, 5),  # one byte into é (bytes 5..7)
        (UTF8, 8, 7),  # one byte into 中 (bytes 7..10)
        (UTF8, 9, 7),  # two bytes into 中
        (UTF8, 13, 10),  # three bytes into 😀 (bytes 10..14)
    ],
)
def test_column_inside_a_character_rounds_down_to_its_start(encoding, inside, start):
    text = 'a = "é中😀x"' if encoding == UTF8 else 'a = "😀x"'
    doc = doc_in(encoding, text)
    resolved = doc.resolve(Position(0, inside))
    assert resolved.clamped and doc.clamped_positions == 1
    assert doc.position_at(resolved.offset) == Position(0, start)


@pytest.mark.parametrize(
    "encoding, start, end, expected",
    [
        (UTF16, 8, 8, 'a = "é中X😀x"'),  # an insertion inside 😀 (columns 7..9) lands before it
        (UTF16, 8, 9, 'a = "é中Xx"'),  # from inside 😀 to its end: all of it is replaced
        (UTF8, 6, 13, 'a = "X😀x"'),  # inside é .. inside 😀: both ends round down
        (UTF8, 11, 14, 'a = "é中Xx"'),
    ],
)
def test_edit_with_ends_inside_characters(encoding, start, end, expected):
    doc = doc_in(encoding, 'a = "é中😀x"')
    change = doc.apply_change("X", Position(0, start), Position(0, end))
    assert doc.text == expected and change.clamped


# ---- line ends ---------------------------------------------------------------------------------


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_crlf_and_lone_cr_are_line_ends(encoding):
    text = "a\r\nb\rc\nd"
    doc = doc_in(encoding, text)
    assert [doc.line_text(i) for i in range(doc.line_count)] == ["a", "b", "c", "d"]
    assert doc.resolve(Position(0, 5)).offset == 1  # clamps before "\r\n", not into it
    assert doc.resolve(Position(1, 1)).offset == text.index("\rc")
    assert doc.position_at(2) == Position(0, 1)  # between "\r" and "\n": the end of the line


@pytest.mark.parametrize("encoding, after_ls", [(UTF8, 1 + 1 + 3), (UTF16, 3), (UTF32, 3)])
def test_form_feed_and_unicode_separators_are_not_line_ends(encoding, after_ls):
    text = "a\f\u2028b\u0085\u2029\v\x1cc\nz"  # only the "\n" ends a line in LSP
    doc = doc_in(encoding, text)
    assert doc.line_count == 2
    assert doc.line_text(0) == text.split("\n")[0]
    assert doc.resolve(Position(0, after_ls)).offset == text.index("b")
    assert doc.resolve(Position(1, 1)).offset == len(text)


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_inserted_newline_after_cr_merges_the_line_ends(encoding):
    doc = doc_in(encoding, "é\rb")
    change = doc.apply_change("\n", Position(1, 0), Position(1, 0))
    assert doc.text == "é\r\nb" and doc.line_count == 2 and doc.line_text(1) == "b"
    assert change.new_end == 3  # the cursor: after the "\n", at the start of "b"
    assert doc.position_at(change.new_end) == Position(1, 0)


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_deleting_between_cr_and_lf_merges_the_line_ends(encoding):
    doc = doc_in(encoding, "a\rX\nb")
    doc.apply_change("", Position(1, 0), Position(1, 1))
    assert doc.text == "a\r\nb" and doc.line_count == 2
    doc.apply_change("\r", Position(1, 1), Position(1, 1))  # "a\r\nb\r": a new empty last line
    assert doc.line_count == 3 and doc.position_at(len(doc.text)) == Position(2, 0)


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_cr_inserted_before_lf_merges_the_line_ends(encoding):
    doc = doc_in(encoding, "😀\nb")
    doc.apply_change("\r", Position(0, 99), Position(0, 99))
    assert doc.text == "😀\r\nb" and doc.line_count == 2 and doc.line_text(1) == "b"


# ---- clamping ----------------------------------------------------------------------------------


@pytest.mark.parametrize("encoding, line_units", [(UTF8, 7), (UTF16, 4), (UTF32, 3)])
def test_positions_past_line_end_and_last_line_clamp(encoding, line_units):
    text = "é😀a\r\nzz"  # line 0 is 7 bytes, 4 UTF-16 units, 3 code points
    doc = doc_in(encoding, text)
    end = doc.resolve(Position(0, line_units))
    assert end.offset == 3 and not end.clamped
    past = doc.resolve(Position(0, line_units + 1))
    assert past.clamped and past.offset == 3
    assert doc.resolve(Position(2, 0)).offset == len(text)
    assert doc.resolve(Position(50, 7)).offset == len(text)
    doc.apply_change("!", Position(9, 9), Position(9, 9))  # an edit past the end appends
    assert doc.text == text + "!"
    assert doc.clamped_positions == 5  # both ends of the last edit


def test_unknown_encoding_is_refused():
    with pytest.raises(ValueError):
        Document("file:///t.txt", "", encoding="utf-7")


def test_workspace_documents_use_its_encoding():
    ws = Workspace(encoding=UTF8)
    doc = ws.open("file:///a.txt", "é = 1\n")
    assert doc.encoding == UTF8
    ws.change(doc.uri, "x", Position(0, 2), Position(0, 2))
    assert doc.text == "éx = 1\n"


# ---- lone surrogates ----------------------------------------------------------------------------


@pytest.mark.parametrize("encoding, after", [(UTF8, 1 + 3), (UTF16, 2), (UTF32, 2)])
def test_lone_surrogate_counts_as_one_character(encoding, after):
    text = "x\ud800y = 1\n"  # three UTF-8 bytes (WTF-8), one UTF-16 unit, one code point
    doc = doc_in(encoding, text, "python")
    assert doc.resolve(Position(0, after)).offset == 2
    assert doc.position_at(2) == Position(0, after)
    assert doc.source_bytes == text.encode("utf-8", "surrogatepass")
    assert doc.tree is not None
    doc.apply_change("z", Position(0, after), Position(0, after + 1))
    assert doc.text == "x\ud800z = 1\n"


def test_context_for_the_engine_is_valid_utf8_but_the_text_is_kept():
    text = 'a = "\ud800"\nb = "\udfff😀"\nc = '
    doc = Document("file:///t.py", text, "python")
    other = Document("file:///u.py", "def f\udc00():\n    pass\n", "python")
    ctx = build_context(doc, doc.position_at(len(text)), open_documents=[other])
    assert doc.text == text
    assert ctx.prefix == 'a = "\ufffd"\nb = "\ufffd😀"\nc = ' and len(ctx.prefix) == len(text)
    msgpack.packb(
        {
            "prefix": ctx.prefix,
            "suffix": ctx.suffix,
            "line": ctx.line_prefix,
            "chunks": [c.text for c in ctx.chunks],
        }
    )


# ---- units against Python's encoders ------------------------------------------------------------

_CHARS = st.sampled_from(["a", " ", "é", "中", "😀", "𝔘", "\ud800", "\udc00", "\f", "\u2028", "\t"])
_WIDTH = {UTF8: ("utf-8", 1), UTF16: ("utf-16-le", 2), UTF32: ("utf-32-le", 4)}


@settings(max_examples=150, deadline=None, derandomize=True)
@given(st.lists(_CHARS, max_size=20).map("".join), st.sampled_from(ENCODINGS))
def test_units_match_the_encoders(line, encoding):
    codec, width = _WIDTH[encoding]

    def units(s):
        return len(s.encode(codec, "surrogatepass")) // width

    assert units_len(line, encoding) == units(line)
    for i in range(len(line) + 1):
        assert units_to_index(line, units(line[:i]), encoding) == (i, True)
    for column in range(units(line) + 3):
        index, exact = units_to_index(line, column, encoding)
        assert units(line[:index]) <= column  # never past the column: rounds down, clamps
        assert exact == (units(line[:index]) == column)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    st.lists(
        st.tuples(st.floats(0, 1), st.floats(0, 1), st.lists(_CHARS, max_size=4).map("".join)),
        min_size=1,
        max_size=10,
    )
)
def test_byte_offsets_match_the_encoding_after_edits(edits):
    # byte_offset encodes only from the nearest known point (start, end, last edit): check all
    text = "é😀 x\n中 \ud800 y\n" * 3
    doc = Document("file:///t.txt", text, encoding=UTF32)  # no "\r": every offset is a position
    for a, b, inserted in edits:
        lo, hi = sorted((int(a * len(text)), int(b * len(text))))
        doc.apply_change(inserted, doc.position_at(lo), doc.position_at(hi))
        text = text[:lo] + inserted + text[hi:]
        assert doc.text == text
        for offset in range(len(text) + 1):
            assert doc.byte_offset(offset) == len(text[:offset].encode("utf-8", "surrogatepass"))
