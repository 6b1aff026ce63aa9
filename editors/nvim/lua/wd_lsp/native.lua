-- ghost_text = 'native' (Neovim 0.12+): the built-in vim.lsp.inline_completion draws the ghost
-- text and accepts it; this module enables it per buffer and adds what it lacks.
--
-- The built-in keeps the item it showed across edits: it redraws it after any key without
-- checking that the line still fits it, and its accept applies the item's range as it was when
-- the answer came (a <BS> then <Tab> raises "Invalid 'end_col'", a mismatching key then <Tab>
-- overwrites that key). Until Neovim checks this itself, the plugin wraps the built-in's
-- (private) show step: an item that no longer fits is dropped at once, one that still fits gets
-- its range moved to the cursor. If the internals are not what this expects, the built-in is
-- left as it is.
local acceptance = require('wd_lsp.acceptance')
local compat = require('wd_lsp.compat')

local api = vim.api
local M = { enabled = true }

local INVOKED = 1 -- lsp.InlineCompletionTriggerKind.Invoked

local function ic()
  return compat.native_inline_completion()
end

local attached = {}

function M.available()
  local mod = ic()
  return mod ~= nil and mod.enable ~= nil and mod.get ~= nil
end

-- The built-in's class (vim.lsp._capability is private), or nil when it is not as expected.
local function completor_class()
  local ok, capability = pcall(require, 'vim.lsp._capability')
  local class = ok and type(capability.all) == 'table' and capability.all.inline_completion
  if
    type(class) == 'table'
    and type(class.show) == 'function'
    and type(class.hide) == 'function'
    and type(class.request) == 'function'
    and type(class.active) == 'table'
  then
    return class
  end
  return nil
end

local function ours(client_id)
  local client = client_id and vim.lsp.get_client_by_id(client_id)
  return client ~= nil and client.name == 'wd_lsp'
end

-- The line after the cursor when an item was first shown; it fits only while that stays so.
local tails = setmetatable({}, { __mode = 'k' })

