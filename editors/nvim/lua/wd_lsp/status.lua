-- Engine state from the server's `wdLsp/status` notification, and a ring of its log messages.
local M = {}

M.state = { state = 'starting', message = '', lastLatencyMs = nil }
M.log = {}

local LEVELS = { 'ERROR', 'WARN', 'INFO', 'LOG', 'DEBUG' }

local function fire()
  -- Lets statuslines redraw: autocmd User WdLspStatus.
  vim.api.nvim_exec_autocmds('User', { pattern = 'WdLspStatus', modeline = false })
end

function M.set(params)
  M.state = {
    state = params.state or 'error',
    message = params.message or '',
    lastLatencyMs = params.lastLatencyMs ~= vim.NIL and params.lastLatencyMs or nil,
  }
  fire()
end

function M.add_log(kind, text, max)
  table.insert(M.log, ('%s [%s] %s'):format(os.date('%H:%M:%S'), kind, text))
  while #M.log > max do
    table.remove(M.log, 1)
  end
end

-- A short string for a statusline: "wd-lsp 42ms", "wd-lsp loading", ...
function M.statusline()
  local s = M.state
  if s.state == 'ready' and s.lastLatencyMs then
    return ('wd-lsp %dms'):format(math.floor(s.lastLatencyMs + 0.5))
  end
  return 'wd-lsp ' .. s.state
end

-- LSP handlers merged into the client's config.
function M.handlers(max_log)
  return {
    ['wdLsp/status'] = function(_, params)
      M.set(params or {})
      if params and params.state == 'error' then
        M.add_log('status', params.message or 'error', max_log)
      end
    end,
    ['window/logMessage'] = function(err, params, ctx)
      M.add_log(LEVELS[params.type] or 'LOG', params.message, max_log)
      -- Keep Neovim's default too (errors and warnings in the LSP log).
      return vim.lsp.handlers['window/logMessage'](err, params, ctx)
    end,
  }
end

return M
