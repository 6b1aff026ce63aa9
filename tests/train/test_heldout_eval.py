"""The trainer's held-out FIM numbers: loss on the middles and greedy exact match by argmax."""

import contextlib
import math

import torch

from engine.train.train import heldout_eval

V, T = 11, 8


class Oracle(torch.nn.Module):
    """Predicts each row's next token with certainty, except at the (row, position) pairs in
    `wrong`, where it is certain of a different token."""

    def __init__(self, rows: torch.Tensor, wrong: set[tuple[int, int]]):
        super().__init__()
        self.rows, self.wrong = rows, wrong

    def forward(self, x):
        logits = torch.full((*x.shape, V), -30.0)
        for b in range(x.shape[0]):
            r = next(i for i, row in enumerate(self.rows) if torch.equal(row[:-1], x[b]))
            for t in range(x.shape[1]):
                target = int(self.rows[r, t + 1])
                logits[b, t, (target + 1) % V if (r, t) in self.wrong else target] = 30.0
        return logits, torch.zeros(())


def test_fim_exact_counts_rows_whose_every_scored_token_is_the_argmax():
    g = torch.Generator().manual_seed(0)
    rows = torch.randint(0, V, (5, T + 1), generator=g)
    rows[:, 0] = torch.arange(5)  # distinct rows, so the oracle can tell them apart
    mask = torch.zeros(5, T, dtype=torch.bool)
    mask[:, 4:7] = True  # the middle and its end
    wrong = {(1, 5), (2, 1), (3, 6), (3, 2)}  # rows 1 and 3 miss a scored token; row 2 only context
    model = Oracle(rows, wrong)
    result = heldout_eval(
        model,
        rows,
        torch.ones(5, T, dtype=torch.int64),
        "cpu",
        contextlib.nullcontext(),
        {"fim": (rows, mask)},
    )
    assert result["fim_exact"] == 3 / 5
    # Two of the 15 scored tokens are certain of the wrong token: their loss is 60 nats each.
    assert math.isclose(result["fim_loss"], 2 * 60 / 15, rel_tol=1e-3)
    assert model.training  # left in training mode
