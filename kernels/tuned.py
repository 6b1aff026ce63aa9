"""Block-size configs tuned on the GPU and stored in `kernels/configs/` as JSON.

One file per kernel family and MoE shape, written by `python -m kernels.bench.moe --tune`:

    warp_decode_H{H}_I{I}_E{E}_k{k}.json   {"device": ..., "gate_up": {B: cfg}, "down": {B: cfg}}
    fused_moe_H{H}_I{I}_E{E}_k{k}.json     {"device": ..., "configs": {B: cfg}}
    crossover.json                          {"E{E}_k{k}": {"warp_decode_max_tokens": n, ...}}

A table maps batch sizes (tokens) to a config; a lookup takes the nearest measured batch size,
as the tuned optimum moves slowly with it. Shapes without a file get the kernels' defaults.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

CONFIG_DIR = Path(__file__).resolve().parent / "configs"


def shape_name(family: str, hidden: int, inter: int, experts: int, top_k: int) -> str:
    return f"{family}_H{hidden}_I{inter}_E{experts}_k{top_k}.json"


@functools.cache
def load(name: str) -> dict | None:
    path = CONFIG_DIR / name
    if not path.exists():
        return None
    with open(path) as f:
        return json.load(f)


def nearest_key(table: dict | None, tokens: int) -> str | None:
    """The batch-size key closest to `tokens` (ties go to the smaller one)."""
    if not table:
        return None
    return min(table, key=lambda key: (abs(int(key) - tokens), int(key)))


def nearest(table: dict | None, tokens: int) -> dict | None:
    """The config of the batch size closest to `tokens` (ties go to the smaller one)."""
    key = nearest_key(table, tokens)
    return None if key is None else table[key]


def save(name: str, data: dict, directory: Path | None = None) -> Path:
    directory = Path(directory) if directory is not None else CONFIG_DIR
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    with open(path, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.write("\n")
    load.cache_clear()
    return path
