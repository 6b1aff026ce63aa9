"""Document: positions (UTF-16, and every encoding in the property tests), incremental edits,
the incremental tree vs a fresh parse."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from wd_lsp.document import Document, Position, looks_binary
from wd_lsp.languages import get_parser
from wd_lsp.text import ENCODINGS, UTF16, line_starts, utf16_len


def fresh_sexp(doc: Document) -> str:
    return str(get_parser(doc.language).parse(doc.source_bytes).root_node)


_CODECS = {"utf-8": ("utf-8", 1), "utf-16": ("utf-16-le", 2), "utf-32": ("utf-32-le", 4)}


def lsp_position(text: str, offset: int, encoding: str = UTF16) -> Position:
    """Reference: LSP position of a code point offset, computed the slow, obvious way."""
    starts = line_starts(text)
    line = max(i for i, s in enumerate(starts) if s <= offset)
    codec, width = _CODECS[encoding]
    return Position(line, len(text[starts[line] : offset].encode(codec, "surrogatepass")) // width)


# ---- UTF-16 positions ---------------------------------------------------------------------


def test_utf16_emoji_and_cjk_round_trip():
    text = 'a = "😀中文"\nb = "𝔘" + x\n'
    doc = Document("file:///t.py", text, "python")
    # 😀 and 𝔘 are two UTF-16 units each, 中 and 文 one each
    assert doc.offset_at(Position(0, 7)) == text.index("😀") + 1 + 0  # after 😀
    assert doc.offset_at(Position(0, 8)) == text.index("中") + 1
    assert doc.offset_at(Position(1, 8)) == text.index(" + x")
    for offset in range(len(text) + 1):
        pos = doc.position_at(offset)
        if text[offset - 1 : offset + 1] != "\r\n":
            assert pos == lsp_position(text, offset)
            assert doc.offset_at(pos) == offset


def test_position_inside_surrogate_pair_is_clamped_and_reported():
    doc = Document("file:///t.py", "x = '😀'\n", "python")
    resolved = doc.resolve(Position(0, 6))  # between the two halves of 😀
    assert resolved.clamped
    assert resolved.offset == 5  # start of the emoji
    assert doc.clamped_positions == 1


@pytest.mark.parametrize(
    "pos, offset",
    [
        (Position(-1, 0), 0),
        (Position(0, -5), 0),
        (Position(0, 999), 5),  # end of line 0, not into the next line
        (Position(1, 999), 12),
        (Position(99, 0), 13),  # past the last line: end of text
    ],
)
def test_out_of_range_positions_clamp(pos, offset):
    doc = Document("file:///t.txt", "hello\r\nworld\n", "plaintext")
    resolved = doc.resolve(pos)
    assert resolved.clamped and resolved.offset == offset


def test_line_endings_crlf_and_lone_cr():
    text = "a\r\nb\rc\nd"
    doc = Document("file:///t.txt", text)
    assert doc.line_count == 4
    assert [doc.line_text(i) for i in range(4)] == ["a", "b", "c", "d"]
    assert doc.offset_at(Position(2, 1)) == text.index("c") + 1
    # an offset between "\r" and "\n" reports the end of its line
    assert doc.position_at(2) == Position(0, 1)


def test_lone_surrogate_does_not_crash():
    doc = Document("file:///t.py", "x = '\ud800'\ny = 1\n", "python")
    assert doc.tree is not None
    doc.apply_change("z", Position(1, 0), Position(1, 1))
    assert doc.text.endswith("z = 1\n")


# ---- edits -------------------------------------------------------------------------------


def test_incremental_edit_utf16_range():
    doc = Document("file:///t.py", "s = '😀'\nt = 2\n", "python")
    # replace the emoji (2 units: columns 5..7)
    change = doc.apply_change("ok", Position(0, 5), Position(0, 7), version=2)
    assert doc.text == "s = 'ok'\nt = 2\n"
    assert not change.clamped and doc.version == 2
    assert str(doc.tree.root_node) == fresh_sexp(doc)


def test_full_replacement_without_range():
    doc = Document("file:///t.py", "a = 1\n", "python")
    doc.apply_change("def f():\n    pass\n")
    assert "function_definition" in str(doc.tree.root_node)


def test_crlf_joined_by_edit_updates_lines():
    doc = Document("file:///t.txt", "a\rb")
    doc.apply_change("\n", Position(1, 0), Position(1, 0))  # "a\r\nb": still two lines
    assert doc.line_count == 2 and doc.line_text(1) == "b"
    assert doc.offset_at(Position(1, 1)) == 4


def test_recent_edit_lines_shift_with_inserted_lines():
    doc = Document("file:///t.py", "a\nb\nc\nd\n", "python")
    doc.apply_change("X", Position(3, 0), Position(3, 0))
    doc.apply_change("new\n", Position(0, 0), Position(0, 0))
    assert list(doc.recent_edit_lines) == [4, 0]


_ALPHABET = st.sampled_from(
    [
        "\n",
        "\r\n",
        " ",
        "    ",
        "(",
        ")",
        ":",
        "{",
        "}",
        "def ",
        "x",
        "=",
        "1",
        "'",
        '"',
        "😀",
        "中",
        "#",
        "\t",
        "if ",
        "\r",
        "é",
        "\f",
        "\u2028",
    ]
)
_SNIPPET = st.lists(_ALPHABET, max_size=8).map("".join)


@st.composite
def edit_sequences(draw):
    edits = []
    for _ in range(draw(st.integers(1, 12))):
        edits.append((draw(st.floats(0, 1)), draw(st.floats(0, 1)), draw(_SNIPPET)))
    return edits


SEED = (
    "def f(x):\n    return x + 1  # 😀\n\n"
    "class A:\n    y = '中文'\n    def g(self):\n        pass\n"
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    edit_sequences(), st.sampled_from(["python", "javascript", "rust"]), st.sampled_from(ENCODINGS)
)
def test_incremental_tree_matches_fresh_parse(edits, language, encoding):
    doc = Document("file:///t", SEED, language, encoding=encoding)
    assert doc.tree is not None
    text = SEED
    for i, (a, b, inserted) in enumerate(edits):
        lo, hi = sorted((int(a * len(text)), int(b * len(text))))
        if text[lo - 1 : lo + 1] == "\r\n":
            lo -= 1  # LSP cannot address the middle of a line break
        if text[hi - 1 : hi + 1] == "\r\n":
            hi -= 1
        hi = max(hi, lo)
        start, end = lsp_position(text, lo, encoding), lsp_position(text, hi, encoding)
        doc.apply_change(inserted, start, end)
        text = text[:lo] + inserted + text[hi:]
        assert doc.text == text
        assert doc.source_bytes == text.encode("utf-8")
        assert doc._starts == line_starts(text)
        if i % 3 == 2:  # also reparse mid-sequence, not only after the whole burst
            assert str(doc.tree.root_node) == fresh_sexp(doc)
    assert str(doc.tree.root_node) == fresh_sexp(doc)
    for offset in range(0, len(text) + 1, 7):
        expected = lsp_position(text, min(offset, len(text)), encoding)
        assert doc.position_at(offset) == expected or text[offset - 1 : offset + 1] == "\r\n"


# ---- binary and huge files -----------------------------------------------------------------


def test_binary_content_declined_but_text_kept():
    text = "PK\x03\x04\x00\x00binary" * 10
    doc = Document("file:///a.py", text, "python")
    assert doc.decline_reason == "binary"
    assert doc.tree is None
    assert doc.text == text
    doc.apply_change("", Position(0, 0), Position(0, len(text)))
    assert doc.decline_reason is None and doc.tree is not None


def test_control_characters_count_as_binary():
    assert looks_binary("\x01\x02\x03\x04" * 10 + "abc")
    assert not looks_binary("plain\ttext\nwith\x1b[0m escape\n")


def test_huge_file_declined_with_configurable_limit():
    text = "x = 1\n" * 1000
    doc = Document("file:///a.py", text, "python", max_bytes=1000)
    assert doc.decline_reason == "too large"
    assert doc.tree is None
    assert Document("file:///a.py", text, "python").decline_reason is None


def test_five_megabyte_file_is_declined_fast():
    text = "value = compute(1, 2, 3)  # comment\n" * 150_000  # ~5.4 MB
    doc = Document("file:///big.py", text, "python")
    assert doc.decline_reason == "too large"
    doc.apply_change("y", Position(10, 0), Position(10, 5))
    assert doc.line_text(10).startswith("y = compute")
    assert doc.tree is None


def test_utf16_len_matches_encoder():
    for s in ["", "abc", "😀", "中文😀x", "\ud800"]:
        assert utf16_len(s) == len(s.encode("utf-16-le", "surrogatepass")) // 2


_TEXT_PIECES = [
    "a",
    " ",
    "\n",
    "\r",
    "\r\n",
    "😀",
    "中",
    "é",
    "\t",
    "\f",
    "\u2028",
    "\u0085",
    "\udc00",
]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.sampled_from(_TEXT_PIECES), max_size=40).map("".join), st.sampled_from(ENCODINGS)
)
def test_positions_round_trip_random_text(text, encoding):
    doc = Document("file:///t.txt", text, encoding=encoding)
    for offset in range(len(text) + 1):
        pos = doc.position_at(offset)
        if text[offset - 1 : offset + 1] == "\r\n":
            continue  # inside a line break: not addressable in LSP
        assert pos == lsp_position(text, offset, encoding)
        resolved = doc.resolve(pos)
        assert resolved.offset == offset and not resolved.clamped
