-- Neovim 0.12+: the built-in vim.lsp.inline_completion draws and accepts the ghost text; this
-- module enables it per buffer and adds what it lacks (accept line, dismiss).
local compat = require('wd_lsp.compat')

local api = vim.api
local M = { enabled = true }

local function ic()
  return compat.native_inline_completion()
end

local attached = {}

function M.available()
  local mod = ic()
  return mod ~= nil and mod.enable ~= nil and mod.get ~= nil
end

function M.attach(bufnr, _client_id)
  attached[bufnr] = true
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

-- The built-in schedules the edit itself, so this is safe inside an <expr> mapping.
function M.accept(bufnr)
  return ic().get({ bufnr = buf(bufnr) })
end

-- Inserts only the first line of the suggestion; the built-in asks again on the cursor move and
-- the server answers the rest from its cache.
function M.accept_line(bufnr)
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
      -- Same rule as the extmark path: a leading newline takes the next line with it.
      local typed = table.concat(api.nvim_buf_get_text(0, srow, scol, row, col, {}), '\n')
      local rest = text:sub(1, #typed) == typed and text:sub(#typed + 1) or text
      local start = rest:sub(1, 1) == '\n' and 2 or 1
      local nl = rest:find('\n', start, true)
      local piece = nl and rest:sub(1, nl - 1) or rest
      local lines = vim.split(piece, '\n', { plain = true })
      api.nvim_buf_set_text(0, row, col, row, col, lines)
      local last = #lines == 1 and col + #lines[1] or #lines[#lines]
      api.nvim_win_set_cursor(win, { row + #lines, last })
    end,
  })
end

function M.next(_bufnr)
  ic().select({ count = 1 })
  return true
end

function M.prev(_bufnr)
  ic().select({ count = -1 })
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