-- Whether the built-in's current item still fits the buffer; moves its range end to the cursor.
local function refit(completor, item)
  local text, range = item.insert_text, item.range
  if type(text) ~= 'string' or not range or not range.start or not range.end_ then
    return true -- nothing to check against
  end
  local win = vim.fn.bufwinid(completor.bufnr)
  if win == -1 or api.nvim_win_get_buf(win) ~= completor.bufnr then
    return false
  end
  local row, col = unpack(api.nvim_win_get_cursor(win))
  row = row - 1
  local s = range.start
  if row ~= s.row or row ~= range.end_.row or col < s.col then
    return false
  end
  local line = api.nvim_buf_get_lines(completor.bufnr, row, row + 1, false)[1] or ''
  local tail = tails[item]
  if tail == nil then
    if col < range.end_.col then
      return false -- the answer is for a later cursor position
    end
    tail = line:sub(col + 1)
    tails[item] = tail
  end
  local typed = line:sub(s.col + 1, col)
  if line:sub(col + 1) ~= tail or text:sub(1, #typed) ~= typed or #typed >= #text then
    return false
  end
  if range.end_.col ~= col then
    item.range = vim.range(s.row, s.col, row, col, { buf = completor.bufnr })
  end
  return true
end

local patched = false

local function patch()
  local class = completor_class()
  if patched or not class or not vim.range then
    return
  end
  patched = true
  local show = class.show
  class.show = function(self, ...)
    local item = self.current
    if not item or not ours(item.client_id) then
      return show(self, ...)
    end
    local ok, fits = pcall(refit, self, item)
    if ok and not fits then
      self:hide()
      self.current = nil
      return
    end
    show(self, ...)
    acceptance.shown(vim.lsp.get_client_by_id(item.client_id), acceptance.id(item.command))
  end
end

function M.attach(bufnr, _client_id)
  attached[bufnr] = true
  patch()
  if M.enabled then
    ic().enable(true, { bufnr = bufnr })
  end
end

function M.detach(bufnr)
  attached[bufnr] = nil
end

local function buf(bufnr)
  return (bufnr == nil or bufnr == 0) and api.nvim_get_current_buf() or bufnr
end

-- The built-in schedules the edit itself (and runs the item's command), so this is safe inside
-- an <expr> mapping.
function M.accept(bufnr)
  return ic().get({ bufnr = buf(bufnr) })
end

-- Inserts the next word or line of the suggestion. The built-in drops its item on any accept,
-- so it asks again after this; the server answers the rest from its memory.
local function accept_part(bufnr, kind, piece_of)
  return ic().get({
    bufnr = buf(bufnr),
    on_accept = function(item)
      local text = type(item.insert_text) == 'string' and item.insert_text or item.insert_text.value
      local win = api.nvim_get_current_win()
      local row, col = unpack(api.nvim_win_get_cursor(win))
      row = row - 1
      local srow, scol = row, col
      if item.range then
        srow, scol = item.range.start.row, item.range.start.col
      end
      local ok, head = pcall(api.nvim_buf_get_text, 0, srow, scol, row, col, {})
      if not ok then
        return -- the item no longer fits the buffer
      end
      local typed = table.concat(head, '\n')
      local rest = text:sub(1, #typed) == typed and text:sub(#typed + 1) or text
      local piece = piece_of(rest)
      local lines = vim.split(piece, '\n', { plain = true })
      api.nvim_buf_set_text(0, row, col, row, col, lines)
      local last = #lines == 1 and col + #lines[1] or #lines[#lines]
      api.nvim_win_set_cursor(win, { row + #lines, last })
      local client = vim.lsp.get_client_by_id(item.client_id)
      if piece == rest then
        acceptance.accepted(client, item.command, api.nvim_get_current_buf())
      else
        acceptance.partially_accepted(client, acceptance.id(item.command), kind)
      end
    end,
  })
end

function M.accept_word(bufnr)
  return accept_part(bufnr, 'word', acceptance.next_word)
end

function M.accept_line(bufnr)
  return accept_part(bufnr, 'line', acceptance.next_line)
end

function M.next(_bufnr)
  ic().select({ count = 1 })
  return true
end

function M.prev(_bufnr)
  ic().select({ count = -1 })
  return true
end

-- Asks now with triggerKind Invoked. The built-in has no public way to; without its internals
-- this does nothing.
function M.trigger(bufnr)
  local class = completor_class()
  local completor = class and class.active[buf(bufnr)]
  if not completor or not M.enabled then
    return false
  end
  completor:request(INVOKED)
  return true
end

-- The built-in has no public dismiss: switching it off and on for the buffer drops the current
-- item and its pending request; the next keystroke asks again.
function M.dismiss(bufnr)
  bufnr = buf(bufnr)
  if attached[bufnr] and M.enabled then
    ic().enable(false, { bufnr = bufnr })
    ic().enable(true, { bufnr = bufnr })
  end
end

-- The built-in's extmarks live in this namespace; used by visible() and the tests.
function M.namespace()
  return api.nvim_create_namespace('nvim.lsp.inline_completion')
end

function M.visible(bufnr)
  bufnr = buf(bufnr)
  return #api.nvim_buf_get_extmarks(bufnr, M.namespace(), 0, -1, { limit = 1 }) > 0
end

-- The built-in's items are private: only the shown one is known here.
function M.suggestions(_bufnr)
  return { index = 0, items = {} }
end

-- The engine just became ready: the built-in asks again on the next keystroke.
function M.refresh() end

function M.set_enabled(enabled)
  M.enabled = enabled
  for bufnr in pairs(attached) do
    if api.nvim_buf_is_valid(bufnr) then
      ic().enable(enabled, { bufnr = bufnr })
    else
      attached[bufnr] = nil
    end
  end
end

function M.attached(bufnr)
  return attached[bufnr] ~= nil
end

return M
