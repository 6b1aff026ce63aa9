"""Neovim end to end: a real headless nvim driven over msgpack-RPC (`nvim_input`, as a user
types), the real wd-lsp server and engine.

Set-ups:
- `0.12-builtin`: Neovim 0.12 without the plugin, configured with the snippet from
  editors/README.md (vim.lsp.config/enable, vim.lsp.inline_completion, a <Tab> mapping);
- `0.12-builtin-plugin`: the plugin with ghost_text = 'native' (the built-in draws);
- `0.12-plugin`, `0.11-plugin`: the plugin's default (it draws the ghost text itself).
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
from editor_bins import Unavailable, nvim_binary
from nvim_rpc import Nvim

REPO = Path(__file__).resolve().parents[2]
PLUGIN = REPO / "editors" / "nvim"

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
# Lines where a manual trigger gets several distinct suggestions from the embedded model (the
# first that does is used).
CYCLE_LINES = ["    x = ", "    y = math.", "    return fibonacci(n - 1) + "]
# A line where the embedded model suggests several lines.
MULTILINE_AT = "    for k in range(3):"


class Setup:
    def __init__(self, label: str, plugin: bool, ghost_text: str | None):
        self.label, self.plugin, self.ghost_text = label, plugin, ghost_text

    @property
    def native(self) -> bool:
        """Whether Neovim's built-in inline completion draws the ghost text."""
        return not self.plugin or self.ghost_text == "native"


SETUPS = {
    "0.12-builtin": Setup("0.12", plugin=False, ghost_text=None),
    "0.12-builtin-plugin": Setup("0.12", plugin=True, ghost_text="native"),
    "0.12-plugin": Setup("0.12", plugin=True, ghost_text="auto"),
    "0.11-plugin": Setup("0.11", plugin=True, ghost_text="auto"),
}

# What every init.lua starts with: notifications and $/progress as the user would see them.
RECORD_LUA = """\
local t = vim.json.decode(os.getenv('WD_LSP_TEST_NVIM'))
vim.opt.swapfile = false
_G.wd_test = { notes = {}, progress = {} }
local notify = vim.notify
vim.notify = function(msg, level, opts)
  table.insert(_G.wd_test.notes, msg)
  return notify(msg, level, opts)
end
vim.api.nvim_create_autocmd('LspProgress', {
  callback = function()
    table.insert(_G.wd_test.progress, vim.lsp.status())
  end,
})
"""

PLUGIN_LUA = """\
vim.opt.rtp:prepend(t.plugin)
require('wd_lsp').setup({ cmd = t.cmd, ghost_text = t.ghost_text })
"""

# The ghost text on screen: first line (virt_text) and the lines below it (virt_lines), without
# the "(2/3)" hint, plus where it is anchored; nil while none is shown.
GHOST_LUA = """\
local native = ...
local name = native and 'nvim.lsp.inline_completion' or 'wd_lsp_ghost'
local ns = vim.api.nvim_create_namespace(name)
local marks = vim.api.nvim_buf_get_extmarks(0, ns, 0, -1, { details = true })
if #marks == 0 then return nil end
local d = marks[1][4]
local hint = ''
local function join(chunks)
  local s = ''
  for _, c in ipairs(chunks or {}) do
    if c[2] == 'ComplHintMore' or c[2] == 'WdLspGhostTextCount' then
      hint = hint .. c[1]
    else
      s = s .. c[1]
    end
  end
  return s
end
local lines = { join(d.virt_text) }
for _, l in ipairs(d.virt_lines or {}) do lines[#lines + 1] = join(l) end
local text = table.concat(lines, '\\n')
if text == '' then return nil end
return { text = text, row = marks[1][2], col = marks[1][3], hint = hint }
"""

BUFFER_LUA = "return table.concat(vim.api.nvim_buf_get_lines(0, 0, -1, false), '\\n')"
LINE_LUA = "return vim.api.nvim_get_current_line()"
CURSOR_LUA = "local p = vim.api.nvim_win_get_cursor(0); return { p[1] - 1, p[2] }"

# The server's wdLsp.status map.
STATUS_LUA = """\
local c = vim.lsp.get_clients({ name = 'wd_lsp' })[1]
local r = c:request_sync('workspace/executeCommand', { command = 'wdLsp.status', arguments = {} },
  10000)
return r and r.result
"""

MESSAGES_LUA = "return vim.api.nvim_exec2('messages', { output = true }).output"

