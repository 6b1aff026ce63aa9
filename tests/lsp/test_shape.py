"""Single- vs multi-line decisions and stop rules."""

import pytest
from lsp_snippets import split_cursor

from wd_lsp.context import build_context
from wd_lsp.document import Document
from wd_lsp.shape import StopRules, apply_stop_rules, decide_shape


def shape_at(marked: str, language: str):
    text, cursor = split_cursor(marked)
    doc = Document("file:///t", text, language)
    ctx = build_context(doc, doc.position_at(cursor))
    return ctx, decide_shape(ctx)


@pytest.mark.parametrize(
    "language, marked",
    [
        ("python", "def f(x):\n    <|>\n"),
        ("python", "def f(x):<|>\n"),
        ("python", "for i in range(3):\n    <|>\n\nprint(1)\n"),
        ("python", "class A:\n    <|>"),
        ("python", "import os\n\n<|>\n"),  # empty top-level line
        ("javascript", "function f(a) {\n  <|>\n}\n"),
        ("javascript", "function f(a) {<|>}\n"),
        ("typescript", "if (x) {\n  <|>\n}\n"),
        ("go", "package m\n\nfunc f() int {\n\t<|>\n}\n"),
        ("rust", "fn main() {\n    <|>\n}\n"),
        ("c", "int main(void) {\n    <|>\n}\n"),
        ("cpp", "class A {\n  <|>\n};\n"),
        ("java", "class A {\n    void f() {\n        <|>\n    }\n}\n"),
    ],
)
def test_multiline_spots(language, marked):
    ctx, rules = shape_at(marked, language)
    assert rules.multiline, (language, marked)
    assert rules.block_indent is not None


@pytest.mark.parametrize(
    "language, marked",
    [
        ("python", "x = foo(<|>)\n"),  # mid-line
        ("python", "result = <|>\n"),  # mid-expression at end of line
        ("python", "def f(x):\n    a = 1\n    <|>\n    return a\n"),  # inside a non-empty block
        ("python", "d = {'a':<|>\n"),  # a ':' that opens no block
        ("javascript", "const x = foo(<|>);\n"),
        ("go", "package m\n\nfunc f() {\n\tx := 1\n\t<|>\n\ty := 2\n}\n"),
        ("rust", "fn main() {\n    let x = <|>\n}\n"),
        ("java", "class A { int x = <|>; }\n"),
    ],
)
def test_single_line_spots(language, marked):
    ctx, rules = shape_at(marked, language)
    assert not rules.multiline, (language, marked)
    assert rules.stop_strings == ("\n",)


def test_policy_overrides():
    text, cursor = split_cursor("x = <|>\n")
    doc = Document("file:///t.py", text, "python")
    ctx = build_context(doc, doc.position_at(cursor))
    assert decide_shape(ctx, "multi").multiline
    assert not decide_shape(ctx, "single").multiline


def test_block_indent_after_python_opener():
    _, rules = shape_at("def f(x):<|>\n", "python")
    assert rules.block_indent == 4 and not rules.keep_closing_line
    _, rules = shape_at("class A:\n    def g(self):\n        <|>\n", "python")
    assert rules.block_indent == 8


def test_brace_block_closed_in_suffix_drops_closing_line():
    _, closed = shape_at("function f(a) {\n  <|>\n}\n", "javascript")
    assert not closed.keep_closing_line
    _, open_ = shape_at("function f(a) {\n  <|>", "javascript")
    assert open_.keep_closing_line


def test_stop_single_line_at_newline():
    rules = StopRules(False, ("\n",), 1)
    assert apply_stop_rules("a + b\nc = 2", rules) == ("a + b", True)
    assert apply_stop_rules("a + b", rules) == ("a + b", False)


def test_stop_at_dedent_below_block():
    rules = StopRules(True, (), 16, block_indent=4)
    text = "\n    x = 1\n    return x\n\ndef g():\n    pass"
    assert apply_stop_rules(text, rules) == ("\n    x = 1\n    return x\n", True)
    # a partial line of spaces is not yet a dedent
    assert apply_stop_rules("\n    x = 1\n  ", rules) == ("\n    x = 1\n  ", False)


def test_dedent_keeps_closing_brace_only_when_asked():
    text = "\n  return 1;\n}\nfunction g() {}"
    keep = StopRules(True, (), 16, block_indent=2, keep_closing_line=True)
    drop = StopRules(True, (), 16, block_indent=2, keep_closing_line=False)
    assert apply_stop_rules(text, keep) == ("\n  return 1;\n}", True)
    assert apply_stop_rules(text, drop) == ("\n  return 1;", True)
    # "}" still being written could become "} else {": not decided yet
    assert apply_stop_rules("\n  return 1;\n}", keep) == ("\n  return 1;\n}", False)


def test_max_lines():
    rules = StopRules(True, (), 3, block_indent=0)
    assert apply_stop_rules("a\nb\nc\nd", rules) == ("a\nb\nc", True)


def test_rules_serialise_for_the_engine():
    d = StopRules(True, ("\n\n\n",), 8, 4, True).to_dict()
    assert d == {
        "multiline": True,
        "stop_strings": ["\n\n\n"],
        "max_lines": 8,
        "block_indent": 4,
        "keep_closing_line": True,
        "tab_width": 4,
    }
