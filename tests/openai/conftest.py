"""A real `wd-engine serve --http-port` process on a tiny random checkpoint, shared by a module.

Each daemon gets a private runtime dir, an idle timeout as a safety net, and is stopped with
SIGTERM (SIGKILL if it hangs) when the module ends.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from engine.ipc.client import EngineClient

TOKEN = "test-http-token"


@dataclass
class HttpEngine:
    model: str  # the served model id (the checkpoint folder's name)
    base_url: str  # ".../v1"
    token: str
    env: dict
    socket: Path
    process: subprocess.Popen

    async def stats(self) -> dict:
        """The engine's counters, over the msgpack socket of the same daemon."""
        client = EngineClient(socket_path=self.socket)
        try:
            return await client.request("stats")
        finally:
            await client.close()

    async def wait_idle(self, timeout_s: float = 10.0) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            stats = await self.stats()
            if stats["running"] == 0 and stats["waiting"] == 0 or time.monotonic() > deadline:
                return stats
            await asyncio.sleep(0.05)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_engine(model_dir: Path, tmp: Path, *extra: str) -> HttpEngine:
    run = tmp / "run"
    token_file = tmp / "http.token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o600)  # the engine refuses a token file that others may read
    env = dict(
        os.environ,
        WD_ENGINE_DIR=str(run),
        XDG_STATE_HOME=str(tmp / "state"),
        WD_ENGINE_IDLE_TIMEOUT="30",
    )
    env.pop("WD_ENGINE_HTTP_TOKEN", None)
    port = free_port()
    sock = run / "engine.sock"  # WD_ENGINE_DIR puts it there
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "engine.cli",
            "serve",
            "--model",
            str(model_dir),
            "--http-port",
            str(port),
            "--http-token-file",
            str(token_file),
            *extra,
        ],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        if process.poll() is not None:
            raise RuntimeError(
                f"wd-engine serve exited with {process.returncode}: "
                f"{process.stderr.read().decode()}"
            )
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            stop_engine(process)
            raise RuntimeError("wd-engine serve did not start within 120 s")
        time.sleep(0.1)
    return HttpEngine(model_dir.name, f"{base}/v1", TOKEN, env, sock, process)


def stop_engine(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    if process.stderr:
        process.stderr.close()


@pytest.fixture(scope="module")
def http_engine(checkpoint_factory, tmp_path_factory):
    engine = start_engine(checkpoint_factory(), tmp_path_factory.mktemp("http-engine"))
    yield engine
    stop_engine(engine.process)
