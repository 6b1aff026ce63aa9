-- Ghost text drawn by the plugin (its default on every Neovim; init.lua says why not the 0.12
-- built-in): debounced textDocument/inlineCompletion requests, the stale one cancelled; the
-- first line of the suggestion as inline virt_text at the cursor, the rest as virt_lines below.
--
-- Each item is kept as its text from where its range starts (the line start, in wd-lsp's
-- answers) together with the rest of the line after the cursor. It is shown while the line
-- still fits it: typing it, deleting back, partial accepts and switching between items need no
-- new request, and an item that no longer fits disappears at once.
local acceptance = require('wd_lsp.acceptance')
local compat = require('wd_lsp.compat')
local config = require('wd_lsp.config')

local api = vim.api
local uv = vim.uv or vim.loop
local ns = api.nvim_create_namespace('wd_lsp_ghost')

local M = { enabled = true }

-- lsp.InlineCompletionTriggerKind
local INVOKED = 1
local AUTOMATIC = 2

---@class wd_lsp.GhostItem
---@field start integer[] {row, col}, 0-based bytes: where `text` begins.
---@field text string The item's text from `start` (including what was already typed there).
---@field tail string The line after the request's cursor; the item fits only while it is so.
---@field delete_after integer Bytes after the cursor the item replaces (e.g. a closing bracket).
---@field command? lsp.Command
---@field id? string

---@class wd_lsp.GhostState
---@field client_id integer
---@field timer? uv.uv_timer_t
---@field pending? integer Id of the request in flight.
---@field items wd_lsp.GhostItem[]
---@field index integer
---@field asked? integer[] {row, col} of the request the items answer.
---@field show_index boolean Show "(2/3)" after the text (once the user has cycled).

---@type table<integer, wd_lsp.GhostState>
local buffers = {}

local function client_of(state)
  return state and vim.lsp.get_client_by_id(state.client_id)
end

local function cursor(bufnr)
  local win = api.nvim_get_current_win()
  if api.nvim_win_get_buf(win) ~= bufnr then
    return nil
  end
  local pos = api.nvim_win_get_cursor(win)
  return pos[1] - 1, pos[2]
end

local function line_at(bufnr, row)
  return api.nvim_buf_get_lines(bufnr, row, row + 1, false)[1] or ''
end

local function cancel(state)
  if state.pending then
    local client = client_of(state)
    if client then
      compat.cancel_request(client, state.pending)
    end
    state.pending = nil
  end
  if state.timer then
    state.timer:stop()
  end
end

local function hide(bufnr)
  if api.nvim_buf_is_valid(bufnr) then
    api.nvim_buf_clear_namespace(bufnr, ns, 0, -1)
  end
end

local function clear(bufnr)
  local state = buffers[bufnr]
  if state then
    state.items, state.index, state.asked, state.show_index = {}, 1, nil, false
  end
  hide(bufnr)
end

