"""Language-server costs that are not the model's: start-up and per-request overhead.

    python tests/lsp_server/bench_server.py [--requests 40]

Start-up: process spawn to the `initialize` result (the server never imports torch). Overhead:
each completion's time in the server minus its time waiting for the engine and the debounce,
as the server itself measures it (`wdLsp.status` → p50OverheadMs), over requests at alternating
positions of a real file (so none is answered by typing-through).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from lsprotocol import types as T
from pytest_lsp import ClientServerConfig

sys.path.insert(0, str(Path(__file__).parent))
from test_server_e2e import CAPS, _stop_engine  # noqa: E402

from engine.models import default_model_dir  # noqa: E402


async def main(requests: int, starts: int) -> None:
    tmp = tempfile.mkdtemp()
    env = dict(
        os.environ,
        WD_ENGINE_DIR=f"{tmp}/run",
        XDG_STATE_HOME=f"{tmp}/state",
        WD_LSP_MODEL=str(default_model_dir()),
        WD_ENGINE_IDLE_TIMEOUT="30",
    )
    init_times = []
    for _ in range(starts):
        t0 = time.perf_counter()
        client = await ClientServerConfig(
            server_command=[sys.executable, "-m", "wd_lsp"], server_env=env
        ).start()
        await client.initialize_session(
            T.InitializeParams(
                capabilities=CAPS,
                initialization_options={"debounceMs": 0, "engine": {"autoStart": False}},
            )
        )
        init_times.append(1000 * (time.perf_counter() - t0))
        await client.shutdown_session()
    print(
        f"start to initialize result: p50 {statistics.median(init_times):.0f} ms "
        f"(min {min(init_times):.0f}, max {max(init_times):.0f}, {starts} starts)"
    )

    client = await ClientServerConfig(
        server_command=[sys.executable, "-m", "wd_lsp"], server_env=env
    ).start()
    await client.initialize_session(
        T.InitializeParams(capabilities=CAPS, initialization_options={"debounceMs": 0})
    )
    text = (Path(__file__).resolve().parents[2] / "engine" / "core" / "scheduler.py").read_text()
    uri = "file:///bench/scheduler.py"
    client.text_document_did_open(
        T.DidOpenTextDocumentParams(
            text_document=T.TextDocumentItem(uri=uri, language_id="python", version=1, text=text)
        )
    )
    lines = text.split("\n")
    spots = [i for i, line in enumerate(lines) if line.strip()][10 : 10 + requests]
    for line in spots:
        await client.text_document_inline_completion_async(
            T.InlineCompletionParams(
                text_document=T.TextDocumentIdentifier(uri=uri),
                position=T.Position(line=line, character=len(lines[line])),
                context=T.InlineCompletionContext(
                    trigger_kind=T.InlineCompletionTriggerKind.Automatic
                ),
            )
        )
    status = await client.workspace_execute_command_async(
        T.ExecuteCommandParams(command="wdLsp.status")
    )
    print(
        f"LSP overhead per request (excluding engine time): p50 {status['p50OverheadMs']:.2f} ms "
        f"over {status['engine_calls']} requests on a {len(lines)}-line file; "
        f"request p50 {status['p50LatencyMs']:.0f} ms including the engine"
    )
    await client.shutdown_session()
    await _stop_engine(env)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--starts", type=int, default=5)
    a = ap.parse_args()
    asyncio.run(main(a.requests, a.starts))
