"""Private engine daemons for a benchmark: one per cache mode, each on its own socket, started
here (not by the server) so that flags like `--no-prefix-cache` can be set, and shut down at the
end through the engine's own `shutdown` request."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from engine.ipc.client import EngineClient, EngineError, EngineUnavailable


@dataclass
class Mode:
    """A way of running the engine and server, compared side by side."""

    name: str
    prefix_cache: bool
    warm_on_change: bool


MODES = {
    "cache-off": Mode("cache-off", prefix_cache=False, warm_on_change=False),
    "cache-on": Mode("cache-on", prefix_cache=True, warm_on_change=False),
    "cache-warm": Mode("cache-warm", prefix_cache=True, warm_on_change=True),
}


MOE_PATHS = ("auto", "expert_centric", "output_centric")  # `wd-engine serve --moe-path`


@dataclass(frozen=True)
class Arm:
    """One engine set-up in a comparison: a mode, optionally with a forced MoE path
    (`cache-warm@expert_centric`; without `@`, the engine picks its own path)."""

    name: str
    mode: Mode
    moe_path: str | None = None

    @classmethod
    def parse(cls, spec: str) -> Arm:
        mode, _, path = spec.partition("@")
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; known: {', '.join(MODES)}")
        if path and path not in MOE_PATHS:
            raise ValueError(f"unknown MoE path {path!r}; known: {', '.join(MOE_PATHS)}")
        return cls(spec, MODES[mode], path or None)

    def engine_args(self) -> list[str]:
        return ["--moe-path", self.moe_path] if self.moe_path else []


@dataclass
class Daemon:
    socket: Path
    process: subprocess.Popen
    extra_args: list[str] = field(default_factory=list)
    # Held open for the whole run: a daemon waiting for its mode's turn has no other client, and
    # its idle timeout would otherwise stop it.
    client: EngineClient | None = None

    async def stats(self) -> dict:
        if self.client is None:
            self.client = EngineClient(socket_path=self.socket)
        return await self.client.request("stats")

    async def stop(self, timeout_s: float = 20.0) -> None:
        client = self.client or EngineClient(socket_path=self.socket)
        try:
            await client.request("shutdown")
            await client.close()
        except (EngineUnavailable, EngineError, OSError):
            pass
        deadline = time.monotonic() + timeout_s
        while self.process.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def engine_env(run_dir: Path, idle_timeout_s: int = 30) -> dict:
    """Environment for anything that may reach or spawn an engine: a private runtime dir, and
    an idle timeout so a daemon left behind by a crash goes away on its own."""
    return dict(
        os.environ,
        WD_ENGINE_DIR=str(run_dir),
        XDG_STATE_HOME=str(run_dir / "state"),
        WD_ENGINE_IDLE_TIMEOUT=str(idle_timeout_s),
    )


def start_daemon(
    run_dir: Path,
    name: str,
    prefix_cache: bool,
    model: str | None = None,
    extra_args: list[str] | None = None,
    idle_timeout_s: int = 30,
) -> Daemon:
    """Start `wd-engine serve` on `run_dir/<name>.sock`; returns at once (see `wait_ready`)."""
    run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    name = name.replace("@", "-")
    socket = run_dir / f"{name}.sock"
    command = [
        sys.executable,
        "-m",
        "engine.cli",
        "serve",
        "--socket",
        str(socket),
        "--idle-timeout",
        str(idle_timeout_s),
        "--log-file",
        str(run_dir / f"{name}.log"),
    ]
    if not prefix_cache:
        command.append("--no-prefix-cache")
    if model:
        command += ["--model", model]
    command += extra_args or []
    process = subprocess.Popen(
        command,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=open(run_dir / f"{name}.stderr", "ab"),
        env=engine_env(run_dir, idle_timeout_s),
    )
    return Daemon(socket, process, extra_args or [])


async def wait_ready(daemon: Daemon, timeout_s: float = 300.0) -> dict:
    """Wait until the daemon answers; returns its first stats (the KV baseline)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if daemon.process.poll() is not None:
            raise RuntimeError(
                f"the engine on {daemon.socket} exited with code {daemon.process.returncode}"
            )
        try:
            return await daemon.stats()
        except (EngineUnavailable, OSError) as exc:
            daemon.client = None
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the engine on {daemon.socket} did not start in {timeout_s:.0f} s"
                ) from exc
            await asyncio.sleep(0.2)


# Prompts of a spread of lengths (~10 to ~2,500 tokens): a fresh engine compiles or tunes what it
# needs for each shape it meets (Triton kernels on a GPU) before the measured replays, not in them.
WARM_UP_LINES = (1, 8, 30, 90, 160)


async def warm_up(daemon: Daemon, max_tokens: int = 8) -> float:
    """Run a few plain completions unrelated to any replayed file; returns the seconds taken."""
    t0 = time.monotonic()
    for lines in WARM_UP_LINES:
        text = "".join(f"value_{i} = compute({i}, scale={i % 7}) + offset\n" for i in range(lines))
        stream = await daemon.client.complete({"prompt": text, "max_tokens": max_tokens})
        async for _ in stream:
            pass
    return time.monotonic() - t0
