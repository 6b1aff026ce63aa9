-- Local acceptance statistics: tells the server which of its items were shown and accepted
-- (wdLsp.shown, wdLsp.accepted). The server only counts them per language (`acceptance` in
-- :WdLsp status); nothing is sent anywhere else.
local compat = require('wd_lsp.compat')

local M = {}

local reported = {} -- ids already reported as shown
local count = 0
local MAX_REMEMBERED = 1000

-- The id the server gave an item, from its `command` ({ id = ..., kind = 'full' }).
function M.id(command)
  local args = type(command) == 'table' and command.arguments
  local first = type(args) == 'table' and args[1]
  local id = type(first) == 'table' and first.id
  return type(id) == 'string' and id or nil
end

local function execute(client, command, arguments)
  -- Errors (an older server without the command) are of no interest to the user.
  compat.request(client, 'workspace/executeCommand', {
    command = command,
    arguments = arguments,
  }, function() end)
end

-- An item was drawn on screen; each id is reported once.
function M.shown(client, id)
  if not client or not id or reported[id] then
    return
  end
  if count >= MAX_REMEMBERED then
    reported, count = {}, 0
  end
  reported[id], count = true, count + 1
  execute(client, 'wdLsp.shown', { { id = id } })
end

-- The whole item was inserted: run its own command, as the LSP specification says.
function M.accepted(client, command, bufnr)
  if not client or type(command) ~= 'table' or type(command.command) ~= 'string' then
    return
  end
  if client.exec_cmd then
    -- Neovim 0.11+: honours client-side commands and the server's executeCommandProvider.
    client:exec_cmd(command, { bufnr = bufnr })
  else
    execute(client, command.command, command.arguments)
  end
end

-- Part of the item was inserted: kind 'word' or 'line'.
function M.partially_accepted(client, id, kind)
  if client and id then
    execute(client, 'wdLsp.accepted', { { id = id, kind = kind } })
  end
end

-- The next piece of `rest` that a word or line accept inserts. Blanks and line breaks in front
-- go with the piece after them.
local WORD = '[%w_\128-\255]'
local PUNCT = '[^%w_\128-\255%s]'

function M.next_word(rest)
  local lead = rest:match('^%s*')
  local after = rest:sub(#lead + 1)
  local word = after:match('^' .. WORD .. '+') or after:match('^' .. PUNCT .. '+') or ''
  return lead .. word
end

function M.next_line(rest)
  local from = rest:sub(1, 1) == '\n' and 2 or 1
  local nl = rest:find('\n', from, true)
  return nl and rest:sub(1, nl - 1) or rest
end

return M