# Logs the inline completion requests the client sends: their trigger kinds, how many were sent,
# and the number of the last one whose answer was handled (drawn, if it had a suggestion).
LOG_REQUESTS_LUA = """\
local c = vim.lsp.get_clients({ name = 'wd_lsp' })[1]
local log = { triggers = {}, sent = 0, answered = 0 }
_G.wd_test.requests = log
local request = c.request
c.request = function(self, method, params, handler, ...)
  if method == 'textDocument/inlineCompletion' then
    table.insert(log.triggers, params.context and params.context.triggerKind or 0)
    log.sent = log.sent + 1
    local n, inner = log.sent, handler
    handler = function(err, ...)
      local r = inner(err, ...)
      if not err then
        log.answered = math.max(log.answered, n)
      end
      return r
    end
  end
  return request(self, method, params, handler, ...)
end
"""


def readme_snippet() -> str:
    """The plugin-free Neovim 0.12 set-up from editors/README.md, with the test's server."""
    readme = (REPO / "editors" / "README.md").read_text()
    blocks = re.findall(r"```lua\n(.*?)```", readme, re.S)
    snippet = next(b for b in blocks if "vim.lsp.inline_completion.enable()" in b)
    assert snippet.count("{ 'wd-lsp' }") == 1, snippet
    return snippet.replace("{ 'wd-lsp' }", "t.cmd")


def _binary(label: str) -> Path:
    try:
        return nvim_binary(label)
    except Unavailable as exc:
        pytest.skip(f"Neovim {label} is not available: {exc}")


@pytest.fixture
def open_nvim(tmp_path, editor_env, server_cmd):
    started: list[Nvim] = []

    def start(name: str, env: dict | None = None) -> Nvim:
        setup = SETUPS[name]
        binary = _binary(setup.label)
        init = RECORD_LUA + (PLUGIN_LUA if setup.plugin else readme_snippet())
        (tmp_path / "init.lua").write_text(init)
        (tmp_path / "fib.py").write_text(SOURCE)
        env = dict(env or editor_env)
        env["WD_LSP_TEST_NVIM"] = json.dumps(
            {"plugin": str(PLUGIN), "cmd": server_cmd, "ghost_text": setup.ghost_text}
        )
        nvim = Nvim(
            str(binary), ["--clean", "-u", str(tmp_path / "init.lua"), "-n"], str(tmp_path), env
        )
        started.append(nvim)
        if setup.plugin:
            backend = nvim.lua("return require('wd_lsp').backend_name()")
            assert backend == ("native" if setup.native else "extmark")
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


def ghost(nvim: Nvim, name: str):
    return nvim.lua(GHOST_LUA, SETUPS[name].native)


def wait_for_ghost(nvim: Nvim, name: str, timeout: float = TIMEOUT, what: str = "ghost text"):
    """The ghost text once one is shown at the cursor."""
    code = (
        "local src = ...; local g = assert(loadstring(src))(select(2, ...))"
        "; local p = vim.api.nvim_win_get_cursor(0)"
        "; return g and g.row == p[1] - 1 and g.col == p[2] and g"
    )
    return nvim.wait_for(code, timeout, what, GHOST_LUA, SETUPS[name].native)


def type_line(nvim: Nvim, text: str, typed: str = ""):
    """Leaves insert mode, sets the cursor line to `text`, then appends `typed` key by key."""
    nvim.input("<Esc>")
    nvim.wait_for("return vim.api.nvim_get_mode().mode == 'n'", TIMEOUT, "normal mode")
    nvim.lua(
        "local row, text = ...; vim.api.nvim_buf_set_lines(0, row - 1, row, false, { text });"
        " vim.api.nvim_win_set_cursor(0, { row, 0 })",
        CURSOR_LINE,
        text,
    )
    nvim.input("A")
    for ch in typed:
        nvim.input(ch)
    nvim.wait_for(
        "return vim.api.nvim_get_current_line() == ...", TIMEOUT, "the typed text", text + typed
    )
    assert nvim.request("nvim_get_mode")["mode"] == "i"


def type_and_wait_for_ghost(nvim: Nvim, name: str) -> dict:
    """Opens the line in insert mode, types like a user and returns the ghost text that appears."""
    type_line(nvim, "    ", TYPED)
    shown = wait_for_ghost(nvim, name, FIRST_GHOST_TIMEOUT)
    assert shown["text"].strip(), shown
    return shown


def buffer_and_cursor(nvim: Nvim) -> tuple[str, int]:
    """The buffer text and the cursor as an offset into it."""
    text = nvim.lua(BUFFER_LUA)
    row, col = nvim.lua(CURSOR_LUA)
    lines = text.split("\n")
    offset = sum(len(line.encode()) + 1 for line in lines[:row]) + col
    return text, len(text.encode()[:offset].decode())


