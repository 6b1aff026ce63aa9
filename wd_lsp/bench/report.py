"""Write a benchmark's results: the full JSON, a markdown summary and PNG plots."""

from __future__ import annotations

import json
from pathlib import Path


def _ms(value) -> str:
    return "–" if value is None else f"{value:.0f}"


def _pct(value) -> str:
    return "–" if value is None else f"{100 * value:.0f}%"


def _row(name: str, editor: str, s: dict) -> str:
    g, f, e = (
        s["keystroke_to_ghost_ms"],
        s["keystroke_to_first_token_ms"],
        s["engine_first_token_ms"],
    )
    tps = s["decode_tokens_per_s"]
    hit = (s.get("engine") or {}).get("cache_hit_ratio_all")
    return (
        f"| {name} | {editor} | {s['requests']} | {s['shown']} "
        f"| {_ms(f['p50'])} / {_ms(f['p90'])} / {_ms(f['p99'])} "
        f"| {_ms(g['p50'])} / {_ms(g['p90'])} / {_ms(g['p99'])} | {_ms(e['p50'])} | "
        f"{'–' if tps is None else f'{tps:.0f}'} | {_pct(hit)} | {s['typing_through']} | "
        f"{_pct(s['would_accept_whole'])} / {_pct(s['would_accept_first_line'])} | "
        f"{s['cancelled']} / {s['superseded']} | {s['errors']} |"
    )


_COLUMNS = (
    "mode",
    "editor",
    "requests",
    "shown",
    "key→first token p50/p90/p99 ms",
    "key→ghost p50/p90/p99 ms",
    "engine first token p50 ms",
    "decode tok/s",
    "cache hits",
    "typing-through",
    "would accept whole / line",
    "cancelled / superseded",
    "errors",
)
HEADER = "| " + " | ".join(_COLUMNS) + " |\n|" + "---|" * len(_COLUMNS)


def _model(cfg: dict) -> str:
    """The model folder, or the random shape served with that folder's tokenizer."""
    args = cfg.get("engine_args") or []
    for i, arg in enumerate(args):
        if arg.startswith("--random-shape"):
            shape = arg.partition("=")[2] or (args[i + 1] if i + 1 < len(args) else "?")
            return f"random weights of the {shape} shape (latency only; tokenizer: {cfg['model']})"
    return cfg["model"]


