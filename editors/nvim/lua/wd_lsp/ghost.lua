-- Ghost text drawn by the plugin (Neovim 0.10 / 0.11, or ghost_text = 'extmark'):
-- debounced textDocument/inlineCompletion requests, the stale one cancelled; the first line of
-- the suggestion as inline virt_text at the cursor, the rest as virt_lines below it.
local compat = require('wd_lsp.compat')
local config = require('wd_lsp.config')

local api = vim.api
local uv = vim.uv or vim.loop
local ns = api.nvim_create_namespace('wd_lsp_ghost')

local M = { enabled = true }

local TRIGGER_AUTOMATIC = 2 -- lsp.InlineCompletionTriggerKind.Automatic

---@class wd_lsp.GhostItem
---@field text string What to insert at the anchor (the part already typed is cut off).
---@field delete_after integer Bytes after the cursor the item replaces (e.g. a closing bracket).

---@class wd_lsp.GhostState
---@field client_id integer
---@field timer? uv.uv_timer_t
---@field pending? integer Id of the request in flight.
---@field items wd_lsp.GhostItem[]
---@field index integer
---@field anchor? integer[] {row, col}, 0-based bytes: where the items start.

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
    state.items, state.index, state.anchor = {}, 1, nil
  end
  hide(bufnr)
end

-- Text typed since the anchor (may span lines), or nil when the cursor is before it.
local function typed_since_anchor(bufnr, state)
  local row, col = cursor(bufnr)
  local a = state.anchor
  if not row or not a or row < a[1] or (row == a[1] and col < a[2]) then
    return nil
  end
  return table.concat(api.nvim_buf_get_text(bufnr, a[1], a[2], row, col, {}), '\n')
end

