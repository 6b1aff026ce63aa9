"""Workspace: open/change/close and the cross-document recent-edit log."""

from wd_lsp.document import Position
from wd_lsp.workspace import Workspace


def test_open_change_close():
    ws = Workspace()
    ws.open("file:///a.py", "a = 1\n", "python", 1)
    doc = ws.change("file:///a.py", "2", Position(0, 4), Position(0, 5), version=2)
    assert doc.text == "a = 2\n" and doc.version == 2
    assert ws.change("file:///missing.py", "x") is None
    ws.close("file:///a.py")
    assert ws.get("file:///a.py") is None and ws.recent_edits() == []


def test_recent_edits_newest_document_last():
    ws = Workspace()
    a = ws.open("file:///a.py", "a\nb\nc\n", "python")
    b = ws.open("file:///b.py", "x\ny\n", "python")
    ws.change(a.uri, "A", Position(0, 0), Position(0, 1))
    ws.change(b.uri, "Y", Position(1, 0), Position(1, 1))
    ws.change(a.uri, "C", Position(2, 0), Position(2, 1))
    edits = [(d.uri, line) for d, line in ws.recent_edits()]
    assert edits == [("file:///b.py", 1), ("file:///a.py", 0), ("file:///a.py", 2)]


def test_workspace_limit_applies_to_documents():
    ws = Workspace(max_bytes=10)
    assert ws.open("file:///a.py", "x = 1\n" * 10, "python").decline_reason == "too large"
