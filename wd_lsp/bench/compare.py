"""Cache modes (and MoE paths) side by side: one private daemon per arm, the same segments typed
in each, the arms interleaved segment by segment so that a noisy neighbour on the machine hits all
of them alike. Each segment comes from a different file, so within an arm no replay warms the
next."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from .editors import EDITORS
from .engines import MODES, Arm, Daemon, engine_env, start_daemon, wait_ready, warm_up
from .metrics import engine_delta, summarize
from .replay import replay_one
from .script import Cadence, Segment

log = logging.getLogger(__name__)


@dataclass
class CompareConfig:
    segments: list[Segment]  # typed once per editor style; split between the styles
    # Arms: a mode, or mode@moe_path (e.g. cache-warm@expert_centric) to force a MoE path.
    modes: list[str] = field(default_factory=lambda: list(MODES))
    editors: list[str] = field(default_factory=lambda: list(EDITORS))
    cadence: Cadence = Cadence()
    server_options: dict = field(default_factory=dict)  # extra initializationOptions
    model: str | None = None
    engine_args: list[str] = field(default_factory=list)
    seed: int = 0
    # Daemons alive at once (0: all). A large model fits the GPU only a few times over: the arms
    # then run in groups, in the order given, each group's daemons stopped before the next starts.
    daemons_at_once: int = 0
    warm_up: bool = False  # a few unrelated completions per daemon before measuring


def init_options(daemon: Daemon, warm: bool, extra: dict) -> dict:
    return dict(extra, warmOnChange=warm, engine={"socket": str(daemon.socket), "autoStart": False})


async def run_compare(config: CompareConfig, run_dir: Path, progress=print) -> dict:
    """{"modes": {arm: {editor: summary}}, "records": [...], "engines": {arm: {...}},
    "config": {...}}."""
    arms = [Arm.parse(spec) for spec in config.modes]
    size = config.daemons_at_once or len(arms)
    records: list[dict] = []
    statuses: dict[tuple[str, str], list[dict]] = {}
    engine: dict[tuple[str, str], dict] = {}
    engines: dict[str, dict] = {}
    # Editor styles take turns over the segments: every segment is typed once per arm.
    plan = [(config.editors[i % len(config.editors)], seg) for i, seg in enumerate(config.segments)]
    for first in range(0, len(arms), size):
        group = arms[first : first + size]
        daemons: dict[str, Daemon] = {}
        try:
            t0 = time.monotonic()
            for arm in group:
                daemons[arm.name] = start_daemon(
                    run_dir,
                    arm.name,
                    arm.mode.prefix_cache,
                    config.model,
                    config.engine_args + arm.engine_args(),
                )
            for arm in group:
                await wait_ready(daemons[arm.name])
                info = await daemons[arm.name].client.request("model_info")
                engines[arm.name] = dict(
                    info, ready_s=time.monotonic() - t0, moe_path=arm.moe_path or "auto"
                )
                if config.warm_up:
                    engines[arm.name]["warm_up_s"] = await warm_up(daemons[arm.name])
                progress(
                    f"engine {arm.name}: ready after {engines[arm.name]['ready_s']:.1f} s"
                    + (
                        f", warm-up {engines[arm.name]['warm_up_s']:.1f} s"
                        if config.warm_up
                        else ""
                    )
                )
            for n, (editor, segment) in enumerate(plan):
                for arm in group:
                    daemon = daemons[arm.name]
                    before = await daemon.stats()
                    rows, status = await replay_one(
                        segment,
                        EDITORS[editor],
                        config.cadence,
                        init_options(daemon, arm.mode.warm_on_change, config.server_options),
                        engine_env(run_dir),
                        seed=config.seed + n,
                        stderr_path=str(run_dir / f"server-{arm.name.replace('@', '-')}.log"),
                    )
                    after = await daemon.stats()
                    delta = engine_delta(before, after)
                    acc = engine.setdefault((arm.name, editor), {k: 0 for k in delta})
                    for k, v in delta.items():
                        acc[k] += v
                    statuses.setdefault((arm.name, editor), []).append(status)
                    records += [dict(r.as_dict(), mode=arm.name) for r in rows]
                    shown = sum(r.outcome == "shown" for r in rows)
                    progress(
                        f"[{n + 1}/{len(plan)}] {arm.name:10s} {editor:6s} {segment.name}: "
                        f"{len(rows)} requests, {shown} shown"
                    )
        finally:
            await asyncio.gather(*(d.stop() for d in daemons.values()))
    modes = {}
    for arm in arms:
        name = arm.name
        modes[name] = {}
        for editor in config.editors:
            rows = [r for r in records if r["mode"] == name and r["editor"] == editor]
            if rows or (name, editor) in statuses:
                modes[name][editor] = summarize(
                    rows, statuses.get((name, editor), []), engine.get((name, editor))
                )
        modes[name]["all"] = summarize(
            [r for r in records if r["mode"] == name],
            [s for (m, _), v in statuses.items() if m == name for s in v],
            _sum_dicts([v for (m, _), v in engine.items() if m == name]),
        )
    return dict(
        kind="compare",
        modes=modes,
        ratios=ratios(modes),
        records=records,
        engines=engines,
        config=dict(
            modes=config.modes,
            editors=config.editors,
            segments=[s.name for s in config.segments],
            cadence=vars(config.cadence),
            server_options=config.server_options,
            engine_args=config.engine_args,
            model=config.model or "default",
            daemons_at_once=config.daemons_at_once,
            warm_up=config.warm_up,
        ),
    )


FIRST_TOKEN_METRICS = (
    "keystroke_to_first_token_ms",
    "request_to_first_token_ms",
    "keystroke_to_ghost_ms",
)


def ratios(modes: dict) -> dict:
    """Below 1 is faster. Cached modes over the cache off (same MoE path), p50 of all editors
    together; and each forced MoE path over the first arm of the same mode, p50 engine first token
    and decode speed (above 1 is faster there)."""
    arms = [Arm.parse(name) for name in modes]
    out = {}
    for arm in arms:
        if arm.mode.name == "cache-off":
            continue
        off = next(
            (a for a in arms if a.mode.name == "cache-off" and a.moe_path == arm.moe_path), None
        )
        if off is None:
            continue
        summary, base = modes[arm.name]["all"], modes[off.name]["all"]
        for metric in FIRST_TOKEN_METRICS:
            a, b = summary[metric]["p50"], base[metric]["p50"]
            out[f"{arm.name} / {off.name} p50 {metric.removesuffix('_ms')}"] = (
                a / b if a and b else None
            )
    for arm in arms:
        ref = next(a for a in arms if a.mode == arm.mode)
        if ref is arm:
            continue
        summary, base = modes[arm.name]["all"], modes[ref.name]["all"]
        for metric in ("engine_first_token_ms", "keystroke_to_first_token_ms"):
            a, b = summary[metric]["p50"], base[metric]["p50"]
            out[f"{arm.name} / {ref.name} p50 {metric.removesuffix('_ms')}"] = (
                a / b if a and b else None
            )
        a, b = summary["decode_tokens_per_s"], base["decode_tokens_per_s"]
        out[f"{arm.name} / {ref.name} decode tok/s"] = a / b if a and b else None
    return out


def _sum_dicts(rows: list[dict]) -> dict | None:
    if not rows:
        return None
    return {k: sum(r.get(k, 0) for r in rows) for k in rows[0]}
