"""A minimal LSP client over a child process's stdio (JSON-RPC with Content-Length frames).

Hand-rolled rather than a library client so that every send and receive is timestamped with
`time.monotonic()` (the same system-wide clock the probed server uses) and nothing is queued
or batched behind the benchmark's back.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Callable


class LspError(RuntimeError):
    def __init__(self, error: dict):
        super().__init__(f"{error.get('code')}: {error.get('message')}")
        self.code = error.get("code")


class LspClient:
    def __init__(self, process: asyncio.subprocess.Process):
        self.process = process
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self.on_notification: Callable[[str, dict, float], None] = lambda method, params, at: None
        self._reader = asyncio.ensure_future(self._read_loop())

    @classmethod
    async def start(
        cls, command: list[str], env: dict, stderr_path: str | None = None
    ) -> LspClient:
        stderr = open(stderr_path, "ab") if stderr_path else asyncio.subprocess.DEVNULL
        process = await asyncio.create_subprocess_exec(
            *command,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=stderr,
            env=env,
            limit=16 << 20,
        )
        if stderr_path:
            stderr.close()
        return cls(process)

    # -- sending --------------------------------------------------------------------------------
    def _write(self, message: dict) -> float:
        body = json.dumps(message).encode()
        self.process.stdin.write(b"Content-Length: %d\r\n\r\n" % len(body) + body)
        return time.monotonic()

    def notify(self, method: str, params: dict) -> float:
        return self._write({"jsonrpc": "2.0", "method": method, "params": params})

    def send_request(self, method: str, params: dict) -> tuple[int, asyncio.Future]:
        """Send now; the future resolves to (result, monotonic arrival) or raises LspError."""
        msg_id = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._pending[msg_id] = future
        self._write({"jsonrpc": "2.0", "id": msg_id, "method": method, "params": params})
        return msg_id, future

    def cancel(self, msg_id: int) -> None:
        self.notify("$/cancelRequest", {"id": msg_id})

    async def request(self, method: str, params: dict, timeout: float = 120.0):
        _, future = self.send_request(method, params)
        result, _ = await asyncio.wait_for(future, timeout)
        return result

    # -- receiving ------------------------------------------------------------------------------
    async def _read_loop(self) -> None:
        reader = self.process.stdout
        try:
            while True:
                length = None
                while True:
                    line = await reader.readline()
                    if not line:
                        return
                    line = line.strip()
                    if not line:
                        break
                    name, _, value = line.partition(b":")
                    if name.lower() == b"content-length":
                        length = int(value)
                message = json.loads(await reader.readexactly(length))
                at = time.monotonic()
                self._dispatch(message, at)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            for future in self._pending.values():
                if not future.done():
                    future.set_exception(ConnectionError("the language server exited"))
            self._pending.clear()

    def _dispatch(self, message: dict, at: float) -> None:
        if "method" in message:
            if "id" in message:  # a server -> client request (progress, ...): accept it
                self._write({"jsonrpc": "2.0", "id": message["id"], "result": None})
            else:
                self.on_notification(message["method"], message.get("params") or {}, at)
            return
        future = self._pending.pop(message.get("id"), None)
        if future is None or future.done():
            return
        if "error" in message:
            future.set_exception(LspError(message["error"]))
        else:
            future.set_result((message.get("result"), at))

    # -- lifecycle ------------------------------------------------------------------------------
    async def initialize(self, initialization_options: dict, root_uri: str) -> dict:
        capabilities = {
            "textDocument": {"inlineCompletion": {}, "completion": {}, "synchronization": {}},
            "window": {"workDoneProgress": True},
        }
        result = await self.request(
            "initialize",
            {
                "processId": None,
                "rootUri": root_uri,
                "capabilities": capabilities,
                "initializationOptions": initialization_options,
            },
        )
        self.notify("initialized", {})
        return result

    async def close(self) -> None:
        try:
            await self.request("shutdown", {}, timeout=10)
            self.notify("exit", {})
            await asyncio.wait_for(self.process.wait(), 10)
        except (TimeoutError, ConnectionError, LspError):
            pass
        if self.process.returncode is None:
            self.process.kill()
            await self.process.wait()
        self._reader.cancel()
