"""Soak: many editors at once against one engine for a set time.

Each editor is its own language server (as with real editor windows) typing segments one after
another until the time is up. Reported: failed requests, latency per time window (drift), and
the engine's KV blocks in use before and after — once every editor has closed, every block must
be free or merely cached (evictable) again.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path

from .compare import init_options
from .editors import EDITORS
from .engines import MODES, engine_env, start_daemon, wait_ready
from .metrics import engine_delta, percentile, summarize
from .replay import Editor
from .script import Cadence, Segment


@dataclass
class SoakConfig:
    segments: list[Segment]
    editors: int = 16
    duration_s: float = 300.0
    editor_style: str = "vscode"
    mode: str = "cache-warm"
    cadence: Cadence = Cadence()
    server_options: dict = field(default_factory=dict)
    model: str | None = None
    engine_args: list[str] = field(default_factory=list)
    windows: int = 10
    seed: int = 0


async def _one_editor(
    n: int,
    config: SoakConfig,
    options: dict,
    env: dict,
    run_dir: Path,
    until: float,
    rows: list,
    statuses: list,
    failures: list,
) -> int:
    editor = Editor(
        EDITORS[config.editor_style],
        config.cadence,
        options,
        env,
        seed=config.seed + n,
        stderr_path=str(run_dir / f"soak-server-{n}.log"),
    )
    typed = 0
    try:
        await editor.start()
        # Each editor starts at a different segment, so they don't all type the same file.
        while time.monotonic() < until:
            segment = config.segments[(n + typed) % len(config.segments)]
            rows += [dict(r.as_dict(), editor_n=n) for r in await editor.type_segment(segment)]
            typed += 1
        statuses.append(await editor.status())
    except Exception as exc:  # noqa: BLE001 - a failed editor is a finding, not a crash of the soak
        failures.append(f"editor {n}: {exc!r}")
    finally:
        await editor.close()
    return typed


async def run_soak(config: SoakConfig, run_dir: Path, progress=print) -> dict:
    mode = MODES[config.mode]
    daemon = start_daemon(
        run_dir, f"soak-{config.mode}", mode.prefix_cache, config.model, config.engine_args
    )
    try:
        kv_start = await wait_ready(daemon)
        options = init_options(daemon, mode.warm_on_change, config.server_options)
        env = engine_env(run_dir)
        rows: list[dict] = []
        statuses: list[dict] = []
        failures: list[str] = []
        started = time.monotonic()
        until = started + config.duration_s
        progress(f"soak: {config.editors} editors for {config.duration_s:.0f} s")
        reporter = asyncio.ensure_future(_report_progress(rows, started, progress))
        typed = await asyncio.gather(
            *(
                _one_editor(n, config, options, env, run_dir, until, rows, statuses, failures)
                for n in range(config.editors)
            )
        )
        reporter.cancel()
        elapsed = time.monotonic() - started
        kv_end = await _settled_stats(daemon)
        summary = summarize(rows, statuses, engine_delta(kv_start, kv_end))
        windows = _windows(rows, started, elapsed, config.windows)
        first, last = windows[0]["first_token_p50"], windows[-1]["first_token_p50"]
        return dict(
            kind="soak",
            started_at=started,
            elapsed_s=elapsed,
            sessions=sum(typed),
            failures=failures,
            summary=summary,
            windows=windows,
            drift=(last / first) if first and last else None,
            kv=dict(
                start=kv_start,
                end=kv_end,
                returned=kv_end["blocks_used"] == kv_start["blocks_used"],
            ),
            records=rows,
            config=dict(
                editors=config.editors,
                duration_s=config.duration_s,
                editor_style=config.editor_style,
                mode=config.mode,
                cadence=vars(config.cadence),
                segments=[s.name for s in config.segments],
                model=config.model or "default",
                engine_args=config.engine_args,
            ),
        )
    finally:
        await daemon.stop()


async def _settled_stats(daemon, timeout_s: float = 30.0) -> dict:
    """The daemon's stats once nothing runs or waits any more (disconnects cancel in-flight
    work)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = await daemon.stats()
        if (
            stats.get("running", 0) == 0 and stats.get("waiting", 0) == 0
        ) or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.2)


async def _report_progress(rows: list, started: float, progress, every_s: float = 30.0) -> None:
    while True:
        await asyncio.sleep(every_s)
        recent = [
            r["first_token_ms"]
            for r in rows
            if r["key_at"] > time.monotonic() - every_s
            and r["first_token_ms"] is not None
            and r["outcome"] != "cancelled"
        ]
        errors = sum(r["outcome"] == "error" for r in rows)
        progress(
            f"  {time.monotonic() - started:5.0f} s: {len(rows)} requests, {errors} errors, "
            f"key→first token p50 (last {every_s:.0f} s) {percentile(recent, 50) or 0:.0f} ms"
        )


def _windows(rows: list[dict], started: float, elapsed: float, count: int) -> list[dict]:
    width = elapsed / count
    out = []
    for i in range(count):
        lo, hi = started + i * width, started + (i + 1) * width
        inside = [r for r in rows if lo <= r["key_at"] < hi]
        first = [
            r["first_token_ms"]
            for r in inside
            if r["first_token_ms"] is not None and r["outcome"] != "cancelled"
        ]
        ghost = [r["ghost_ms"] for r in inside if r["outcome"] == "shown"]
        out.append(
            dict(
                start_s=i * width,
                end_s=(i + 1) * width,
                requests=len(inside),
                shown=len(ghost),
                errors=sum(r["outcome"] == "error" for r in inside),
                first_token_p50=percentile(first, 50),
                ghost_p50=percentile(ghost, 50),
            )
        )
    return out
