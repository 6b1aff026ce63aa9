"""Cache modes side by side: one private daemon per mode, the same segments typed in each, the
modes interleaved segment by segment so that a noisy neighbour on the machine hits all of them
alike. Each segment comes from a different file, so within a mode no replay warms the next."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from pathlib import Path

from .editors import EDITORS
from .engines import MODES, Daemon, engine_env, start_daemon, wait_ready
from .metrics import engine_delta, summarize
from .replay import replay_one
from .script import Cadence, Segment

log = logging.getLogger(__name__)


@dataclass
class CompareConfig:
    segments: list[Segment]  # typed once per editor style; split between the styles
    modes: list[str] = field(default_factory=lambda: list(MODES))
    editors: list[str] = field(default_factory=lambda: list(EDITORS))
    cadence: Cadence = Cadence()
    server_options: dict = field(default_factory=dict)  # extra initializationOptions
    model: str | None = None
    engine_args: list[str] = field(default_factory=list)
    seed: int = 0


def init_options(daemon: Daemon, warm: bool, extra: dict) -> dict:
    return dict(extra, warmOnChange=warm, engine={"socket": str(daemon.socket), "autoStart": False})


async def run_compare(config: CompareConfig, run_dir: Path, progress=print) -> dict:
    """{"modes": {mode: {editor: summary}}, "records": [...], "config": {...}}."""
    daemons: dict[str, Daemon] = {}
    try:
        for name in config.modes:
            mode = MODES[name]
            daemons[name] = start_daemon(run_dir, name, mode.prefix_cache, config.model, config.engine_args)
        for name, daemon in daemons.items():
            await wait_ready(daemon)
        records: list[dict] = []
        statuses: dict[tuple[str, str], list[dict]] = {}
        engine: dict[tuple[str, str], dict] = {}
        # Editor styles take turns over the segments: every segment is typed once per mode.
        plan = [(config.editors[i % len(config.editors)], seg) for i, seg in enumerate(config.segments)]
        for n, (editor, segment) in enumerate(plan):
            for name in config.modes:
                daemon, mode = daemons[name], MODES[name]
                before = await daemon.stats()
                rows, status = await replay_one(
                    segment, EDITORS[editor], config.cadence,
                    init_options(daemon, mode.warm_on_change, config.server_options),
                    engine_env(run_dir), seed=config.seed + n, stderr_path=str(run_dir / f"server-{name}.log"))
                after = await daemon.stats()
                delta = engine_delta(before, after)
                acc = engine.setdefault((name, editor), {k: 0 for k in delta})
                for k, v in delta.items():
                    acc[k] += v
                statuses.setdefault((name, editor), []).append(status)
                records += [dict(r.as_dict(), mode=name) for r in rows]
                shown = sum(r.outcome == "shown" for r in rows)
                progress(f"[{n + 1}/{len(plan)}] {name:10s} {editor:6s} {segment.name}: "
                         f"{len(rows)} requests, {shown} shown")
        modes = {}
        for name in config.modes:
            modes[name] = {}
            for editor in config.editors:
                rows = [r for r in records if r["mode"] == name and r["editor"] == editor]
                if rows or (name, editor) in statuses:
                    modes[name][editor] = summarize(rows, statuses.get((name, editor), []), engine.get((name, editor)))
            modes[name]["all"] = summarize([r for r in records if r["mode"] == name],
                                           [s for (m, _), v in statuses.items() if m == name for s in v],
                                           _sum_dicts([v for (m, _), v in engine.items() if m == name]))
        return dict(kind="compare", modes=modes, ratios=ratios(modes), records=records, config=dict(
            modes=config.modes, editors=config.editors, segments=[s.name for s in config.segments],
            cadence=vars(config.cadence), server_options=config.server_options,
            engine_args=config.engine_args, model=config.model or "default"))
    finally:
        await asyncio.gather(*(d.stop() for d in daemons.values()))


def ratios(modes: dict) -> dict:
    """p50 of each cached mode over p50 with the cache off (all editors together): below 1 is faster."""
    out = {}
    off = modes.get("cache-off", {}).get("all")
    for name in ("cache-on", "cache-warm"):
        summary = modes.get(name, {}).get("all")
        if off is None or summary is None:
            continue
        for metric in ("keystroke_to_first_token_ms", "request_to_first_token_ms", "keystroke_to_ghost_ms"):
            a, b = summary[metric]["p50"], off[metric]["p50"]
            out[f"{name} / cache-off p50 {metric.removesuffix('_ms')}"] = a / b if a and b else None
    return out


def _sum_dicts(rows: list[dict]) -> dict | None:
    if not rows:
        return None
    return {k: sum(r.get(k, 0) for r in rows) for k in rows[0]}
