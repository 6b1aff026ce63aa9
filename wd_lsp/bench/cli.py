"""`wd-lsp bench` / `python -m wd_lsp.bench`: compare cache modes, or soak one engine.

wd-lsp bench [compare] --segments 6 --out bench-out      # cache off / on / on + warm
wd-lsp bench --modes cache-warm,cache-warm@expert_centric --engine-arg=--device=cuda ...
wd-lsp bench soak --editors 16 --duration 300 --out soak-out
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
from pathlib import Path

from . import report, sources
from .compare import CompareConfig, run_compare
from .editors import EDITORS
from .engines import MODES, MOE_PATHS, Arm
from .script import Cadence
from .soak import SoakConfig, run_soak


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--source",
        default="all",
        help="files to type: heldout (the default model's held-out files), project, all, "
        "or comma-separated paths (default: all)",
    )
    parser.add_argument(
        "--segments", type=int, default=6, help="segments to type, each from a different file"
    )
    parser.add_argument("--lines", type=int, default=3, help="lines typed per segment")
    parser.add_argument(
        "--min-context",
        type=int,
        default=sources.MIN_BEFORE_CHARS,
        help="chars above the typed lines (default fills the prompt budget)",
    )
    parser.add_argument(
        "--key-ms", type=float, default=Cadence.key_ms, help="mean time between keys"
    )
    parser.add_argument(
        "--jitter", type=float, default=Cadence.jitter, help="relative spread of key gaps"
    )
    parser.add_argument(
        "--line-pause-ms", type=float, default=Cadence.line_pause_ms, help="pause after Enter"
    )
    parser.add_argument(
        "--word-pause-ms", type=float, default=Cadence.word_pause_ms, help="pause after a word"
    )
    parser.add_argument(
        "--server-option",
        action="append",
        default=[],
        metavar="KEY=JSON",
        help="extra initializationOptions for the server, e.g. maxTokens=32 (repeatable)",
    )
    parser.add_argument(
        "--model", help="model folder (default: $WD_LSP_MODEL or the embedded model)"
    )
    parser.add_argument(
        "--engine-arg", action="append", default=[], help="extra `wd-engine serve` argument"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--out", default="latency-out", help="folder for latency.json, latency.md and plots"
    )
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--keep-logs", action="store_true", help="keep the engine and server logs")
    parser.add_argument(
        "--run-dir",
        help="folder for the sockets and logs, kept at the end (default: a new "
        "temporary one, removed unless --keep-logs); keep its path short (AF_UNIX)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="wd-lsp bench", description="Replay real typing through wd-lsp."
    )
    commands = parser.add_subparsers(dest="command")
    compare = commands.add_parser("compare", help="cache modes side by side (the default)")
    _common(compare)
    compare.add_argument(
        "--modes",
        default=",".join(MODES),
        help=f"comma-separated, from {', '.join(MODES)}; MODE@PATH forces the engine's MoE path "
        f"({', '.join(MOE_PATHS)}), e.g. cache-warm@expert_centric",
    )
    compare.add_argument(
        "--editors", default=",".join(EDITORS), help=f"comma-separated, from {', '.join(EDITORS)}"
    )
    compare.add_argument(
        "--daemons-at-once",
        type=int,
        default=0,
        help="engines alive at once (default: all); the modes then run in groups, in order",
    )
    compare.add_argument(
        "--warm-up",
        action="store_true",
        help="run a few unrelated completions on each engine before measuring "
        "(compiles GPU kernels)",
    )
    soak = commands.add_parser("soak", help="many editors against one engine for a set time")
    _common(soak)
    soak.add_argument("--editors", type=int, default=16, help="concurrent editors")
    soak.add_argument("--duration", type=float, default=300.0, help="seconds")
    soak.add_argument("--style", choices=list(EDITORS), default="vscode")
    soak.add_argument("--mode", choices=list(MODES), default="cache-warm")
    return parser


def _server_options(pairs: list[str]) -> dict:
    out = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("compare", "soak", "-h", "--help"):
        argv.insert(0, "compare")
    args = build_parser().parse_args(argv)
    files = sources.load(args.source)
    segments = sources.segments(files, args.segments, args.lines, args.seed, args.min_context)
    if not segments:
        print(
            "wd-lsp bench: no file is long enough to type from (try --min-context 0)",
            file=sys.stderr,
        )
        return 2
    cadence = Cadence(args.key_ms, args.jitter, args.line_pause_ms, args.word_pause_ms)
    if args.command == "compare":
        try:
            for spec in args.modes.split(","):
                Arm.parse(spec)
        except ValueError as exc:
            print(f"wd-lsp bench: {exc}", file=sys.stderr)
            return 2
    keep = args.keep_logs or args.run_dir
    # Private sockets; short enough for AF_UNIX.
    run_dir = Path(args.run_dir) if args.run_dir else Path(tempfile.mkdtemp(prefix="wd-bench-"))
    try:
        if args.command == "soak":
            config = SoakConfig(
                segments,
                args.editors,
                args.duration,
                args.style,
                args.mode,
                cadence,
                _server_options(args.server_option),
                args.model,
                args.engine_arg,
                seed=args.seed,
            )
            result = asyncio.run(run_soak(config, run_dir))
        else:
            config = CompareConfig(
                segments,
                args.modes.split(","),
                args.editors.split(","),
                cadence,
                _server_options(args.server_option),
                args.model,
                args.engine_arg,
                args.seed,
                args.daemons_at_once,
                args.warm_up,
            )
            result = asyncio.run(run_compare(config, run_dir))
    finally:
        if keep:
            print(f"logs: {run_dir}")
        else:
            shutil.rmtree(run_dir, ignore_errors=True)
    written = report.write(result, Path(args.out), plots=not args.no_plots)
    print(written[1].read_text())
    print("wrote " + ", ".join(str(p) for p in written))
    return 0