def wait_for_buffer(nvim: Nvim, expected: str, what: str):
    nvim.wait_for(BUFFER_LUA.replace("return ", "return ... == ", 1), TIMEOUT, what, expected)


def server_status(nvim: Nvim) -> dict:
    status = nvim.lua(STATUS_LUA)
    assert status, "wdLsp.status did not answer"
    return status


def assert_no_error(nvim: Nvim, after: str):
    errmsg = nvim.lua("return vim.v.errmsg")
    messages = nvim.lua(MESSAGES_LUA)
    assert errmsg == "", f"after {after}: v:errmsg = {errmsg!r}"
    assert not re.search(r"Error|E\d+:|stack traceback", messages), f"after {after}: {messages}"
    mode = nvim.request("nvim_get_mode")
    assert mode == {"mode": "i", "blocking": False}, f"after {after}: {mode}"


def next_word(rest: str) -> str:
    """What a word accept takes (wd_lsp.acceptance.next_word)."""
    word = "[A-Za-z0-9_\x80-\U0010ffff]"
    punct = "[^A-Za-z0-9_\x80-\U0010ffff \t\n\r\f\v]"
    return re.match(rf"[ \t\n\r\f\v]*(?:{word}+|{punct}+)?", rest).group(0)


def next_line(rest: str) -> str:
    """What a line accept takes (wd_lsp.acceptance.next_line)."""
    nl = rest.find("\n", 1 if rest.startswith("\n") else 0)
    return rest if nl < 0 else rest[:nl]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SETUPS))
def test_ghost_text_appears_and_tab_accepts_it(open_nvim, name):
    nvim = open_nvim(name)
    shown = type_and_wait_for_ghost(nvim, name)
    before, at = buffer_and_cursor(nvim)
    # (Buffer lines joined: no final newline.)
    assert before == SOURCE.replace("    \n\nprint", f"    {TYPED}\n\nprint").removesuffix("\n")
    expected = before[:at] + shown["text"] + before[at:]

    nvim.input("<Tab>")
    wait_for_buffer(nvim, expected, "the accepted text")
    # The cursor ends after the inserted text, still in insert mode.
    text, at_after = buffer_and_cursor(nvim)
    assert text == expected
    assert at_after == at + len(shown["text"])
    assert_no_error(nvim, "<Tab>")
    # The accept ran the item's command: the server counted it (and the plugin told it the item
    # was shown; the built-in alone does not).
    counts = nvim.wait_for(
        "local s = assert(loadstring((...)))(); local a = s.acceptance and s.acceptance.python"
        "; return a and a.accepted >= 1 and a",
        TIMEOUT,
        "the accept to be counted",
        STATUS_LUA,
    )
    assert counts["shown"] >= (1 if SETUPS[name].plugin else 0), counts
    if SETUPS[name].plugin:
        status = nvim.wait_for(
            "local s = require('wd_lsp').status()"
            "; return s.state == 'ready' and s.lastLatencyMs and s",
            TIMEOUT,
            "a ready status with a latency",
        )
        assert status["lastLatencyMs"] >= 0
        assert nvim.lua("return require('wd_lsp').statusline()").startswith("wd-lsp ")


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SETUPS))
def test_edits_while_a_suggestion_is_shown(open_nvim, name):
    """<BS>, a key the suggestion does not have, and <C-u>: no error, and a fresh suggestion
    follows. With the plugin, the stale suggestion is gone as soon as the key is typed."""
    nvim = open_nvim(name)
    native = SETUPS[name].native
    nvim.lua(LOG_REQUESTS_LUA)
    old = type_and_wait_for_ghost(nvim, name)["text"]
    mismatch = "Q" if not old.startswith("Q") else "Z"
    line = f"    {TYPED}"
    for key, after in [
        ("<BS>", line[:-1]),
        (mismatch, line[:-1] + mismatch),
        ("<C-u>", "    "),
    ]:
        nvim.lua("vim.v.errmsg = ''")
        sent = nvim.lua("return _G.wd_test.requests.sent")
        nvim.input(key)
        nvim.wait_for(LINE_LUA.replace("return ", "return ... == ", 1), TIMEOUT, key, after)
        if key == mismatch and SETUPS[name].plugin:
            now = ghost(nvim, name)
            stale = {old, old[1:]}
            assert now is None or now["text"] not in stale, f"stale ghost text after {key}: {now}"
        # A new request went out, and once its answer is in, its suggestion is shown.
        nvim.wait_for(
            "return _G.wd_test.requests.answered > ...", TIMEOUT, f"an answer after {key}", sent
        )
        old = wait_for_ghost(nvim, name, 5, f"a fresh suggestion after {key}")["text"]
        assert_no_error(nvim, key)
        if not native:
            # What is shown fits what the line has now.
            assert nvim.lua("return require('wd_lsp').suggestions()")["items"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["0.12-plugin", "0.11-plugin", "0.12-builtin-plugin"])