-- The part of the current item still to insert, or nil if what was typed diverged from it.
local function remainder(bufnr, state)
  local item = state.items[state.index]
  local typed = item and typed_since_anchor(bufnr, state)
  if not typed or item.text:sub(1, #typed) ~= typed then
    return nil
  end
  return item.text:sub(#typed + 1), item
end

local function render(bufnr, text)
  hide(bufnr)
  local row, col = cursor(bufnr)
  if not row or text == '' then
    return
  end
  local hl = config.options.hl_group
  local tab = string.rep(' ', vim.bo[bufnr].tabstop)
  local lines = vim.split(text:gsub('\t', tab), '\n', { plain = true })
  local opts = {
    virt_text = { { lines[1], hl } },
    virt_text_pos = 'inline',
    hl_mode = 'combine',
  }
  if #lines > 1 then
    opts.virt_lines = {}
    for i = 2, #lines do
      opts.virt_lines[i - 1] = { { lines[i], hl } }
    end
  end
  api.nvim_buf_set_extmark(bufnr, ns, row, col, opts)
end

-- Shows the current item if it still fits what is in the buffer; returns whether it did.
local function show(bufnr)
  local state = buffers[bufnr]
  local rest = state and remainder(bufnr, state)
  if not rest or rest == '' then
    hide(bufnr)
    return false
  end
  render(bufnr, rest)
  return true
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

-- Turns an lsp.InlineCompletionItem into text relative to the cursor at (row, col).
local function to_item(bufnr, item, encoding, row, col)
  local text = item.insertText
  if type(text) == 'table' then
    text = snippet_text(text.value or '')
  end
  if type(text) ~= 'string' then
    return nil
  end
  local delete_after = 0
  if item.range then
    local s, e = item.range.start, item.range['end']
    local scol = compat.byte_col(bufnr, s, encoding)
    if s.line > row or (s.line == row and scol > col) then
      return nil
    end
    -- The range may start before the cursor: drop the part the user already typed.
    local typed = table.concat(api.nvim_buf_get_text(bufnr, s.line, scol, row, col, {}), '\n')
    if text:sub(1, #typed) ~= typed then
      return nil
    end
    text = text:sub(#typed + 1)
    if e.line == row then
      delete_after = math.max(0, compat.byte_col(bufnr, e, encoding) - col)
    end
  end
  if delete_after > 0 and not text:find('\n', 1, true) then
    -- A single-line item that rewrites a closing ")" etc.: show it without the part that is
    -- already on the line, so the ghost text doesn't repeat it.
    local line = api.nvim_buf_get_lines(bufnr, row, row + 1, true)[1]
    local replaced = line:sub(col + 1, col + delete_after)
    if text:sub(-#replaced) == replaced then
      text, delete_after = text:sub(1, #text - #replaced), 0
    end
  end
  if text == '' then
    return nil
  end
  return { text = text, delete_after = delete_after }
end

local function request(bufnr)
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
  params.context = { triggerKind = TRIGGER_AUTOMATIC }
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
    local items = {}
    for _, raw in ipairs(result.items or result) do
      local item = to_item(bufnr, raw, client.offset_encoding, row, col)
      if item then
        items[#items + 1] = item
      end
    end
    state.items, state.index, state.anchor = items, 1, { row, col }
    show(bufnr)
  end, bufnr)
  state.pending = ok and id or nil
end

local function schedule_request(bufnr)
  local state = buffers[bufnr]
  cancel(state)
  state.timer = state.timer or uv.new_timer()
  state.timer:start(config.options.debounce_ms, 0, vim.schedule_wrap(function()
    if buffers[bufnr] == state and api.nvim_buf_is_valid(bufnr) then
      request(bufnr)
    end
  end))
end

-- On every keystroke/cursor move: keep the ghost text while the user types what it shows,
-- otherwise drop it and ask again after the debounce.
local function on_change(bufnr)
  if not M.enabled then
    return
  end
  if show(bufnr) then
    return
  end
  clear(bufnr)
  schedule_request(bufnr)
end

function M.attach(bufnr, client_id)
  if buffers[bufnr] then
    buffers[bufnr].client_id = client_id
    return
  end
  buffers[bufnr] = { client_id = client_id, items = {}, index = 1 }
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

local function current(bufnr)
  bufnr = (bufnr == nil or bufnr == 0) and api.nvim_get_current_buf() or bufnr
  local state = buffers[bufnr]
  if not state then
    return bufnr, nil
  end
  local rest, item = remainder(bufnr, state)
  return bufnr, rest ~= '' and rest or nil, item
end

function M.visible(bufnr)
  local _, rest = current(bufnr)
  return rest ~= nil
end

local function insert(bufnr, text, delete_after)
  local row, col = cursor(bufnr)
  local lines = vim.split(text, '\n', { plain = true })
  api.nvim_buf_set_text(bufnr, row, col, row, col + (delete_after or 0), lines)
  local last = #lines == 1 and col + #lines[1] or #lines[#lines]
  api.nvim_win_set_cursor(0, { row + #lines, last })
end

-- Inserts the whole suggestion. Returns false when there is none (so <Tab> can fall back).
-- Must run outside textlock: the mappings call it through vim.schedule.
function M.accept(bufnr)
  local rest, item
  bufnr, rest, item = current(bufnr)
  if not rest then
    return false
  end
  clear(bufnr)
  insert(bufnr, rest, item.delete_after)
  return true
end

-- Inserts up to the end of the suggestion's current line (or its next line, if the cursor is
-- at the end of one); the rest stays shown.
function M.accept_line(bufnr)
  local rest
  bufnr, rest = current(bufnr)
  if not rest then
    return false
  end
  local start = rest:sub(1, 1) == '\n' and 2 or 1
  local nl = rest:find('\n', start, true)
  if not nl then
    return M.accept(bufnr)
  end
  insert(bufnr, rest:sub(1, nl - 1))
  show(bufnr)
  return true
end

local function cycle(bufnr, step)
  bufnr = (bufnr == nil or bufnr == 0) and api.nvim_get_current_buf() or bufnr
  local state = buffers[bufnr]
  if not state or #state.items < 2 then
    return false
  end
  -- Skip items that no longer fit what was typed since they arrived.
  for _ = 1, #state.items do
    state.index = (state.index - 1 + step) % #state.items + 1
    if show(bufnr) then
      return true
    end
  end
  return false
end

function M.next(bufnr)
  return cycle(bufnr, 1)
end

function M.prev(bufnr)
  return cycle(bufnr, -1)
end

function M.dismiss(bufnr)
  bufnr = (bufnr == nil or bufnr == 0) and api.nvim_get_current_buf() or bufnr
  local state = buffers[bufnr]
  if state then
    cancel(state)
  end
  clear(bufnr)
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
