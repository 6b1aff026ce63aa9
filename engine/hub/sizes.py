"""Sizes for people: decimal units, as the hub and `--gpu-memory-gb` count them."""

from __future__ import annotations


def size_text(n: int) -> str:
    """`61.1 GB`, `52.4 MB`, `812 kB`, `93 B`."""
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if n >= scale:
            value = n / scale
            return f"{value:.1f} {unit}" if value < 100 or unit == "GB" else f"{value:.0f} {unit}"
    return f"{n} B"
