"""The Neovim plugin end to end: a real headless nvim, the real wd-lsp server and engine.

Neovim 0.12 draws the ghost text with its built-in vim.lsp.inline_completion; 0.11 (and 0.12
with ghost_text = 'extmark') with the plugin's own extmarks. Each test types into a Python file
in insert mode, waits for ghost text and accepts it with the plugin's mappings.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from editor_bins import Unavailable, nvim_binary
from nvim_rpc import Nvim

PLUGIN = Path(__file__).resolve().parents[2] / "editors" / "nvim"

# The first completion includes starting the engine and loading the model on a small CPU.
FIRST_GHOST_TIMEOUT = 240
TIMEOUT = 60

SOURCE = (
    """\
import math


def circle_area(radius):
    return math.pi * radius ** 2


def fibonacci(n):
    if n < 2:
        return n
"""
    + " " * 4  # the cursor's line: indented, empty
    + """

print(fibonacci(10))
"""
)
CURSOR_LINE = 11  # 1-based: the indented empty line in fibonacci
TYPED = "return fib"

INIT_LUA = """\
local t = vim.json.decode(os.getenv('WD_LSP_TEST_NVIM'))
vim.opt.rtp:prepend(t.plugin)
vim.opt.swapfile = false
require('wd_lsp').setup({ cmd = t.cmd, ghost_text = t.ghost_text })
"""

# The ghost text on screen: first line (virt_text) and the lines below it (virt_lines), plus
# where it is anchored. nil while none is shown.
GHOST_LUA = """\
local mode = ...
local name = mode == 'native' and 'nvim.lsp.inline_completion' or 'wd_lsp_ghost'
local ns = vim.api.nvim_create_namespace(name)
local marks = vim.api.nvim_buf_get_extmarks(0, ns, 0, -1, { details = true })
if #marks == 0 then return nil end
local d = marks[1][4]
local function join(chunks)
  local s = ''
  for _, c in ipairs(chunks or {}) do s = s .. c[1] end
  return s
