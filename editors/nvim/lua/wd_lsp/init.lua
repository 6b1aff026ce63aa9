-- wd-lsp for Neovim: require('wd_lsp').setup{...} starts the `wd-lsp` language server for every
-- buffer with a filetype and shows its inline completions as ghost text.
local compat = require('wd_lsp.compat')
local config = require('wd_lsp.config')
local status = require('wd_lsp.status')

local api = vim.api
local M = {}

local NAME = 'wd_lsp'

-- The ghost text backend: 'extmark' (wd_lsp.ghost) unless 'native' (vim.lsp.inline_completion)
-- is asked for and this Neovim has it. The plugin draws its own by default on 0.12 too: the
-- built-in keeps showing, and accepts, a suggestion the line no longer fits until the next
-- answer comes (native.lua has the details), and has no partial accept of its own.
function M.backend_name()
  if config.options.ghost_text == 'native' and require('wd_lsp.native').available() then
    return 'native'
  end
  return 'extmark'
end

function M.backend()
  return require(M.backend_name() == 'native' and 'wd_lsp.native' or 'wd_lsp.ghost')
end

function M.client()
  return vim.lsp.get_clients({ name = NAME })[1]
end

local function wanted(bufnr)
  if vim.bo[bufnr].buftype ~= '' or vim.bo[bufnr].filetype == '' then
    return false
  end
  local fts = config.options.filetypes
  return fts == nil or vim.tbl_contains(fts, '*') or vim.tbl_contains(fts, vim.bo[bufnr].filetype)
end

local function root_dir(bufnr)
  local root = vim.fs.root and vim.fs.root(bufnr, config.options.root_markers)
  return root or vim.fn.getcwd()
end

function M.start(bufnr)
  bufnr = (bufnr == nil or bufnr == 0) and api.nvim_get_current_buf() or bufnr
  if not wanted(bufnr) then
    return nil
  end
  local opts = config.options
  local settings = config.server_settings()
  return vim.lsp.start({
    name = NAME,
    cmd = opts.cmd,
    cmd_env = opts.cmd_env,
    root_dir = root_dir(bufnr),
    init_options = settings,
    -- Neovim sends these in workspace/didChangeConfiguration after initialize.
    settings = { wdLsp = settings },
    handlers = status.handlers(opts.log_lines),
    on_exit = function(code, signal)
      if code ~= 0 or signal ~= 0 then
        status.set({ state = 'error', message = ('server exited (code %d, signal %d)'):format(code, signal) })
      end
    end,
  }, {
    bufnr = bufnr,
    -- One server per Neovim, whatever the buffer's project: the engine behind it is shared anyway.
    reuse_client = function(client, conf)
      return client.name == conf.name
    end,
  })
end

local function on_attach(args)
  local client = vim.lsp.get_client_by_id(args.data.client_id)
  if not client or client.name ~= NAME then
    return
  end
  M.backend().attach(args.buf, client.id)
end

-- Engine start-up progress ($/progress, which Neovim also keeps for vim.lsp.status()).
local function on_progress(args)
  local data = args.data or {}
  local client = data.client_id and vim.lsp.get_client_by_id(data.client_id)
  if not client or client.name ~= NAME or type(data.params) ~= 'table' then
    return
  end
  status.progress(data.params.value, config.options.notify_progress)
end

-- Sends the current settings to the running server.
local function push_settings()
  local client = M.client()
  if not client then
    return
  end
  client.settings = { wdLsp = config.server_settings() }
  compat.notify(client, 'workspace/didChangeConfiguration', { settings = client.settings })
end

function M.is_enabled()
  return config.options.settings.enabled ~= false
end

function M.enable(enabled)
  if enabled == nil then
    enabled = true
  end
  config.options.settings.enabled = enabled
  M.backend().set_enabled(enabled)
  push_settings()
  if not enabled then
    status.set({ state = 'disabled', message = 'completions are off' })
  end
end

function M.toggle()
  M.enable(not M.is_enabled())
  vim.notify('wd-lsp completions ' .. (M.is_enabled() and 'on' or 'off'))
end

-- Changes server settings at run time, e.g. require('wd_lsp').configure{ maxTokens = 32 }.
function M.configure(settings)
  config.options.settings = vim.tbl_deep_extend('force', config.options.settings, settings or {})
  if settings and settings.enabled ~= nil then
    M.backend().set_enabled(settings.enabled)
  end
  push_settings()
end

local function execute(command, callback)
  local client = M.client()
  if not client then
    vim.notify('wd-lsp: the server is not running', vim.log.levels.WARN)
    return
  end
  compat.request(client, 'workspace/executeCommand', { command = command, arguments = {} }, function(err, result)
    if err then
      vim.notify(('wd-lsp: %s failed: %s'):format(command, err.message or vim.inspect(err)), vim.log.levels.ERROR)
    elseif callback then
      callback(result)
    end
  end)
end

function M.restart_engine()
  execute('wdLsp.restartEngine', function()
    vim.notify('wd-lsp: engine restarting')
  end)
end

