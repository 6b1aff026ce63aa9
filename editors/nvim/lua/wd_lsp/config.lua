-- Options of require('wd_lsp').setup{} and their defaults.
local M = {}

M.defaults = {
  -- Command that starts the language server (stdio).
  cmd = { 'wd-lsp' },
  -- Extra environment for the server process (e.g. { WD_LSP_MODEL = '/models/coder' }).
  cmd_env = nil,
  -- Filetypes to attach to; nil means every buffer with a filetype. The server also filters
  -- with settings.enabledLanguages.
  filetypes = nil,
  -- Used for the server's root directory; the current directory when none is found.
  root_markers = { '.git', 'pyproject.toml', 'package.json', 'Cargo.toml', 'go.mod', 'Makefile' },
  -- Server configuration, sent as initializationOptions and workspace/didChangeConfiguration
  -- under "wdLsp". Keys left nil take the server's defaults: enabled, model, engine
  -- ({socket, tcp, token}), debounceMs, maxTokens, multiline, enabledLanguages, temperature, beams.
  settings = {},
  -- 'auto' (the same as 'extmark'): ghost text drawn by this plugin, on every Neovim version.
  -- 'native': Neovim 0.12's built-in vim.lsp.inline_completion draws it (see editors/README.md
  -- for what it does differently).
  ghost_text = 'auto',
  -- Extmark path only: wait this long after a keystroke before asking the server.
  debounce_ms = 30,
  -- Extmark path only: highlight group of the ghost text.
  hl_group = 'WdLspGhostText',
  -- Insert-mode mappings; set any to false to leave the key alone. The accept keys fall back to
  -- what the key does without the plugin when no suggestion is shown.
  keymaps = {
    accept = '<Tab>',
    accept_word = '<M-Right>',
    accept_line = '<M-l>',
    next = '<M-]>',
    prev = '<M-[>',
    dismiss = '<C-]>',
    trigger = '<M-\\>',
  },
  -- A notification when the engine starts loading the model (the first completion waits for
  -- it) and when it is ready; the status line shows the progress either way.
  notify_progress = true,
  -- How many server log messages (window/logMessage) :WdLsp log keeps.
  log_lines = 1000,
}

M.options = vim.deepcopy(M.defaults)

function M.set(opts)
  M.options = vim.tbl_deep_extend('force', vim.deepcopy(M.defaults), opts or {})
  if type(M.options.cmd) == 'string' then
    M.options.cmd = { M.options.cmd }
  end
  return M.options
end

-- The object the server reads under "wdLsp". Only keys the user set are sent; empty tables
-- become JSON objects, not arrays.
function M.server_settings()
  local s = vim.deepcopy(M.options.settings or {})
  if type(s.engine) == 'table' and next(s.engine) == nil then
    s.engine = nil
  end
  return next(s) == nil and vim.empty_dict() or s
end

return M
