"""A minimal msgpack-RPC client for an embedded `nvim --embed --headless` (no pynvim needed)."""

from __future__ import annotations

import itertools
import os
import subprocess
import time

import msgpack


class NvimError(RuntimeError):
    pass


class Nvim:
    """One embedded Neovim. Requests are synchronous; notifications from nvim are dropped."""

    def __init__(self, nvim: str, args: list[str], cwd: str, env: dict[str, str]):
        self.proc = subprocess.Popen(
            [nvim, "--embed", "--headless", *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            cwd=cwd,
            env=env,
        )
        self._ids = itertools.count(1)
        self._unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)

    def request(self, method: str, *params):
        msgid = next(self._ids)
        self.proc.stdin.write(msgpack.packb([0, msgid, method, list(params)], use_bin_type=True))
        self.proc.stdin.flush()
        while True:
            for message in self._unpacker:
                if message[0] == 1 and message[1] == msgid:
                    _, _, error, result = message
                    if error is not None:
                        raise NvimError(f"{method}: {error}")
                    return result
                # [2, method, params] notifications, or [0, ...] requests we don't serve: ignore.
            chunk = os.read(self.proc.stdout.fileno(), 65536)
            if not chunk:
                raise NvimError(f"nvim exited (code {self.proc.poll()}) during {method}")
            self._unpacker.feed(chunk)

    def lua(self, code: str, *args):
        return self.request("nvim_exec_lua", code, list(args))

    def command(self, cmd: str):
        return self.request("nvim_command", cmd)

    def input(self, keys: str):
        return self.request("nvim_input", keys)

    def wait_for(self, code: str, timeout: float, what: str, *args, interval: float = 0.05):
        """Polls the Lua expression `code` until it returns a truthy value; returns that value."""
        deadline = time.monotonic() + timeout
        while True:
            value = self.lua(code, *args)
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
            time.sleep(interval)

    def close(self):
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(
                    msgpack.packb([2, "nvim_command", ["qa!"]], use_bin_type=True)
                )
                self.proc.stdin.flush()
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