def test_partial_accept(open_nvim, name):
    nvim = open_nvim(name)
    native = SETUPS[name].native
    rest = type_and_wait_for_ghost(nvim, name)["text"]
    for key, piece_of, kind in [("<M-Right>", next_word, "word"), ("<M-l>", next_line, "line")]:
        piece = piece_of(rest)
        before, at = buffer_and_cursor(nvim)
        requests = server_status(nvim)["requests"]
        nvim.input(key)
        wait_for_buffer(nvim, before[:at] + piece + before[at:], f"the {kind} accepted")
        rest = rest[len(piece) :]
        assert_no_error(nvim, key)
        if not rest:
            break  # that was all of it: a full accept
        if native:
            # The built-in drops its item on any accept and asks again.
            rest = wait_for_ghost(nvim, name, what=f"the rest after {key}")["text"]
            continue
        # The rest stays on screen, from the same answer: no new request.
        assert ghost(nvim, name)["text"] == rest
        time.sleep(0.3)  # longer than the plugin's debounce
        assert server_status(nvim)["requests"] == requests
        assert ghost(nvim, name)["text"] == rest
    counts = server_status(nvim)["acceptance"]["python"]
    assert counts["partialWord"] == 1, counts
    # :WdLsp status tells the counts.
    nvim.command("WdLsp status")
    summary = nvim.wait_for(
        "for _, n in ipairs(_G.wd_test.notes) do"
        " if n:find('python: shown', 1, true) then return n end end",
        TIMEOUT,
        ":WdLsp status",
    )
    assert summary.startswith("wd-lsp ") and "engine ready" in summary, summary
    assert f"in part: {counts['partialWord']} by word" in summary, summary


@pytest.mark.slow
@pytest.mark.parametrize("name", ["0.12-plugin", "0.11-plugin"])
def test_partial_accept_of_several_lines(open_nvim, name):
    """A line accept takes the line break in front with it; the rest moves to the new line and
    stays shown, from the same answer."""
    nvim = open_nvim(name)
    type_line(nvim, MULTILINE_AT)
    nvim.input("<M-\\>")
    rest = wait_for_ghost(nvim, name, what="a suggestion of several lines")["text"]
    assert rest.startswith("\n") and rest.count("\n") >= 2, rest
    requests = server_status(nvim)["requests"]
    for key, piece_of in [("<M-l>", next_line), ("<M-Right>", next_word), ("<M-l>", next_line)]:
        piece = piece_of(rest)
        before, at = buffer_and_cursor(nvim)
        nvim.input(key)
        wait_for_buffer(nvim, before[:at] + piece + before[at:], f"{piece!r} accepted")
        rest = rest[len(piece) :]
        assert wait_for_ghost(nvim, name, what=f"the rest after {key}")["text"] == rest
    assert server_status(nvim)["requests"] == requests
    before, at = buffer_and_cursor(nvim)
    nvim.input("<Tab>")
    wait_for_buffer(nvim, before[:at] + rest + before[at:], "the rest accepted")
    assert_no_error(nvim, "the partial accepts")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["0.12-plugin", "0.11-plugin", "0.12-builtin-plugin"])
