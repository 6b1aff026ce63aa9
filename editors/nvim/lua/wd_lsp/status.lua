-- Engine state from the server's `wdLsp/status` notification and its engine start-up
-- `$/progress`, and a ring of its log messages.
local M = {}

M.state = { state = 'starting', message = '', lastLatencyMs = nil, progress = nil }
M.log = {}

local LEVELS = { 'ERROR', 'WARN', 'INFO', 'LOG', 'DEBUG' }

local function fire()
  -- Lets statuslines redraw: autocmd User WdLspStatus.
  vim.api.nvim_exec_autocmds('User', { pattern = 'WdLspStatus', modeline = false })
end

-- Called when the engine becomes ready (set by init.lua).
M.on_ready = nil

function M.set(params)
  local was = M.state.state
  M.state = {
    state = params.state or 'error',
    message = params.message or '',
    lastLatencyMs = params.lastLatencyMs ~= vim.NIL and params.lastLatencyMs or nil,
    progress = M.state.progress,
  }
  if M.state.state == 'ready' or M.state.state == 'error' then
    M.state.progress = nil -- the start ended, whatever comes of its $/progress
  end
  fire()
  if M.state.state == 'ready' and was ~= 'ready' and M.on_ready then
    M.on_ready()
  end
end

-- A `$/progress` value of the server's (engine start-up: "starting the engine", "loading the
-- model (12 s)", ...). With `notify`, its begin and end are told once each.
function M.progress(value, notify)
  if type(value) ~= 'table' then
    return
  end
  if value.kind == 'end' then
    M.state.progress = nil
    if notify then
      local failed = M.state.state == 'error'
      vim.notify(
        'wd-lsp: ' .. (value.message or (failed and 'the engine did not start' or 'engine ready')),
        failed and vim.log.levels.WARN or vim.log.levels.INFO
      )
    end
  else
    M.state.progress = value.message or value.title or 'starting'
    if value.kind == 'begin' and notify then
      vim.notify(
        'wd-lsp: starting the engine; the first suggestion comes once the model is loaded',
        vim.log.levels.INFO
      )
    end
  end
  fire()
end

function M.add_log(kind, text, max)
  table.insert(M.log, ('%s [%s] %s'):format(os.date('%H:%M:%S'), kind, text))
  while #M.log > max do
    table.remove(M.log, 1)
  end
end

-- A short string for a statusline: "wd-lsp 42ms", "wd-lsp loading the model (12 s)", ...
function M.statusline()
  local s = M.state
  if s.progress then
    return 'wd-lsp ' .. s.progress
  end
  if s.state == 'ready' and s.lastLatencyMs then
    return ('wd-lsp %dms'):format(math.floor(s.lastLatencyMs + 0.5))
  end
  return 'wd-lsp ' .. s.state
end

local function given(v)
  return v ~= nil and v ~= vim.NIL
end

local function ms(v)
  return ('%d ms'):format(math.floor(v + 0.5))
end

-- The server's wdLsp.status map as a few lines for :WdLsp status.
function M.describe(s)
  local lines = {}
  local engine = ('wd-lsp %s: engine %s'):format(s.version or '?', s.engine or '?')
  if given(s.model) then
    engine = engine .. ' (' .. s.model .. ')'
  end
  if s.enabled == false then
    engine = engine .. ', completions off'
  end
  lines[#lines + 1] = engine
  if given(s.engineError) then
    lines[#lines + 1] = 'engine error: ' .. tostring(s.engineError)
  end
  if given(s.lastLatencyMs) then
    local latency = 'last completion ' .. ms(s.lastLatencyMs)
    if given(s.p50LatencyMs) then
      latency = latency .. ', median ' .. ms(s.p50LatencyMs)
    end
    lines[#lines + 1] = latency
  end
  if type(s.requests) == 'number' then
    lines[#lines + 1] = ('requests %d, answered while typing through %d, empty %d, errors %d')
      :format(s.requests, s.typing_through or 0, s.empty or 0, s.errors or 0)
  end
  local languages = type(s.acceptance) == 'table' and vim.tbl_keys(s.acceptance) or {}
  table.sort(languages)
  for _, language in ipairs(languages) do
    local a = s.acceptance[language]
    lines[#lines + 1] = ('%s: shown %d, accepted %d; in part: %d by word, %d by line'):format(
      language,
      a.shown or 0,
      a.accepted or 0,
      a.partialWord or 0,
      a.partialLine or 0
    )
  end
  return table.concat(lines, '\n')
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
