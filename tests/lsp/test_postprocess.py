"""Post-filters: suffix overlap, bracket balance, repetition, indentation, the whole chain."""

import pytest
from lsp_snippets import split_cursor

from wd_lsp.context import build_context
from wd_lsp.document import Document
from wd_lsp.postprocess import (
    balance_brackets,
    cut_repetition,
    drop_lines_in_suffix,
    normalize_indentation,
    postprocess,
    repeats_neighbour,
    trim_suffix_overlap,
)
from wd_lsp.shape import decide_shape


def run(marked: str, completion: str, language: str = "python"):
    text, cursor = split_cursor(marked)
    doc = Document("file:///t", text, language)
    ctx = build_context(doc, doc.position_at(cursor))
    return postprocess(completion, ctx, decide_shape(ctx))


@pytest.mark.parametrize(
    "line_prefix, completion, line_suffix, expected",
    [
        ("print(", '"hi")', ")", '"hi"'),  # auto-closed paren written again
        ("print(", "foo()", ")", "foo()"),  # the completion's own pair stays
        ('x = "', 'hello"', '"', "hello"),  # auto-closed quote
        ("if (", "x) {", ") {", "x"),  # the rest of the line rewritten
        ("f(a[", "0])", "])", "0"),
        ("f(", "a, b", ")", "a, b"),  # nothing to trim
        ("x = [", "1, 2]", "]", "1, 2"),
    ],
)
def test_trim_suffix_overlap(line_prefix, completion, line_suffix, expected):
    assert trim_suffix_overlap(completion, line_prefix, line_suffix, "javascript") == expected


@pytest.mark.parametrize(
    "prefix, completion, line_suffix, expected",
    [
        ("foo(", "a, b)) + 1", "", "a, b)"),  # closes more than the context opened
        ("print(", '"hi")', ")", '"hi"'),  # the suffix already closes the paren
        ("x = ", "1)", "", "1"),
        ("x = (", "a + [b)", "", "a + [b"),  # mismatched closer
        ("s = ", '"(" + x', "", '"(" + x'),  # brackets in strings do not count
        ("def f():\n    if (", "a and b):", "", "a and b):"),
        ("return len(", "path)", "f.read())", "path"),  # the rest of the line closes len(
        ("return len(", "path.", "f.read())", "path."),
    ],
)
def test_balance_brackets(prefix, completion, line_suffix, expected):
    assert balance_brackets(completion, prefix, line_suffix, "python") == expected


def test_repeated_lines_are_cut():
    assert cut_repetition("x = 1\ny = 2\ny = 2\ny = 2\ny = 2") == "x = 1\ny = 2"
    assert cut_repetition("a()\nb()\na()\nb()\na()\nb()") == "a()\nb()"
    assert cut_repetition("}\n}\n}") == "}\n}\n}"  # closers are not repetition
    assert cut_repetition("a\nb\nc") == "a\nb\nc"


def test_repeats_neighbour():
    assert repeats_neighbour("total += x", "for x in xs:\n    total += x\n    ", "")
    assert repeats_neighbour("return a", "def f():\n    ", "\n    return a\n")
    assert not repeats_neighbour("return b", "def f():\n    ", "\n    return a\n")
    assert repeats_neighbour("   ", "", "")


def test_drop_lines_already_in_suffix():
    assert drop_lines_in_suffix("\n    return 1\n}", "\n}\n") == "\n    return 1"
    nested = "\n  if (x) {\n    y();\n  }"
    assert drop_lines_in_suffix(nested, "\n}\n") == nested


def test_normalize_indentation():
    assert normalize_indentation("\n    a\n        b", "\t") == "\n\ta\n\t\tb"
    assert normalize_indentation("\n\ta\n\t\tb", "  ") == "\n  a\n    b"
    assert normalize_indentation("\n  a\n    b", "\t") == "\n\ta\n\t\tb"
    assert normalize_indentation("single", "\t") == "single"


# ---- the whole chain --------------------------------------------------------------------


def test_empty_and_whitespace_suggestions_dropped():
    assert run("x = <|>\n", "") is None
    assert run("x = <|>\n", "   \n  ") is None
    assert run("x = <|>\n", "\nfoo()") is None  # single-line mode: nothing on this line


def test_single_line_mode_cuts_at_newline():
    assert run("x = <|>\n", "compute(1)\ny = 2") == "compute(1)"


def test_auto_closed_paren_in_chain():
    assert run("print(<|>)\n", '"hi")') == '"hi"'
    assert run("print(<|>)\n", "foo()") == "foo()"


def test_multiline_python_body_stops_at_dedent():
    out = run("def f(x):\n    <|>\n", "y = x * 2\n    return y\n\ndef g():\n    pass\n")
    assert out == "y = x * 2\n    return y"


def test_multiline_js_does_not_duplicate_closing_brace():
    out = run("function f(a) {\n  <|>\n}\n", "const b = a + 1;\n  return b;\n}\n", "javascript")
    assert out == "const b = a + 1;\n  return b;"


def test_multiline_go_keeps_tabs():
    out = run("package m\n\nfunc f() int {\n\t<|>\n}\n", "x := 1\n    return x\n}", "go")
    assert out == "x := 1\n\treturn x"


def test_repetitive_multiline_trimmed():
    out = run("def f():\n    <|>\n", "print(1)\n    print(1)\n    print(1)\n    print(1)")
    assert out == "print(1)"