-- `verbose`: the whole map the server answers, as it is.
function M.show_status(verbose)
  execute('wdLsp.status', function(result)
    if verbose or type(result) ~= 'table' then
      vim.notify('wd-lsp status\n' .. vim.inspect(result))
    else
      vim.notify(status.describe(result))
    end
  end)
end

function M.show_log()
  vim.cmd('botright new')
  local buf = api.nvim_get_current_buf()
  vim.bo[buf].buftype = 'nofile'
  vim.bo[buf].bufhidden = 'wipe'
  vim.bo[buf].swapfile = false
  api.nvim_buf_set_name(buf, 'wd-lsp://log')
  local lines = #status.log > 0 and status.log or { '(no messages from the server yet)' }
  api.nvim_buf_set_lines(buf, 0, -1, false, lines)
  vim.bo[buf].modifiable = false
  api.nvim_win_set_cursor(0, { api.nvim_buf_line_count(buf), 0 })
end

-- For a statusline: %{v:lua.require'wd_lsp'.statusline()}
function M.statusline()
  return status.statusline()
end

function M.status()
  return vim.deepcopy(status.state)
end

-- Mapping actions; each returns whether it did something.
function M.accept()
  return M.backend().accept()
end

function M.accept_word()
  return M.backend().accept_word()
end

function M.accept_line()
  return M.backend().accept_line()
end

-- Asks for a suggestion now (triggerKind Invoked), e.g. after dismissing one.
function M.trigger()
  return M.backend().trigger()
end

-- { items = { text still to insert, ... }, index = the shown one } (the plugin's ghost text).
function M.suggestions()
  return M.backend().suggestions()
end

function M.next()
  return M.backend().next()
end

function M.prev()
  return M.backend().prev()
end

function M.dismiss()
  return M.backend().dismiss()
end

function M.visible()
  return M.backend().visible()
end

local function set_keymaps()
  local keys = config.options.keymaps or {}
  local function map(lhs, fn, desc)
    if not lhs then
      return
    end
    vim.keymap.set('i', lhs, function()
      if not M.visible() then
        -- No suggestion: the key does what it would do without the plugin (keymap.set replaces
        -- the key codes of what an expr mapping returns; replacing them here too breaks <M-…>).
        return lhs
      end
      -- Buffer edits are not allowed while an <expr> mapping is evaluated.
      vim.schedule(fn)
      return ''
    end, { expr = true, silent = true, desc = 'wd-lsp: ' .. desc })
  end
  map(keys.accept, M.accept, 'accept the suggestion')
  map(keys.accept_word, M.accept_word, 'accept a word of the suggestion')
  map(keys.accept_line, M.accept_line, 'accept a line of the suggestion')
  map(keys.next, M.next, 'next suggestion')
  map(keys.prev, M.prev, 'previous suggestion')
  map(keys.dismiss, M.dismiss, 'dismiss the suggestion')
  if keys.trigger then
    -- Acts with or without a suggestion shown.
    vim.keymap.set('i', keys.trigger, function()
      M.trigger()
    end, { silent = true, desc = 'wd-lsp: ask for a suggestion now' })
  end
end

local SUBCOMMANDS = {
  status = M.show_status,
  toggle = M.toggle,
  enable = function()
    M.enable(true)
  end,
  disable = function()
    M.enable(false)
  end,
  restart = M.restart_engine,
  log = M.show_log,
}

local function create_command()
  api.nvim_create_user_command('WdLsp', function(cmd)
    local fn = SUBCOMMANDS[cmd.args ~= '' and cmd.args or 'status']
    if not fn then
      vim.notify('wd-lsp: unknown subcommand ' .. cmd.args, vim.log.levels.ERROR)
      return
    end
    fn(cmd.bang)
  end, {
    nargs = '?',
    bang = true,
    complete = function()
      return vim.tbl_keys(SUBCOMMANDS)
    end,
    desc = 'wd-lsp: status | toggle | enable | disable | restart (engine) | log',
  })
end

function M.setup(opts)
  if vim.fn.has('nvim-0.10') == 0 then
    vim.notify('wd-lsp needs Neovim 0.10 or newer', vim.log.levels.ERROR)
    return
  end
  config.set(opts)
  api.nvim_set_hl(0, 'WdLspGhostText', { link = 'Comment', default = true })
  api.nvim_set_hl(0, 'WdLspGhostTextCount', { link = 'WdLspGhostText', default = true })
  local group = api.nvim_create_augroup('wd_lsp', { clear = true })
  api.nvim_create_autocmd('FileType', {
    group = group,
    callback = function(args)
      M.start(args.buf)
    end,
  })
  api.nvim_create_autocmd('LspAttach', { group = group, callback = on_attach })
  api.nvim_create_autocmd('LspProgress', { group = group, callback = on_progress })
  status.on_ready = function()
    M.backend().refresh()
  end
  set_keymaps()
  create_command()
  -- Buffers opened before setup() ran.
  for _, bufnr in ipairs(api.nvim_list_bufs()) do
    if api.nvim_buf_is_loaded(bufnr) then
      M.start(bufnr)
    end
  end
  M.backend().set_enabled(M.is_enabled())
end

return M
