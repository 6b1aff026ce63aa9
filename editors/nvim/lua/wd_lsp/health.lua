-- :checkhealth wd_lsp
local M = {}

function M.check()
  local health = vim.health
  local config = require('wd_lsp.config')
  local status = require('wd_lsp.status')
  local wd = require('wd_lsp')

  health.start('wd-lsp: Neovim')
  local v = vim.version()
  local version = ('%d.%d.%d'):format(v.major, v.minor, v.patch)
  if vim.fn.has('nvim-0.10') == 0 then
    health.error('Neovim ' .. version .. ' is too old', { 'wd-lsp needs Neovim 0.10 or newer' })
  else
    health.ok('Neovim ' .. version)
  end
  local backend = wd.backend_name()
  if backend == 'native' then
    health.ok('ghost text: built-in vim.lsp.inline_completion (ghost_text = "native")')
  elseif config.options.ghost_text == 'native' then
    health.warn('ghost text: drawn by wd-lsp with extmarks', {
      'ghost_text = "native" needs vim.lsp.inline_completion (Neovim 0.12+)',
    })
  else
    health.ok('ghost text: drawn by wd-lsp with extmarks')
  end

  health.start('wd-lsp: server')
  local cmd = config.options.cmd or {}
  if not cmd[1] then
    health.error('no server command', { "setup{ cmd = { 'wd-lsp' } }" })
  elseif vim.fn.executable(cmd[1]) == 1 then
    health.ok(('server command: %s (%s)'):format(table.concat(cmd, ' '), vim.fn.exepath(cmd[1])))
  else
    health.error(('`%s` is not executable or not on PATH'):format(cmd[1]), {
      'Install the server from a checkout of wd-lsp: pip install -e /path/to/wd-lsp',
      "Or give its full path (e.g. in a virtual environment):"
        .. " require('wd_lsp').setup{ cmd = { '/path/to/venv/bin/wd-lsp' } }",
    })
  end

  local client = wd.client()
  if not client then
    health.warn('the server is not running', { 'Open a file with a filetype; see :WdLsp log and :LspLog' })
    return
  end
  health.ok(('server running (client id %d, root %s)'):format(client.id, client.root_dir or '-'))
  local caps = client.server_capabilities or {}
  if caps.inlineCompletionProvider then
    health.ok('server offers textDocument/inlineCompletion')
  else
    health.error('server does not offer textDocument/inlineCompletion', { 'Is `cmd` really wd-lsp?' })
  end

  local s = status.state
  local line = ('engine: %s%s'):format(s.state, s.message ~= '' and (' — ' .. s.message) or '')
  if s.progress then
    line = line .. ' (' .. s.progress .. ')'
  end
  if s.state == 'ready' or s.state == 'starting' or s.state == 'loading' then
    health.ok(line)
  elseif s.state == 'idle' then
    -- Not connected yet: the engine starts (or is found running) on the first completion.
    health.ok(line .. ' (the engine starts on the first completion)')
  elseif s.state == 'disabled' then
    health.warn(line, { ':WdLsp enable' })
  else
    health.error(line, { ':WdLsp log for the server messages', ':WdLsp restart to restart the engine' })
  end
  if s.lastLatencyMs and not s.message:find('last completion', 1, true) then
    health.info(('last completion: %d ms'):format(math.floor(s.lastLatencyMs + 0.5)))
  end
end

return M
