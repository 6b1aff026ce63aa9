-- Small shims over API differences between Neovim 0.10, 0.11 and 0.12.
local M = {}

local has_011 = vim.fn.has('nvim-0.11') == 1

-- 0.11 made client methods colon-called; 0.10 has dot-called functions.
function M.request(client, method, params, handler, bufnr)
  if has_011 then
    return client:request(method, params, handler, bufnr)
  end
  return client.request(method, params, handler, bufnr)
end

function M.notify(client, method, params)
  if has_011 then
    return client:notify(method, params)
  end
  return client.notify(method, params)
end

function M.cancel_request(client, id)
  if has_011 then
    return client:cancel_request(id)
  end
  return client.cancel_request(id)
end

-- LSP position (in the client's offset encoding) -> 0-based byte column on that line.
function M.byte_col(bufnr, position, encoding)
  return vim.lsp.util._get_line_byte_from_position(bufnr, position, encoding)
end

function M.native_inline_completion()
  local ok, mod = pcall(require, 'vim.lsp.inline_completion')
  return ok and mod or nil
end

return M
