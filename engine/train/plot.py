"""Draw the loss curve (train loss and held-out loss against tokens seen) from log.jsonl."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def plot_loss(log_path: Path, png_path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = [json.loads(l) for l in Path(log_path).read_text().splitlines() if l.strip()]
    train = [(r["tokens_seen"] / 1e6, r["loss"]) for r in recs if "loss" in r]
    held = [(r["tokens_seen"] / 1e6, r["heldout_loss"]) for r in recs if "heldout_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(*zip(*train), label="train (FIM + left-to-right)", lw=1)
    if held:
        ax.plot(*zip(*held), "o-", label="held-out files (left-to-right)")
    ax.set_xlabel("tokens seen (millions)")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_ylim(top=min(6.0, max(l for _, l in train)))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)


if __name__ == "__main__":
    plot_loss(Path(sys.argv[1]), Path(sys.argv[2]))
