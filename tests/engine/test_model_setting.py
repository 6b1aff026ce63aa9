"""The editor's `model` setting as a hub repo id: the language server passes it to the engine it
starts (`wd-engine serve --model ORG/NAME`), which finds the snapshot in the hub cache, offline;
one that is not there gives the editor one message naming the command that fetches it, and
nothing is downloaded behind the user's back."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import pytest
from hub_fake import FakeHub, isolated_env, wd_engine
from lsprotocol import types as T
from pytest_lsp import ClientServerConfig

from engine.ipc.client import EngineClient

REPO = "Org/tiny-moe"
TIMEOUT_S = 120  # the engine imports torch and loads the model


@pytest.fixture(scope="module")
def model_folder(checkpoint_factory):
    return checkpoint_factory(max_shard_size="300KB")


async def start_server(env: dict, model: str):
    client = await ClientServerConfig(
        server_command=[sys.executable, "-m", "wd_lsp"], server_env=env
    ).start()
    await client.initialize_session(
        T.InitializeParams(
            capabilities=T.ClientCapabilities(),
            initialization_options={"model": model, "requestTimeoutMs": 1000},
        )
    )  # the server starts the engine at once
    return client


def status(client):
    return client.workspace_execute_command_async(T.ExecuteCommandParams(command="wdLsp.status"))


async def stop_engine(env: dict) -> None:
    try:
        engine = EngineClient(socket_path=Path(env["WD_ENGINE_DIR"]) / "engine.sock")
        await engine.request("shutdown", timeout=10)
        await engine.close()
    except Exception:  # noqa: BLE001 - already gone
        pass


async def test_a_repo_id_not_downloaded_is_one_message_with_the_pull_command(tmp_path):
    with FakeHub() as hub:  # a hub the engine must not ask
        env = isolated_env(tmp_path, hub.url)
        client = await start_server(env, "Org/not-pulled")
        try:
            deadline = time.monotonic() + TIMEOUT_S
            while not client.messages and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            assert [m.message for m in client.messages] == [
                "wd-lsp: the engine could not start: model Org/not-pulled is not downloaded "
                f"(no folder Org/not-pulled and nothing in the Hugging Face cache "
                f"{tmp_path / 'hf' / 'hub'}): fetch it with `wd-engine pull Org/not-pulled`"
            ]
            assert (await status(client))["engine"] == "error"
        finally:
            await client.shutdown_session()
        assert hub.log == []


async def test_a_pulled_repo_id_is_the_editors_model(tmp_path, model_folder):
    with FakeHub() as hub:
        hub.add_repo(REPO, model_folder)
        env = isolated_env(tmp_path, hub.url)
        assert wd_engine(env, "pull", REPO).returncode == 0
    env.update(HF_HUB_OFFLINE="1", WD_ENGINE_IDLE_TIMEOUT="30")
    client = await start_server(env, REPO)
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while (await status(client))["engine"] != "ready" and time.monotonic() < deadline:
            assert not client.messages, client.messages
            await asyncio.sleep(0.2)
        assert (await status(client))["engine"] == "ready"
        # `doctor` sees the daemon the editor started, serving the pulled model.
        doctor = wd_engine(env, "doctor").stdout
        daemon = next(line for line in doctor.splitlines() if line.startswith("daemon"))
        assert "running (pid " in daemon and " on cpu (float32)" in daemon, daemon
    finally:
        await client.shutdown_session()
        await stop_engine(env)