-- The part of `item` still to insert at the cursor, or nil when the buffer no longer fits it.
local function remainder(bufnr, item)
  local row, col = cursor(bufnr)
  if not row or not item then
    return nil
  end
  local s = item.start
  if row < s[1] or (row == s[1] and col < s[2]) then
    return nil
  end
  if line_at(bufnr, row):sub(col + 1) ~= item.tail then
    return nil -- the cursor moved within the line, or text after it changed
  end
  local ok, lines = pcall(api.nvim_buf_get_text, bufnr, s[1], s[2], row, col, {})
  if not ok then
    return nil -- the start is gone (lines deleted)
  end
  local typed = table.concat(lines, '\n')
  if item.text:sub(1, #typed) ~= typed then
    return nil
  end
  return item.text:sub(#typed + 1)
end

local function fits(bufnr, item)
  local rest = remainder(bufnr, item)
  return rest ~= nil and rest ~= ''
end

local function render(bufnr, text, hint)
  hide(bufnr)
  local row, col = cursor(bufnr)
  if not row or text == '' then
    return
  end
  local hl = config.options.hl_group
  local tab = string.rep(' ', vim.bo[bufnr].tabstop)
  local lines = vim.split(text:gsub('\t', tab), '\n', { plain = true })
  local chunks = {}
  for i, line in ipairs(lines) do
    chunks[i] = { { line, hl } }
  end
  if hint then
    table.insert(chunks[#chunks], { hint, 'WdLspGhostTextCount' })
  end
  local opts = { virt_text = chunks[1], virt_text_pos = 'inline', hl_mode = 'combine' }
  if #chunks > 1 then
    opts.virt_lines = { unpack(chunks, 2) }
  end
  api.nvim_buf_set_extmark(bufnr, ns, row, col, opts)
end

-- Shows the current item if it still fits; returns whether it did.
local function show(bufnr)
  local state = buffers[bufnr]
  local item = state and state.items[state.index]
  local rest = remainder(bufnr, item)
  if not rest or rest == '' then
    hide(bufnr)
    return false
  end
  local hint = state.show_index and #state.items > 1
    and (' (%d/%d)'):format(state.index, #state.items)
  render(bufnr, rest, hint or nil)
  acceptance.shown(client_of(state), item.id)
  return true
end

-- Makes the current item one that fits (the current one if it does); returns whether any does.
local function fit(bufnr, state)
  if fits(bufnr, state.items[state.index]) then
    return true
  end
  for i, item in ipairs(state.items) do
    if fits(bufnr, item) then
      state.index = i
      return true
    end
  end
  return false
end

local function snippet_text(value)
  local ok, grammar = pcall(require, 'vim.lsp._snippet_grammar')
  if ok then
    local parsed_ok, parsed = pcall(grammar.parse, value)
    if parsed_ok then
      return tostring(parsed)
    end
  end
  return value
end

-- Turns an lsp.InlineCompletionItem answering a request at (row, col) into a GhostItem.
local function to_item(bufnr, raw, encoding, row, col)
  local text = raw.insertText
  if type(text) == 'table' then
    text = snippet_text(text.value or '')
  end
  if type(text) ~= 'string' then
    return nil
  end
  local start, delete_after = { row, col }, 0
  if raw.range then
    local s, e = raw.range.start, raw.range['end']
    local ok, scol = pcall(compat.byte_col, bufnr, s, encoding)
    local ok_end, ecol = pcall(compat.byte_col, bufnr, e, encoding)
    if not ok or not ok_end then
      return nil
    end
    if s.line > row or (s.line == row and scol > col) then
      return nil
    end
    if e.line ~= row or ecol < col then
      return nil -- replaces other lines, or ends before the cursor: not a ghost text
    end
    start, delete_after = { s.line, scol }, ecol - col
  end
  local tail = line_at(bufnr, row):sub(col + 1)
  if delete_after > 0 and not text:find('\n', 1, true) then
    -- A single-line item that rewrites a closing ")" etc.: keep the part already on the line
    -- out of the item, so the ghost text doesn't repeat it.
    local replaced = tail:sub(1, delete_after)
    if text:sub(-#replaced) == replaced then
      text, delete_after = text:sub(1, #text - #replaced), 0
    end
  end
  return {
    start = start,
    text = text,
    tail = tail,
    delete_after = delete_after,
    command = raw.command,
    id = acceptance.id(raw.command),
  }
end

-- `step`: the user asked for the next (1) or previous (-1) item; show that one when it comes.
local function request(bufnr, kind, step)
  local state = buffers[bufnr]
  local client = client_of(state)
  if not client or not M.enabled or api.nvim_get_mode().mode:sub(1, 1) ~= 'i' then
    return
  end
  local row, col = cursor(bufnr)
  if not row then
    return
  end
  cancel(state)
  local tick = api.nvim_buf_get_changedtick(bufnr)
  local params = vim.lsp.util.make_position_params(0, client.offset_encoding)
  params.context = { triggerKind = kind }
  local ok, id
  ok, id = compat.request(client, 'textDocument/inlineCompletion', params, function(err, result)
    if state.pending ~= id then
      return -- superseded
    end
    state.pending = nil
    local r, c = cursor(bufnr)
    if err or not result or api.nvim_buf_get_changedtick(bufnr) ~= tick or r ~= row or c ~= col then
      return -- the buffer moved on; a newer request follows
    end
    local items, seen = {}, {}
    for _, raw in ipairs(result.items or result) do
      local item = to_item(bufnr, raw, client.offset_encoding, row, col)
      local rest = item and remainder(bufnr, item)
      -- Items that differ only in what the line already has are the same suggestion.
      if rest and rest ~= '' and not seen[rest] then
        seen[rest] = true
        items[#items + 1] = item
      end
    end
    state.items, state.index, state.asked, state.show_index = items, 1, { row, col }, false
    if step and #items > 1 then
      state.index, state.show_index = step > 0 and 2 or #items, true
    end
    if not show(bufnr) and kind == INVOKED then
      api.nvim_echo({ { 'wd-lsp: no suggestion here', 'Comment' } }, false, {})
    end
  end, bufnr)
  state.pending = ok and id or nil
end

local function schedule_request(bufnr)
  local state = buffers[bufnr]
  cancel(state)
  state.timer = state.timer or uv.new_timer()
  state.timer:start(config.options.debounce_ms, 0, vim.schedule_wrap(function()
    if buffers[bufnr] == state and api.nvim_buf_is_valid(bufnr) then
      request(bufnr, AUTOMATIC)
    end
  end))
end

-- Whether the cursor is before where the shown items were asked for (the user deleted).
local function behind(bufnr, asked)
  local row, col = cursor(bufnr)
  return asked ~= nil and row ~= nil and (row < asked[1] or (row == asked[1] and col < asked[2]))
end

-- On every keystroke/cursor move: keep showing an item while the line fits it, otherwise drop
-- the ghost text at once; ask again unless the user is typing what is shown.
local function on_change(bufnr)
  local state = buffers[bufnr]
  if not M.enabled or not state then
    return
  end
  if fit(bufnr, state) then
    show(bufnr)
    if not behind(bufnr, state.asked) then
      return
    end
    -- Deleted back past the request: the item still fits, but the server may know better.
  else
    clear(bufnr)
  end
  schedule_request(bufnr)
end

function M.attach(bufnr, client_id)
  if buffers[bufnr] then
    buffers[bufnr].client_id = client_id
    return
  end
  buffers[bufnr] = { client_id = client_id, items = {}, index = 1, show_index = false }
  local group = api.nvim_create_augroup('wd_lsp_ghost_' .. bufnr, { clear = true })
  api.nvim_create_autocmd({ 'InsertEnter', 'TextChangedI', 'CursorMovedI' }, {
    group = group,
    buffer = bufnr,
    callback = function()
      on_change(bufnr)
    end,
  })
  api.nvim_create_autocmd({ 'InsertLeave', 'BufLeave' }, {
    group = group,
    buffer = bufnr,
    callback = function()
      M.dismiss(bufnr)
    end,
  })
  api.nvim_create_autocmd({ 'BufUnload', 'LspDetach' }, {
    group = group,
    buffer = bufnr,
    callback = function()
      M.detach(bufnr)
    end,
  })
end

function M.detach(bufnr)
  local state = buffers[bufnr]
  if not state then
    return
  end
  cancel(state)
  if state.timer and not state.timer:is_closing() then
    state.timer:close()
  end
  buffers[bufnr] = nil
  pcall(api.nvim_del_augroup_by_name, 'wd_lsp_ghost_' .. bufnr)
  hide(bufnr)
end

local function buf(bufnr)
  return (bufnr == nil or bufnr == 0) and api.nvim_get_current_buf() or bufnr
end

-- The shown item and what is left of it, or nil.
local function current(bufnr)
  local state = buffers[bufnr]
  local item = state and state.items[state.index]
  local rest = remainder(bufnr, item)
  if not rest or rest == '' then
    return nil
  end
  return state, item, rest
end

function M.visible(bufnr)
  return current(buf(bufnr)) ~= nil
end

local function insert(bufnr, text, delete_after)
  local row, col = cursor(bufnr)
  local lines = vim.split(text, '\n', { plain = true })
  local line_len = #line_at(bufnr, row)
  api.nvim_buf_set_text(bufnr, row, col, row, math.min(col + (delete_after or 0), line_len), lines)
  local last = #lines == 1 and col + #lines[1] or #lines[#lines]
  api.nvim_win_set_cursor(0, { row + #lines, last })
end

-- Inserts the whole suggestion. Returns false when there is none (so <Tab> can fall back).
-- Must run outside textlock: the mappings call it through vim.schedule.
function M.accept(bufnr)
  bufnr = buf(bufnr)
  local state, item, rest = current(bufnr)
  if not state then
    return false
  end
  clear(bufnr)
  insert(bufnr, rest, item.delete_after)
  acceptance.accepted(client_of(state), item.command, bufnr)
  return true
end

-- Inserts the next piece of the suggestion (`kind` 'word' or 'line'); the rest stays shown and
-- no new request is made.
local function accept_part(bufnr, kind, piece_of)
  bufnr = buf(bufnr)
  local state, item, rest = current(bufnr)
  if not state then
    return false
  end
  local piece = piece_of(rest)
  if piece == rest then
    return M.accept(bufnr)
  end
  insert(bufnr, piece)
  acceptance.partially_accepted(client_of(state), item.id, kind)
  show(bufnr)
  return true
end

function M.accept_word(bufnr)
  return accept_part(bufnr, 'word', acceptance.next_word)
end

function M.accept_line(bufnr)
  return accept_part(bufnr, 'line', acceptance.next_line)
end

local function cycle(bufnr, step)
  bufnr = buf(bufnr)
  local state = buffers[bufnr]
  if not state or not fit(bufnr, state) then
    return false
  end
  local fitting = 0
  for _, item in ipairs(state.items) do
    fitting = fitting + (fits(bufnr, item) and 1 or 0)
  end
  if fitting < 2 then
    -- One suggestion: ask for more (triggerKind Invoked); the server adds other candidates.
    if not state.pending and M.enabled then
      cancel(state)
      request(bufnr, INVOKED, step)
    end
    return true
  end
  -- Skip items that no longer fit what was typed since they arrived.
  repeat
    state.index = (state.index - 1 + step) % #state.items + 1
  until fits(bufnr, state.items[state.index])
  state.show_index = true
  return show(bufnr)
end

function M.next(bufnr)
  return cycle(bufnr, 1)
end

function M.prev(bufnr)
  return cycle(bufnr, -1)
end

-- Asks for a suggestion now (triggerKind Invoked: the server skips its debounce).
function M.trigger(bufnr)
  bufnr = buf(bufnr)
  local state = buffers[bufnr]
  if not state or not M.enabled then
    return false
  end
  cancel(state)
  request(bufnr, INVOKED)
  return true
end

-- The engine just became ready: ask for the place the user typed at while it was loading
-- (those requests were answered empty).
function M.refresh()
  local bufnr = api.nvim_get_current_buf()
  local state = buffers[bufnr]
  if state and M.enabled and not state.pending and api.nvim_get_mode().mode:sub(1, 1) == 'i' then
    if not fit(bufnr, state) then
      schedule_request(bufnr)
    end
  end
end

function M.dismiss(bufnr)
  bufnr = buf(bufnr)
  local state = buffers[bufnr]
  if state then
    cancel(state)
  end
  clear(bufnr)
end

-- The items that fit the line now, what is left of each, and which one is shown.
function M.suggestions(bufnr)
  bufnr = buf(bufnr)
  local state = buffers[bufnr]
  local out = { index = 0, items = {} }
  if not state then
    return out
  end
  for i, item in ipairs(state.items) do
    local rest = remainder(bufnr, item)
    if rest and rest ~= '' then
      out.items[#out.items + 1] = rest
      if i == state.index then
        out.index = #out.items
      end
    end
  end
  return out
end

function M.set_enabled(enabled)
  M.enabled = enabled
  if not enabled then
    for bufnr in pairs(buffers) do
      M.dismiss(bufnr)
    end
  end
end

function M.attached(bufnr)
  return buffers[bufnr] ~= nil
end

return M
