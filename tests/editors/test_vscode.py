"""The VS Code extension: type-checks, its unit tests pass, it bundles and packages as a .vsix.

The end-to-end run in a real VS Code (code-server + headless Chromium) is heavier and opt-in:
editors/vscode/e2e/run.sh (see editors/README.md).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

EXT = Path(__file__).resolve().parents[2] / "editors" / "vscode"


def _run(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    result = subprocess.run(args, cwd=EXT, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, (
        f"{' '.join(args)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    )
    return result


@pytest.fixture(scope="module")
def node_modules() -> Path:
    npm = shutil.which("npm")
    if not npm or not shutil.which("node"):
        pytest.skip("Node.js/npm is not installed")
    lock = EXT / "package-lock.json"
    stamp = EXT / "node_modules" / ".package-lock.json"
    # npm ci when node_modules is missing or older than the lock file (editors/install-test-deps.sh
    # normally did it already).
    if not stamp.exists() or stamp.stat().st_mtime < lock.stat().st_mtime:
        _run([npm, "ci", "--no-audit", "--no-fund"], timeout=600)
    return EXT / "node_modules"


def test_typecheck(node_modules):
    _run([str(node_modules / ".bin" / "tsc"), "--noEmit", "-p", "."])


def test_unit_tests(node_modules):
    result = _run(["npm", "test"])
    assert "# fail 0" in result.stdout


def test_packages_as_vsix(node_modules, tmp_path):
    vsix = tmp_path / "wd-lsp.vsix"
    _run(
        [
            str(node_modules / ".bin" / "vsce"),
            "package",
            "--no-dependencies",
            "--skip-license",
            "--allow-missing-repository",
            "--out",
            str(vsix),
        ]
    )
    with zipfile.ZipFile(vsix) as z:
        names = set(z.namelist())
        manifest = json.loads(z.read("extension/package.json"))
        bundle = z.read("extension/dist/extension.js").decode()
    assert "extension/dist/extension.js" in names
    assert not any(
        n.startswith("extension/node_modules/") or n.startswith("extension/src/") for n in names
    )
    # The bundle carries the language client and starts the server over stdio.
    assert "textDocument/inlineCompletion" in bundle
    assert manifest["main"] == "./dist/extension.js"
    settings = manifest["contributes"]["configuration"]["properties"]
    for key in (
        "enabled",
        "model",
        "engine.socket",
        "engine.tcp",
        "engine.token",
        "debounceMs",
        "maxTokens",
        "multiline",
        "enabledLanguages",
        "temperature",
        "server.path",
    ):
        assert f"wdLsp.{key}" in settings
    commands = {c["command"] for c in manifest["contributes"]["commands"]}
    assert {"wd-lsp.toggle", "wd-lsp.restartEngine", "wd-lsp.showLog"} <= commands
