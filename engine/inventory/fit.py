"""Whether a model fits this machine, before anything loads: the GPU verdict is the load check's
own arithmetic (engine.loading.memory: the weights as the loader holds them on CUDA, a minimal
KV cache and the activations' reserve) against a GPU's whole memory; the CPU verdict is the
weights in fp32 (quantized ones are dequantized there) with the int8 copies the CPU decode step
streams, the CPU's default KV pool and a reserve, against the main memory."""

from __future__ import annotations

from dataclasses import dataclass

from engine.hub.sizes import size_text
from engine.inventory.catalog import LocalModel
from engine.inventory.machine import Gpu, HostMemory
from engine.models import short_path, user_models_dir

CPU_KV_BYTES = 256 << 20  # the daemon's KV pool on the CPU (engine.cli.kv_pool_bytes)
CPU_RESERVE_BYTES = 10**9  # activations, the tokenizer, the interpreter
# The int8 weight copies of the lean CPU decode step (engine.model.lean_matrices): a quarter of
# the fp32 projections, counted as a quarter of all the weights.
CPU_INT8_SHARE = 0.25


@dataclass(frozen=True)
class Verdict:
    fits: bool | None  # None: cannot tell (no GPU, a model the engine cannot run)
    needed_bytes: int | None = None
    why: str | None = None  # when it does not fit: what it needs, and what would fit

    @property
    def short(self) -> str:
        if self.fits is None:
            return "-"
        size = f" ({size_text(self.needed_bytes)})" if self.needed_bytes else ""
        return ("fits" if self.fits else "no") + size


def gpu_verdict(model: LocalModel, gpu: Gpu | None) -> Verdict:
    """Whether `model` fits `gpu` when nothing else holds it (None: no GPU)."""
    if gpu is None or model.problem:
        return Verdict(None)
    from engine.loading import memory
    from engine.model.config import ModelConfig, ModelFormatError

    try:
        config = ModelConfig.from_dir(model.path)
        weights = memory.checkpoint_weight_bytes(model.path, "auto", "cuda")
    except (ModelFormatError, OSError, ValueError) as exc:
        return Verdict(None, why=str(exc))
    kv = memory.MIN_KV_TOKENS * memory.kv_bytes_per_token(config, "bfloat16")
    needed = weights.total + kv + memory.RESERVE_BYTES
    what = gpu.name if gpu.faked else f"of {gpu.device} ({gpu.name})"
    budget = memory.GpuBudget(gpu.device, gpu.total_bytes, what, capped=False)
    quantized = weights.format in memory.QUANT_FORMATS or "+" in weights.format
    why = memory.fit_error(
        model.name, weights, config.raw, budget, kv, _how_to_quantize(model, quantized)
    )
    return Verdict(why is None, needed, why)


def cpu_verdict(model: LocalModel, host: HostMemory) -> Verdict:
    """Whether `model` fits the main memory, on the CPU path."""
    if model.problem:
        return Verdict(None)
    from engine.loading import memory
    from engine.model.config import ModelFormatError

    try:
        weights = memory.checkpoint_weight_bytes(model.path, "auto", "cpu").total
    except (ModelFormatError, OSError, ValueError) as exc:
        return Verdict(None, why=str(exc))
    needed = int(weights * (1 + CPU_INT8_SHARE)) + CPU_KV_BYTES + CPU_RESERVE_BYTES
    if needed <= host.total_bytes:
        return Verdict(True, needed)
    return Verdict(
        False,
        needed,
        f"{model.name} needs ~{size_text(needed)} of memory on the CPU (its weights in fp32 and "
        f"the decode step's int8 copies), more than the {size_text(host.total_bytes)} this "
        "machine has",
    )


def _how_to_quantize(model: LocalModel, quantized: bool):
    """How the fit message says to make a smaller copy: of a hub model, by its repo id into the
    user's models folder; of a folder, beside it (engine.loading.memory.quantize_command)."""
    from engine.loading import memory

    if model.repo_id is None or quantized:
        return memory.quantize_command(model.path, quantized)
    name = model.repo_id.split("/", 1)[1]
    folder = short_path(user_models_dir())
    return lambda fmt: f"`wd-engine quantize --to {fmt} {model.name} {folder}/{name}-{fmt}`"


def gpu_for_models(gpus: list[Gpu]) -> Gpu | None:
    """The GPU the verdicts are for: the first (`--device cuda` is cuda:0)."""
    return gpus[0] if gpus else None
