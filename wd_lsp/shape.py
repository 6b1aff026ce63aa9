"""Shape of a suggestion: one line or a block, and the stop rules that end decoding early.

The rules are plain data (`StopRules.to_dict()` travels to the engine) and `apply_stop_rules`
is the one implementation of them, for the engine to call on its running text and for the
server to re-apply to answers from backends that ignore custom stops.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any

from .context import CompletionContext
from .indent import TAB_WIDTH, columns, leading_ws

# Nodes that hold a block's statements/members; empty ones ask for a multi-line body.
BLOCK_NODE_TYPES = frozenset(
    {
        "block",  # python, go, rust, java
        "statement_block",  # javascript, typescript
        "compound_statement",  # c, c++
        "class_body",  # js/ts/java
        "declaration_list",  # rust impl/trait/mod, c++ namespace
        "field_declaration_list",  # c/c++/rust/go structs
        "enum_body",
        "interface_body",
        "object_type",
        "constructor_body",
        "switch_body",
        "switch_block",
        "match_block",
        "object",
    }
)
# Empty lines at these levels start something new: a whole function is welcome.
TOP_LEVEL_TYPES = frozenset({"module", "program", "source_file", "translation_unit"})

_PY_BLOCK_LINE = re.compile(
    r"^\s*(async\s+)?(def|class|if|elif|else|for|while|try|except|finally|with|match|case)\b.*:\s*(#.*)?$"
    r"|^\s*(else|try|finally)\s*:\s*$"
    r"|^\s*lambda\b.*:\s*$"
)
_CLOSERS_ONLY = re.compile(r"^[\s)\]}>;,]*$")


@dataclass(frozen=True)
class StopRules:
    multiline: bool
    # Cut the text before the first occurrence of any of these.
    stop_strings: tuple[str, ...] = ()
    max_lines: int = 1
    # Multi-line: a non-blank line (after the first) indented less than this many columns
    # leaves the cursor's block; the completion ends before it.
    block_indent: int | None = None
    # ...unless it only closes the block ("}") and the suffix does not close it already.
    keep_closing_line: bool = False
    tab_width: int = TAB_WIDTH

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["stop_strings"] = list(self.stop_strings)
        return d


def decide_shape(ctx: CompletionContext, policy: str = "auto", max_lines: int = 16) -> StopRules:
    """Single- or multi-line for this cursor, and how decoding should stop.

    policy: "auto" (from the syntax), "single" or "multi" (forced by configuration).
    """
    multiline = is_multiline_spot(ctx) if policy == "auto" else policy == "multi"
    if not multiline:
        return StopRules(False, ("\n",), 1)
    indent = _block_indent(ctx)
    keep_closing = ctx.language != "python" and not _suffix_closes_block(ctx.suffix, indent)
    stops: tuple[str, ...] = ("\n\n\n",) if indent == 0 else ()
    return StopRules(True, stops, max_lines, indent, keep_closing)


def is_multiline_spot(ctx: CompletionContext) -> bool:
    before = ctx.line_prefix.rstrip()
    after = ctx.line_suffix.strip()
    opener = _opens_block(before, ctx.language)
    if ctx.mid_line:
        # `{|}` with an auto-closed brace still wants a body
        return opener and bool(_CLOSERS_ONLY.match(after)) and after.startswith("}")
    if before:
        return opener
    # The cursor line is blank.
    prev = _previous_code_line(ctx.prefix)
    if prev is not None and _opens_block(prev.rstrip(), ctx.language):
        return True
    node = _node_at_cursor(ctx)
    if node is None:
        return prev is None
    if node.type in TOP_LEVEL_TYPES:
        return True
    if node.type in BLOCK_NODE_TYPES:
        return all(c.type == "comment" or "comment" in c.type for c in node.named_children)
    return False


def _opens_block(line: str, language: str) -> bool:
    if language == "python":
        return bool(_PY_BLOCK_LINE.match(line))
    if language == "plaintext":
        return line.endswith(("{", ":"))
    return line.endswith("{")


def _previous_code_line(prefix: str) -> str | None:
    lines = prefix.split("\n")[:-1]  # the last element is the cursor line itself
    for line in reversed(lines):
        if line.strip():
            return line
    return None


def _node_at_cursor(ctx: CompletionContext) -> Any:
    tree = ctx.tree
    if tree is None:
        return None
    # tree-sitter rows count "\n"; the prefix's own newlines tell us the row of the cursor
    row = ctx.prefix_start_line + ctx.prefix.count("\n") if "\r" not in ctx.prefix else None
    if row is None:
        return None
    col = len(ctx.line_prefix.encode("utf-8", "surrogatepass"))
    point = (row, col)
    node = tree.root_node.named_descendant_for_point_range(point, point)
    # A blank line between statements resolves to the enclosing block; walk up to one.
    while node is not None:
        if node.type in TOP_LEVEL_TYPES:
            return node
        if node.type in BLOCK_NODE_TYPES and node.start_point <= point <= node.end_point:
            return node
        node = node.parent
    return None


def _block_indent(ctx: CompletionContext) -> int:
    unit = columns(ctx.indent_unit) if ctx.indent_unit != "\t" else TAB_WIDTH
    here = columns(ctx.indent)
    before = ctx.line_prefix.rstrip()
    if before and _opens_block(before, ctx.language):
        return here + unit  # the body goes on the next lines, one level in
    if not before:
        prev = _previous_code_line(ctx.prefix)
        if prev is not None and _opens_block(prev.rstrip(), ctx.language):
            opener = columns(leading_ws(prev))
            # the editor's auto-indent on the cursor line knows the style better than we do
            return here if here > opener else opener + unit
        return columns(ctx.line_prefix)
    return here


def _suffix_closes_block(suffix: str, block_indent: int) -> bool:
    """The suffix's next code line is a dedented closer: the block is already closed."""
    for line in suffix.split("\n")[1:]:
        if line.strip():
            return columns(leading_ws(line)) < block_indent and line.strip()[0] in ")]}"
    return False


def apply_stop_rules(text: str, rules: StopRules) -> tuple[str, bool]:
    """(text kept, whether a rule fired). Safe on partial text: undecidable lines are kept."""
    stopped = False
    for stop in rules.stop_strings:
        at = text.find(stop)
        if at != -1:
            text, stopped = text[:at], True
    lines = text.split("\n")
    if len(lines) > rules.max_lines:
        lines, stopped = lines[: rules.max_lines], True
    if rules.multiline and rules.block_indent is not None:
        for i in range(1, len(lines)):
            line = lines[i]
            if not line.strip():
                continue
            if columns(leading_ws(line), rules.tab_width) < rules.block_indent:
                closing = (
                    rules.keep_closing_line
                    and line.strip()[0] in ")]}"
                    and _CLOSERS_ONLY.match(line)
                )
                if closing and i == len(lines) - 1:
                    break  # "}" may still grow into "} else {": decide when the line ends
                lines, stopped = lines[: i + 1 if closing else i], True
                break
    return "\n".join(lines), stopped
