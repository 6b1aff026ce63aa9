"""`wd-lsp`: the language server over stdio (or TCP, for debugging)."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # the latency suite: replays typing through the real server
        from wd_lsp.bench.cli import main as bench_main

        return bench_main(argv[1:])
    parser = argparse.ArgumentParser(
        prog="wd-lsp", description="wd-lsp code-completion language server"
    )
    parser.add_argument("--stdio", action="store_true", help="serve over stdio (the default)")
    parser.add_argument("--tcp", metavar="HOST:PORT", help="serve over TCP instead, for debugging")
    parser.add_argument("--log-file", help="also write the server's log here")
    parser.add_argument("--version", action="store_true")
    args = parser.parse_args(argv)
    from wd_lsp import __version__

    if args.version:
        print(f"wd-lsp {__version__}")
        return 0
    handler, refused = _log_handler(args.log_file)
    logging.basicConfig(
        level=logging.INFO,
        handlers=[handler],
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if refused:
        logging.getLogger("wd_lsp").error("%s; logging to stderr instead", refused)
    logging.getLogger("pygls").setLevel(logging.WARNING)  # it logs every message at INFO
    from wd_lsp.server import server  # after logging is set up
    from wd_lsp.transport import serve_stdio, serve_tcp

    try:
        if args.tcp:
            host, _, port = args.tcp.rpartition(":")
            if not port.isdigit():
                parser.error("--tcp takes HOST:PORT (port 0: any free one, logged)")
            return serve_tcp(server, host or "127.0.0.1", int(port))
        # The exit code is the protocol's: 0 after `shutdown` + `exit`, 1 when `exit` came alone.
        return serve_stdio(server)
    except KeyboardInterrupt:
        return 130


def _log_handler(log_file: str | None) -> tuple[logging.Handler, str | None]:
    """A handler for the server's log, and why the file asked for was refused (if it was). The log
    may hold document text (with requests' params): the file is created 0600 and never written
    through a symbolic link."""
    if not log_file:
        return logging.StreamHandler(sys.stderr), None
    from engine.ipc.paths import UnsafeLogFile, open_private_log  # imports no torch

    try:
        return logging.StreamHandler(open_private_log(Path(log_file), "a")), None
    except UnsafeLogFile as exc:
        return logging.StreamHandler(sys.stderr), str(exc)


if __name__ == "__main__":
    sys.exit(main())