end
local lines = { join(d.virt_text) }
for _, l in ipairs(d.virt_lines or {}) do lines[#lines + 1] = join(l) end
local text = table.concat(lines, '\\n')
if text == '' then return nil end
return { text = text, row = marks[1][2], col = marks[1][3] }
"""

BUFFER_LUA = "return table.concat(vim.api.nvim_buf_get_lines(0, 0, -1, false), '\\n')"

CURSOR_LUA = "local p = vim.api.nvim_win_get_cursor(0); return { p[1] - 1, p[2] }"


def _binary(label: str) -> Path:
    try:
        return nvim_binary(label)
    except Unavailable as exc:
        pytest.skip(f"Neovim {label} is not available: {exc}")


@pytest.fixture
def open_nvim(tmp_path, editor_env, server_cmd):
    started: list[Nvim] = []

    def start(label: str, ghost_text: str) -> Nvim:
        binary = _binary(label)
        (tmp_path / "init.lua").write_text(INIT_LUA)
        (tmp_path / "fib.py").write_text(SOURCE)
        env = dict(editor_env)
        env["WD_LSP_TEST_NVIM"] = json.dumps(
            {"plugin": str(PLUGIN), "cmd": server_cmd, "ghost_text": ghost_text}
        )
        nvim = Nvim(
            str(binary), ["--clean", "-u", str(tmp_path / "init.lua"), "-n"], str(tmp_path), env
        )
        started.append(nvim)
        assert nvim.lua("return require('wd_lsp').backend_name()") == ghost_text
        nvim.command("edit fib.py")
        nvim.wait_for(
            "local c = vim.lsp.get_clients({ bufnr = 0, name = 'wd_lsp' })[1]; "
            "return c and c.initialized",
            TIMEOUT,
            "the wd-lsp client to attach",
        )
        return nvim

    yield start
    for nvim in started:
        nvim.close()


def type_and_wait_for_ghost(nvim: Nvim, mode: str) -> dict:
    """Opens a line in insert mode, types like a user and returns the ghost text that appears."""
    nvim.lua("vim.api.nvim_win_set_cursor(0, { ... , 0 })", CURSOR_LINE)
    nvim.input("A")
    for ch in TYPED:
        nvim.input(ch)
    nvim.wait_for(
        f"return vim.api.nvim_get_current_line() == '    {TYPED}'", TIMEOUT, "the typed text"
    )
    assert nvim.request("nvim_get_mode")["mode"] == "i"
    ghost = nvim.wait_for(GHOST_LUA, FIRST_GHOST_TIMEOUT, f"ghost text ({mode})", mode)
    assert ghost["text"].strip(), ghost
    return ghost


def buffer_and_cursor(nvim: Nvim) -> tuple[str, int]:
    """The buffer text and the cursor as an offset into it."""
    text = nvim.lua(BUFFER_LUA)
    row, col = nvim.lua(CURSOR_LUA)
    lines = text.split("\n")
    offset = sum(len(line.encode()) + 1 for line in lines[:row]) + col
    return text, len(text.encode()[:offset].decode())


@pytest.mark.slow
@pytest.mark.parametrize(
    ("label", "mode"),
    [("0.12", "native"), ("0.11", "extmark"), ("0.12", "extmark")],
    ids=["nvim0.12-builtin", "nvim0.11-extmark", "nvim0.12-extmark"],
)
def test_ghost_text_appears_and_tab_accepts_it(open_nvim, label, mode):
    nvim = open_nvim(label, mode)
    ghost = type_and_wait_for_ghost(nvim, mode)
    before, at = buffer_and_cursor(nvim)
    # (Buffer lines joined: no final newline.)
    assert before == SOURCE.replace("    \n\nprint", f"    {TYPED}\n\nprint").removesuffix("\n")
    expected = before[:at] + ghost["text"] + before[at:]

    nvim.input("<Tab>")
    nvim.wait_for(
        BUFFER_LUA.replace("return ", "return ... == ", 1), TIMEOUT, "the accepted text", expected
    )
    # The cursor ends after the inserted text, still in insert mode.
    text, at_after = buffer_and_cursor(nvim)
    assert text == expected
    assert at_after == at + len(ghost["text"])
    assert nvim.request("nvim_get_mode")["mode"] == "i"
    # The server reported its state and a latency for the status line.
    status = nvim.wait_for(
        "local s = require('wd_lsp').status(); return s.state == 'ready' and s.lastLatencyMs and s",
        TIMEOUT,
        "a ready status with a latency",
    )
    assert status["lastLatencyMs"] >= 0
    assert nvim.lua("return require('wd_lsp').statusline()").startswith("wd-lsp ")


@pytest.mark.slow
def test_extmark_accept_line_then_dismiss(open_nvim):
    nvim = open_nvim("0.11", "extmark")
    ghost = type_and_wait_for_ghost(nvim, "extmark")
    before, at = buffer_and_cursor(nvim)
    # Accept line takes the suggestion up to its first line break (a leading break goes with the
    # line after it); the rest stays on screen.
    text = ghost["text"]
    nl = text.find("\n", 1 if text.startswith("\n") else 0)
    piece, remaining = (text, "") if nl < 0 else (text[:nl], text[nl:])

    nvim.input("<M-l>")
    expected = before[:at] + piece + before[at:]
    nvim.wait_for(
        BUFFER_LUA.replace("return ", "return ... == ", 1), TIMEOUT, "the accepted line", expected
    )
    if not remaining:
        return
    shown = nvim.wait_for(GHOST_LUA, TIMEOUT, "the rest of the ghost text", "extmark")
    assert shown["text"] == remaining

    nvim.input("<C-]>")
    nvim.wait_for(
        "local ns = vim.api.nvim_create_namespace('wd_lsp_ghost');"
        " return #vim.api.nvim_buf_get_extmarks(0, ns, 0, -1, {}) == 0",
        TIMEOUT,
        "the ghost text to be dismissed",
    )
    assert nvim.lua(BUFFER_LUA) == expected


@pytest.mark.slow
def test_checkhealth_reports_a_working_setup(open_nvim):
    nvim = open_nvim("0.12", "native")
    nvim.command("checkhealth wd_lsp")
    report = nvim.lua(BUFFER_LUA)
    assert "ghost text: built-in vim.lsp.inline_completion" in report
    assert "server offers textDocument/inlineCompletion" in report
    assert "ERROR" not in report, report
