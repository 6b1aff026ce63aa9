"""Which of a hub repo's files the engine reads, and the weights' format, told from config.json
before any weight is downloaded.

A model folder for this engine (engine.loading) is its top level: config.json and the other JSON
files (tokenizer, generation config, weight index), the safetensors weights (the shards the index
names, when there is one) and the model card and licence. Other weights a repo may carry beside
them (PyTorch `.bin`, GGUF, ONNX, an `original/` folder) are never read, so never downloaded.
"""

from __future__ import annotations

from collections.abc import Iterable

INDEX_FILE = "model.safetensors.index.json"
# Small files worth having beside the weights: the model card says what the model is and its
# licence says how it may be used.
_DOCUMENTS = ("README.md", "LICENSE", "LICENSE.md", "LICENSE.txt", "NOTICE")
# What `pull --include-format` and the model listing call the weights' formats; bf16 stands for
# any unquantized checkpoint (fp16 and fp32 ones run as bf16 on a GPU too).
FORMATS = ("fp8", "int4", "bf16")
_UNQUANTIZED = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


class UnsupportedWeights(ValueError):
    """The repo's weights are in a form the engine does not read."""


def engine_files(paths: Iterable[str], weight_map: dict[str, str] | None = None) -> list[str]:
    """The files of a repo (paths as the hub lists them, `/`-separated) that the engine reads:
    top-level JSON, documents and safetensors; with an index (`weight_map`: tensor -> file), only
    the shards it names."""
    paths = list(paths)
    shards = set(weight_map.values()) if weight_map else None
    chosen = []
    for path in paths:
        if "/" in path:
            continue
        if path.endswith(".json") or path in _DOCUMENTS:
            chosen.append(path)
        elif path.endswith(".safetensors") and (shards is None or path in shards):
            chosen.append(path)
    return sorted(chosen)


def weight_files(paths: Iterable[str]) -> list[str]:
    return [p for p in paths if p.endswith(".safetensors")]


def weights_format(config: dict) -> str:
    """The stored weights' format from a config.json: "fp8" (Qwen's block-scaled FP8 releases),
    "int4" (compressed-tensors' pack-quantized W4A16), or the unquantized dtype ("bf16", "fp16",
    "fp32"); UnsupportedWeights for other quantizations (AWQ, GPTQ, bitsandbytes, MXFP4...).
    The loader checks the details (block sizes, groups) when it reads the weights."""
    quant = config.get("quantization_config")
    if quant:
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        if method == "fp8":
            return "fp8"
        if method == "compressed-tensors" and _int4_scheme(quant):
            return "int4"
        raise UnsupportedWeights(
            f"its weights are quantized with {method!r}, which this engine does not read (it "
            "reads bf16/fp16/fp32, block-scaled FP8 and compressed-tensors int4 W4A16)"
        )
    dtype = config.get("torch_dtype") or config.get("dtype") or "bfloat16"
    return _UNQUANTIZED.get(str(dtype), "bf16")


def _int4_scheme(quant: dict) -> bool:
    groups = quant.get("config_groups")
    if not isinstance(groups, dict) or len(groups) != 1:
        return False
    scheme = next(iter(groups.values()))
    if not isinstance(scheme, dict):
        return False
    weights = scheme.get("weights") or {}
    fmt = scheme.get("format") or quant.get("format")
    return fmt == "pack-quantized" and weights.get("num_bits") == 4


def format_matches(stored: str, wanted: str) -> bool:
    """Whether weights stored as `stored` are what `--include-format wanted` asks for."""
    if wanted == "bf16":
        return stored in _UNQUANTIZED.values()
    return stored == wanted