def markdown_compare(result: dict) -> str:
    cfg = result["config"]
    lines = [
        "# wd-lsp latency: modes compared",
        "",
        f"Model: {_model(cfg)}. Segments: {len(cfg['segments'])} ({', '.join(cfg['segments'])}). "
        f"Cadence: {cfg['cadence']['key_ms']:.0f} ms a key ±{100 * cfg['cadence']['jitter']:.0f}%, "
        f"{cfg['cadence']['line_pause_ms']:.0f} ms pause after Enter.",
        "",
        HEADER,
    ]
    for name, editors in result["modes"].items():
        for editor, s in editors.items():
            lines.append(_row(name, editor, s))
    lines += [
        "",
        "Key→ghost counts answers shown for the current text; cancelled and stale answers are "
        "not shown. Cache hits: prompt tokens the engine took from its prefix cache (completions "
        "and warm-ups).",
        "",
    ]
    if result.get("engines"):
        lines += [
            f"Engine arguments: `{' '.join(cfg['engine_args']) or '(defaults)'}`; "
            f"engines alive at once: {cfg.get('daemons_at_once') or 'all'}. A mode@path arm forces "
            "that MoE path (`wd-engine serve --moe-path`); the others use the engine's own choice "
            "(on CUDA: warp decode for a few tokens, expert-centric for many).",
            "",
            "| mode | layers | experts (k) | vocab | dtype | device | MoE path | ready s "
            "| warm-up s |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for name, e in result["engines"].items():
            warm = e.get("warm_up_s")
            lines.append(
                f"| {name} | {e.get('layers')} | {e.get('experts')} "
                f"({e.get('experts_per_token')}) | {e.get('vocab_size')} | {e.get('dtype')} "
                f"| {e.get('device')} | {e.get('moe_path')} | "
                f"{e['ready_s']:.1f} | {'–' if warm is None else f'{warm:.1f}'} |"
            )
        lines.append("")
    for key, value in result.get("ratios", {}).items():
        lines.append(f"- {key}: {value:.2f}" if value is not None else f"- {key}: –")
    return "\n".join(lines) + "\n"


def markdown_soak(result: dict) -> str:
    s, kv = result["summary"], result["kv"]
    lines = [
        "# wd-lsp soak",
        "",
        f"{result['config']['editors']} editors ({result['config']['editor_style']}) "
        f"against one engine for {result['elapsed_s']:.0f} s; {result['sessions']} replays.",
        "",
        HEADER,
        _row(result["config"]["mode"], result["config"]["editor_style"], s),
        "",
        "| window | requests | shown | key→first token p50 ms | key→ghost p50 ms | errors |",
        "|---|---|---|---|---|---|",
    ]
    for w in result["windows"]:
        lines.append(
            f"| {w['start_s']:.0f}–{w['end_s']:.0f} s | {w['requests']} | {w['shown']} | "
            f"{_ms(w['first_token_p50'])} | {_ms(w['ghost_p50'])} | {w['errors']} |"
        )
    drift = "–" if result["drift"] is None else f"{result['drift']:.2f}"
    lines += [
        "",
        f"Latency drift (last window p50 / first window p50, key→first token): {drift}",
        f"KV blocks in use: {kv['start']['blocks_used']} at start, "
        f"{kv['end']['blocks_used']} at the end "
        f"({'back to start' if kv['returned'] else 'NOT back to start'}); evictable at the end: "
        f"{kv['end']['blocks_evictable']}, evictions: {kv['end']['evictions']}.",
        f"Failed requests: {s['errors']} "
        f"(engine failed: {(s.get('engine') or {}).get('failed', 0)}).",
    ]
    return "\n".join(lines) + "\n"


_METRIC_LABELS = {"first_token_ms": "first token", "ghost_ms": "ghost text"}


def plot_compare(result: dict, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = result["records"]
    paths = []
    editors = result["config"]["editors"]
    fig, axes = plt.subplots(1, len(editors), figsize=(6 * len(editors), 4.2), squeeze=False)
    for ax, editor in zip(axes[0], editors):
        for color, mode in enumerate(result["config"]["modes"]):
            for metric, style in (("first_token_ms", "-"), ("ghost_ms", "--")):
                rows = [r for r in records if r["mode"] == mode and r["editor"] == editor]
                vals = sorted(
                    r[metric]
                    for r in rows
                    if r[metric] is not None
                    and (
                        r["outcome"] == "shown"
                        if metric == "ghost_ms"
                        else r["outcome"] != "cancelled"
                    )
                )
                if vals:
                    # Steps with markers: a mode with a handful of answers still shows every one.
                    ax.step(
                        [0.0] + vals,
                        [0.0] + [(i + 1) / len(vals) for i in range(len(vals))],
                        style,
                        where="post",
                        marker=".",
                        color=f"C{color}",
                        label=f"{mode} {_METRIC_LABELS[metric]}",
                    )
        ax.set_title(f"{editor}: keystroke → first token / ghost text")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(out / "latency_cdf.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for mode in result["config"]["modes"]:
        rows = [
            r
            for r in records
            if r["mode"] == mode and r["first_token_ms"] is not None and r["outcome"] != "cancelled"
        ]
        if rows:
            ax.scatter(
                [r["context_chars"] for r in rows],
                [r["first_token_ms"] for r in rows],
                s=10,
                alpha=0.6,
                label=mode,
            )
    ax.set_title("keystroke → first token vs context length")
    ax.set_xlabel("characters before the cursor")
    ax.set_ylabel("ms")
    ax.set_yscale("log")
    ax.set_xscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out / "latency_vs_context.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def plot_soak(result: dict, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = result["started_at"]
    rows = [
        r
        for r in result["records"]
        if r["first_token_ms"] is not None and r["outcome"] != "cancelled"
    ]
    fig, ax = plt.subplots(figsize=(8, 4.2))
    ax.scatter(
        [r["key_at"] - t0 for r in rows],
        [r["first_token_ms"] for r in rows],
        s=6,
        alpha=0.4,
        label="requests",
    )
    ax.plot(
        [(w["start_s"] + w["end_s"]) / 2 for w in result["windows"]],
        [w["first_token_p50"] for w in result["windows"]],
        "r-o",
        label="p50 per window",
    )
    ax.set_title(f"soak: {result['config']['editors']} editors — keystroke → first token over time")
    ax.set_xlabel("s since start")
    ax.set_ylabel("ms")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "soak_latency.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def write(result: dict, out: Path, plots: bool = True) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    soak = result.get("kind") == "soak"
    written = [out / "latency.json", out / "latency.md"]
    written[0].write_text(json.dumps(result, indent=1, default=float))
    written[1].write_text(markdown_soak(result) if soak else markdown_compare(result))
    if plots:
        written += plot_soak(result, out) if soak else plot_compare(result, out)
    return written
