"""An engine that cannot start (a model it cannot load, one that does not fit the GPU) says why
in its log as it exits; the editor is told that first line once, in a message box
(`window/showMessage`), and `wdLsp.status` carries it while the engine stays down."""

import asyncio
import json
import os
import sys
import time

import pytest
from lsprotocol import types as T
from pytest_lsp import ClientServerConfig

from engine.ipc.client import EngineExited, SpawnFailed, exit_reason
from wd_lsp import engine_link
from wd_lsp.config import Settings, merge_settings
from wd_lsp.engine_link import EngineLink

REASON = "unsupported architecture 'LlamaForCausalLM'; supported: Qwen3MoeForCausalLM"


def test_the_reason_is_the_engines_own_line_from_this_start(tmp_path):
    log = tmp_path / "engine.log"
    log.write_text("2026 ERROR wd_engine[11]: cannot load model old: an earlier start's error\n")
    start = log.stat().st_size
    with log.open("a") as f:
        f.write(
            "2026 INFO wd_engine[42]: starting\n"
            "2026 ERROR wd_engine[42]: cannot load model big: it needs 61.1 GB of GPU memory\n"
            "wd-engine: cannot load model big: it needs 61.1 GB of GPU memory\n"
        )
    assert exit_reason(log, start, 42) == "cannot load model big: it needs 61.1 GB of GPU memory"
    # Nothing on stderr: the ERROR record of this pid, not another's.
    log.write_text("2026 ERROR wd_engine[7]: other\n2026 ERROR wd_engine[42]: cannot bind\n")
    assert exit_reason(log, 0, 42) == "cannot bind"
    # A crash: the traceback's last line.
    log.write_text('Traceback (most recent call last):\n  File "x"\nRuntimeError: boom\n\n')
    assert exit_reason(log, 0, 42) == "RuntimeError: boom"
    assert exit_reason(log, log.stat().st_size, 42) is None  # nothing new
    assert exit_reason(tmp_path / "missing.log", 0) is None
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert exit_reason(fifo, 0) is None  # never blocks on something that is not a file


async def test_a_failed_start_is_told_once_and_kept_for_the_status(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(engine_link, "_now", lambda: clock[0])
    attempts = []

    class ExitsAtStart:
        connected = False

        async def connect(self):
            attempts.append(1)
            raise EngineExited(f"the engine exited with code 1 while starting: {REASON}", REASON)

        def disconnect(self):
            pass

    told = []
    link = EngineLink(lambda state, message: told.append(state), lambda message: None)
    link.configure(merge_settings(Settings(), {}))
    monkeypatch.setattr(link, "_make_client", ExitsAtStart)

    async def no_background_restart():
        pass

    monkeypatch.setattr(link, "_restart_soon", no_background_restart)
    for _ in range(3):  # each after the backoff: the same failure, said once
        with pytest.raises(SpawnFailed):
            await link.ensure_connected()
        clock[0] += 3600
    assert len(attempts) == 3 and told.count("error") == 1
    assert link.start_error == REASON and link.error == REASON


def _status(client):
    return client.workspace_execute_command_async(T.ExecuteCommandParams(command="wdLsp.status"))


async def test_the_editor_is_shown_why_the_engine_could_not_start(tmp_path):
    model = tmp_path / "not-a-qwen"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    env = dict(
        os.environ,
        WD_ENGINE_DIR=str(run),
        XDG_STATE_HOME=str(tmp_path / "state"),
        WD_LSP_MODEL=str(model),
    )
    client = await ClientServerConfig(
        server_command=[sys.executable, "-m", "wd_lsp"], server_env=env
    ).start()
    try:
        await client.initialize_session(
            T.InitializeParams(
                capabilities=T.ClientCapabilities(),
                initialization_options={"requestTimeoutMs": 1000},
            )
        )  # the server starts the engine at once
        deadline = time.monotonic() + 120  # the engine imports torch before it reads the model
        while not client.messages and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert len(client.messages) == 1, "no message box about the failed start"
        shown = client.messages[0]
        assert shown.type == T.MessageType.Error
        assert (
            shown.message
            == f"wd-lsp: the engine could not start: cannot load model {model.name}: {REASON}"
        )
        status = await _status(client)
        assert status["engine"] == "error"
        assert status["engineError"] == f"cannot load model {model.name}: {REASON}"
        # The server tries again after its backoff; the same failure is not shown again.
        log = tmp_path / "state" / "wd-lsp" / "engine.log"
        while time.monotonic() < deadline and log.read_text().count("wd-engine: cannot") < 2:
            await asyncio.sleep(0.1)
        assert log.read_text().count("wd-engine: cannot") >= 2, "the server did not try again"
        await asyncio.sleep(0.5)
        assert len(client.messages) == 1
        assert (await _status(client))["engineError"].endswith(REASON)
    finally:
        await client.shutdown_session()
