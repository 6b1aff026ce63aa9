"""The held-out FIM eval (engine.train.eval) cut as the language server cuts for a model.

    python -m wd_lsp.bench.editor_eval --model DIR [more options of engine.train.eval]

The server's context budget, fitted to the model's context and its max_tokens, gives the prefix
and suffix kept, in characters at its estimate per token (it cuts at line and syntax boundaries
within that, so this is the upper end of what it sends); the tasks are then laid out as the
engine daemon lays out the server's request (`--layout server`). The engine is imported only
when the eval runs: the language server's modules never import torch.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from wd_lsp.config import Settings
from wd_lsp.context import Budget

FORWARDED_OPTIONS = """\
Every other option (--files, --kinds, --orders, --beams, --details, ...) goes to the eval as
given: `python -m engine.train.eval --help` lists them. The layout and the context cut
(--layout, --server-max-tokens, --prefix-chars, --suffix-chars) are set here, after them."""


def editor_context_chars(model_dir: Path, max_tokens: int) -> tuple[int, int]:
    """The prefix and suffix the language server sends the model, in characters."""
    context = json.loads((Path(model_dir) / "config.json").read_text())["max_position_embeddings"]
    budget = Budget().fitted(context, max_tokens)
    return (
        int(budget.prefix_tokens * budget.chars_per_token),
        int(budget.suffix_tokens * budget.chars_per_token),
    )


def eval_arguments(model_dir: Path) -> list[str]:
    """The eval's options that make its tasks what the server sends the model."""
    max_tokens = Settings().max_tokens
    prefix_chars, suffix_chars = editor_context_chars(model_dir, max_tokens)
    return [
        "--layout",
        "server",
        "--server-max-tokens",
        str(max_tokens),
        "--prefix-chars",
        str(prefix_chars),
        "--suffix-chars",
        str(suffix_chars),
    ]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=FORWARDED_OPTIONS,
    )
    ap.add_argument("--model", type=Path, required=True, help="the model directory")
    args, rest = ap.parse_known_args(argv)
    from engine.train import eval as heldout_eval

    heldout_eval.main(["--model", str(args.model), *rest, *eval_arguments(args.model)])


if __name__ == "__main__":
    main()
