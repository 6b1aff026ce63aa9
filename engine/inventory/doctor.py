"""`wd-engine doctor`: what a new user needs to know, on one screen: Python and this package,
torch and CUDA, the GPUs and their free memory, Triton, the Hugging Face hub's settings, the
engine daemon's state and socket, the editor integrations set up, and the models with their fit
verdicts (engine.inventory.report). Every check reports what it found or why it could not tell;
none of them fails the command."""

from __future__ import annotations

import asyncio
import importlib.metadata
import os
import platform
import shutil
import sys
from collections.abc import Callable

from engine.inventory.editors import find_editor_setups
from engine.inventory.report import build_report, gpu_line, host_line, render_text
from engine.models import short_path

DAEMON_TIMEOUT_S = 3.0


def report(gpu_override_gb: float | None = None) -> str:
    """The whole screen."""
    models = build_report(gpu_override_gb)
    memory = host_line(models.host).removeprefix("CPU memory: ")
    lines = [
        ("Python", _python()),
        ("wd-lsp", _package()),
        ("torch", _torch()),
        ("GPU", gpu_line(models.gpus).removeprefix("GPU: ")),
        ("memory", f"{memory}, {os.cpu_count()} CPU threads"),
        ("Triton", _version("triton") or "not installed"),
        ("hub", _hub()),
        ("daemon", _daemon()),
        ("editors", "; ".join(find_editor_setups()) or "none set up (editors/README.md)"),
    ]
    width = max(len(name) for name, _ in lines)
    text = [f"{name.ljust(width)}  {value}" for name, value in lines]
    return "\n".join([*text, "", "models:", render_text(models, header=False)])


def _checked(check: Callable[[], str]) -> str:
    try:
        return check()
    except Exception as exc:  # noqa: BLE001 - a check that fails says so and the rest go on
        return f"cannot tell ({type(exc).__name__}: {exc})"


def _python() -> str:
    return f"{platform.python_version()} ({sys.executable})"


def _package() -> str:
    version = _version("wd-lsp") or "not installed as a package"
    server = shutil.which("wd-lsp")
    where = (
        f"`wd-lsp` on PATH: {short_path(server)}"
        if server
        else "`wd-lsp` is not on PATH: give editors its full path"
    )
    return f"{version}; {where}"


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _torch() -> str:
    def check() -> str:
        import torch

        if torch.version.cuda is None:
            return f"{torch.__version__} (a CPU build: no CUDA)"
        state = "available" if torch.cuda.is_available() else "no device or driver"
        return f"{torch.__version__}, CUDA {torch.version.cuda} ({state})"

    return _checked(check)


def _hub() -> str:
    def check() -> str:
        from huggingface_hub import __version__, constants

        parts = [f"huggingface_hub {__version__}", f"cache {short_path(constants.HF_HUB_CACHE)}"]
        if os.environ.get("HF_ENDPOINT"):
            parts.append(f"endpoint {constants.ENDPOINT} (HF_ENDPOINT)")
        has_token = bool(os.environ.get("HF_TOKEN")) or os.path.isfile(constants.HF_TOKEN_PATH)
        parts.append("token set" if has_token else "no token (gated models need HF_TOKEN)")
        if constants.is_offline_mode():
            parts.append("offline (HF_HUB_OFFLINE)")
        return ", ".join(parts)

    return _checked(check)


def _daemon() -> str:
    def check() -> str:
        from engine.ipc import client, paths

        path = paths.socket_path()
        log = f"log {short_path(paths.log_path())}"
        if not client.check_socket_path(path):
            return (
                f"not running (an editor starts it with its first completion); socket "
                f"{short_path(path)}, {log}"
            )
        try:
            info = asyncio.run(asyncio.wait_for(_ask_daemon(path), DAEMON_TIMEOUT_S))
        except (client.EngineUnavailable, TimeoutError, OSError) as exc:
            return f"not answering on {short_path(path)} ({exc}); {log}"
        model, health = info
        return (
            f"running (pid {health.get('pid')}, up {_duration(health.get('uptime_s', 0))}, "
            f"{health.get('clients', '?')} clients): {model.get('name')} on "
            f"{model.get('device')} ({model.get('dtype')}); socket {short_path(path)}, {log}"
        )

    return _checked(check)


async def _ask_daemon(path) -> tuple[dict, dict]:
    from engine.ipc.client import EngineClient

    engine = EngineClient(socket_path=path, connect_timeout_s=DAEMON_TIMEOUT_S)
    try:
        await engine.connect(attempts=1)
        model = await engine.request("model_info", timeout=DAEMON_TIMEOUT_S, reconnect=False)
        health = await engine.request("health", timeout=DAEMON_TIMEOUT_S, reconnect=False)
        return model, health
    finally:
        await engine.close()


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