def test_manual_trigger_and_cycling(open_nvim, name):
    nvim = open_nvim(name)
    native = SETUPS[name].native
    nvim.lua(LOG_REQUESTS_LUA)
    if not native:
        # With one suggestion, "next" asks for more (triggerKind Invoked).
        type_and_wait_for_ghost(nvim, name)
        if len(nvim.lua("return require('wd_lsp').suggestions()")["items"]) == 1:
            nvim.lua("_G.wd_test.requests.triggers = {}")
            nvim.input("<M-]>")
            nvim.wait_for(
                "return vim.tbl_contains(_G.wd_test.requests.triggers, 1)",
                TIMEOUT,
                "a request for more",
            )
    for line in CYCLE_LINES:
        # Entering insert mode schedules an automatic request; the trigger replaces it.
        type_line(nvim, line)
        nvim.input("<M-\\>")
        first = wait_for_ghost(nvim, name, what=f"a suggestion after the trigger on {line!r}")
        if native:
            nvim.input("<M-]>")
            second = nvim.wait_for(
                "local g = assert(loadstring((...)))(true); return g and g.hint ~= '' and g",
                TIMEOUT,
                "the next suggestion",
                GHOST_LUA,
            )
            if second["text"] != first["text"]:
                break
        else:
            items = nvim.lua("return require('wd_lsp').suggestions()")["items"]
            if len(items) > 1:
                break
    else:
        pytest.fail(f"no line in {CYCLE_LINES} gave several suggestions")
    triggers = nvim.lua("return _G.wd_test.requests.triggers")
    assert 1 in triggers, f"no request with triggerKind Invoked: {triggers}"
    before, at = buffer_and_cursor(nvim)
    if native:
        assert second["hint"].startswith(" (2/")
        shown = second["text"]
    else:
        assert first["text"] == items[0] and first["hint"] == ""
        nvim.input("<M-]>")
        second = nvim.wait_for(
            "local g = assert(loadstring((...)))(false); return g and g.hint ~= '' and g",
            TIMEOUT,
            "the next suggestion",
            GHOST_LUA,
        )
        assert (second["text"], second["hint"]) == (items[1], f" (2/{len(items)})")
        nvim.input("<M-[>")
        nvim.wait_for(
            "local src, want = ...; local g = assert(loadstring(src))(false)"
            "; return g and g.text == want",
            TIMEOUT,
            "the previous suggestion",
            GHOST_LUA,
            items[0],
        )
        nvim.input("<M-[>")  # wraps around to the last
        last = nvim.wait_for(
            "local src, want = ...; local g = assert(loadstring(src))(false)"
            "; return g and g.text == want and g",
            TIMEOUT,
            "the last suggestion",
            GHOST_LUA,
            items[-1],
        )
        assert last["hint"] == f" ({len(items)}/{len(items)})"
        shown = items[-1]
    nvim.input("<Tab>")
    wait_for_buffer(nvim, before[:at] + shown + before[at:], "the cycled-to suggestion accepted")
    assert_no_error(nvim, "cycling")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["0.12-plugin", "0.11-plugin"])
def test_dismiss_then_trigger(open_nvim, name):
    nvim = open_nvim(name)
    type_and_wait_for_ghost(nvim, name)
    nvim.input("<C-]>")
    nvim.wait_for(
        "return assert(loadstring((...)))(false) == nil", TIMEOUT, "the dismissed ghost", GHOST_LUA
    )
    time.sleep(0.3)  # nothing comes back by itself
    assert ghost(nvim, name) is None
    nvim.input("<M-\\>")
    wait_for_ghost(nvim, name, what="a suggestion after the trigger")
    assert_no_error(nvim, "<C-]> and <M-\\>")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["0.12-builtin", "0.12-plugin"])
def test_first_start_shows_progress(own_engine_env, open_nvim, name):
    """A new engine: its start-up progress reaches vim.lsp.status(); the plugin tells it in a
    notification and in its status line, and asks again once the engine is ready."""
    nvim = open_nvim(name, env=own_engine_env)
    if SETUPS[name].plugin:
        # Typed while the model loads: the plugin's request then is answered empty.
        type_and_wait_for_ghost(nvim, name)
        notes = nvim.lua("return _G.wd_test.notes")
        assert any(n.startswith("wd-lsp: starting the engine") for n in notes), notes
        assert any(n.startswith("wd-lsp: engine ready") for n in notes), notes
        assert nvim.lua("return require('wd_lsp').status().progress") is None
    else:
        # The built-in asks again only when the cursor moves: a user waits for the progress
        # to end, then types.
        nvim.wait_for(
            "for _, p in ipairs(_G.wd_test.progress) do"
            " if p:find('engine ready', 1, true) then return true end end",
            FIRST_GHOST_TIMEOUT,
            "the end of the engine's start-up progress",
        )
        type_and_wait_for_ghost(nvim, name)
    progress = nvim.lua("return _G.wd_test.progress")
    assert any(p.startswith("wd-lsp engine: starting the engine") for p in progress), progress
    assert_no_error(nvim, "the first completion")


@pytest.mark.slow
@pytest.mark.parametrize(("ghost_text", "backend"), [("auto", "extmarks"), ("native", "built-in")])
def test_checkhealth_reports_a_working_setup(open_nvim, ghost_text, backend):
    nvim = open_nvim("0.12-plugin" if ghost_text == "auto" else "0.12-builtin-plugin")
    nvim.command("checkhealth wd_lsp")
    report = nvim.lua(BUFFER_LUA)
    assert "ghost text: " in report and backend in report, report
    assert "server offers textDocument/inlineCompletion" in report
    assert "ERROR" not in report, report
