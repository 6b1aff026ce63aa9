"""`wd-engine models`: the models found (`catalog`) with their fit verdicts (`fit`) for this
machine (`machine`), as a table or as JSON; `wd-engine doctor` shows the same table."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path

from engine.hub.sizes import size_text
from engine.inventory.catalog import Catalog, LocalModel, find_models, is_default
from engine.inventory.fit import Verdict, cpu_verdict, gpu_for_models, gpu_verdict
from engine.inventory.machine import Gpu, HostMemory, gpus, host_memory
from engine.models import MODEL_ENV_VAR

_COLUMNS = ("", "MODEL", "ARCHITECTURE", "FORMAT", "SIZE", "CONTEXT", "GPU", "CPU", "SOURCE")


@dataclass(frozen=True)
class Row:
    model: LocalModel
    default: bool
    gpu: Verdict
    cpu: Verdict


@dataclass(frozen=True)
class ModelsReport:
    gpus: list[Gpu]
    host: HostMemory
    catalog: Catalog
    rows: list[Row]


def build_report(gpu_override_gb: float | None = None, cache=None) -> ModelsReport:
    """The models and verdicts; `gpu_override_gb` as engine.inventory.machine.gpus takes it."""
    found_gpus = gpus(gpu_override_gb)
    gpu = gpu_for_models(found_gpus)
    host = host_memory()
    catalog = find_models(cache)
    rows = [
        Row(m, is_default(m, catalog), gpu_verdict(m, gpu), cpu_verdict(m, host))
        for m in catalog.models
    ]
    return ModelsReport(found_gpus, host, catalog, rows)


def gpu_line(found: list[Gpu]) -> str:
    if not found:
        return "GPU: none (no CUDA device): the engine runs on the CPU"
    first = found[0]
    if first.faked:
        return f"GPU: {size_text(first.total_bytes)} {first.name}"
    more = (
        f"; {len(found) - 1} more GPUs (the verdicts are for {first.device})" if found[1:] else ""
    )
    return (
        f"GPU: {first.device} {first.name}, {size_text(first.total_bytes)} "
        f"({size_text(first.free_bytes)} free){more}"
    )


def host_line(host: HostMemory) -> str:
    return (
        f"CPU memory: {size_text(host.total_bytes)} ({size_text(host.available_bytes)} available)"
    )


def render_text(report: ModelsReport, header: bool = True) -> str:
    """The machine's memory (`header`), the table, then the default's note and why each misfit
    does not fit."""
    lines = [gpu_line(report.gpus), host_line(report.host), ""] if header else []
    table = [_COLUMNS]
    for row in report.rows:
        m = row.model
        table.append(
            (
                "*" if row.default else "",
                m.name,
                m.architecture or "?",
                m.format or "?",
                size_text(m.size_bytes),
                str(m.context) if m.context else "?",
                row.gpu.short,
                row.cpu.short,
                m.source,
            )
        )
    widths = [max(len(r[i]) for r in table) for i in range(len(_COLUMNS))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in table]
    lines.append("")
    lines.append(_default_note(report))
    for row in report.rows:
        if row.model.problem:
            lines.append(f"{row.model.name}: {row.model.problem}")
        elif row.gpu.fits is False:
            lines.append(f"GPU: {row.gpu.why}")
    return "\n".join(lines)


def _default_note(report: ModelsReport) -> str:
    catalog = report.catalog
    if catalog.default_problem:
        return f"no default model: {catalog.default_problem}"
    named = _env_model()
    what = (
        f"${MODEL_ENV_VAR} ({named})" if named else f"the embedded model (${MODEL_ENV_VAR} unset)"
    )
    return (
        f"* the default: {what}; the editor's `model` setting or --model picks another "
        "(a folder, a repo id, a name above)"
    )


def _env_model() -> str | None:
    return os.environ.get(MODEL_ENV_VAR) or None


def as_json(report: ModelsReport) -> dict:
    def verdict(v: Verdict) -> dict:
        return {"fits": v.fits, "needed_bytes": v.needed_bytes, "why": v.why}

    def model(row: Row) -> dict:
        data = {k: str(v) if isinstance(v, Path) else v for k, v in asdict(row.model).items()}
        return {**data, "default": row.default, "gpu": verdict(row.gpu), "cpu": verdict(row.cpu)}

    return {
        "gpus": [asdict(g) for g in report.gpus],
        "host": asdict(report.host),
        "default": str(report.catalog.default) if report.catalog.default else None,
        "default_problem": report.catalog.default_problem,
        "models": [model(r) for r in report.rows],
    }
