"""Fixtures for the editor end-to-end tests: the real `wd-lsp` server with its own engine daemon.

The engine runs from a private runtime folder (WD_ENGINE_DIR) shared by all editor tests of the
session, so the model loads once; it is shut down at the end.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import pytest


def _server_command() -> list[str]:
    # WD_LSP_TEST_SERVER: another server command, e.g. a development build ("python -m wd_lsp").
    override = os.environ.get("WD_LSP_TEST_SERVER")
    if override:
        return shlex.split(override)
    beside_python = Path(sys.executable).with_name("wd-lsp")
    if beside_python.exists():
        return [str(beside_python)]
    found = shutil.which("wd-lsp")
    if found:
        return [found]
    pytest.fail("the wd-lsp command is not installed (pip install -e .)")


@pytest.fixture(scope="session")
def server_cmd() -> list[str]:
    return _server_command()


async def _engine_pid_and_shutdown(sock: Path) -> int | None:
    from engine.ipc.client import EngineClient

    client = EngineClient(socket_path=sock)
    try:
        info = await asyncio.wait_for(client.connect(), 10)
        await asyncio.wait_for(client.request("shutdown"), 10)
        return (info or {}).get("pid")
    finally:
        await client.close()


def _stop_engine(sock: Path) -> None:
    if not sock.exists():
        return
    try:
        pid = asyncio.run(_engine_pid_and_shutdown(sock))
    except Exception:  # already gone, or never finished starting
        return
    deadline = time.monotonic() + 30
    while pid and time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    if pid:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture(scope="session")
def editor_env():
    """Environment for editors and the server they start: a private engine and log folder."""
    # A short path: Unix socket paths are limited to ~100 bytes.
    root = Path(tempfile.mkdtemp(prefix="wdlsp-ed-"))
    engine_dir = root / "engine"
    engine_dir.mkdir(mode=0o700)
    env = dict(os.environ)
    env.update(
        WD_ENGINE_DIR=str(engine_dir),
        XDG_STATE_HOME=str(root / "state"),
        XDG_CONFIG_HOME=str(root / "config"),
        XDG_DATA_HOME=str(root / "data"),
        XDG_CACHE_HOME=str(root / "cache"),
    )
    env.pop("NVIM", None)  # not a child of another nvim
    env.pop("TRITON_INTERPRET", None)  # the CPU engine doesn't need the interpreter
    yield env
    _stop_engine(engine_dir / "engine.sock")
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def own_engine_env(editor_env):
    """`editor_env` with an engine folder of its own: the server starts a new engine, as on a
    user's first completion; it is shut down at the end."""
    root = Path(tempfile.mkdtemp(prefix="wdlsp-oe-"))  # short, as above
    engine_dir = root / "engine"
    engine_dir.mkdir(mode=0o700)
    yield dict(editor_env, WD_ENGINE_DIR=str(engine_dir))
    _stop_engine(engine_dir / "engine.sock")
    shutil.rmtree(root, ignore_errors=True)
