"""The replay library's pieces that need no server: keystroke scripts, segment choice, metrics,
and the report writer (plots included)."""

import random

from wd_lsp.bench.metrics import percentile, summarize, would_accept
from wd_lsp.bench.report import write
from wd_lsp.bench.script import Cadence, Segment, keystrokes, pick_segment

CODE = (
    "\n".join(
        ["import os", ""]
        + [
            f"def f{i}(x):\n    if x > {i}:\n        return x * {i}\n    return os.sep"
            for i in range(12)
        ]
    )
    + "\n"
)


def test_keystrokes_retype_the_segment_exactly():
    seg = pick_segment("a.py", CODE, 3, random.Random(0))
    assert seg is not None and seg.before + seg.typed + seg.after == CODE
    keys = keystrokes(seg, Cadence(word_pause_ms=500), random.Random(1))
    assert "".join(k.text for k in keys) == seg.typed
    assert keys[-1].text == ""  # the final pause, after the last key
    # Enter carries the next line's indentation in one key.
    enters = [k.text for k in keys if k.text.startswith("\n")]
    assert all(e.strip(" \t") == "\n" for e in enters) and any(len(e) > 1 for e in enters)


def test_cadence_pauses_after_enter_and_words():
    seg = Segment("a.py", "x = 1\n", "y = 2\nz = 3\n", "")
    keys = keystrokes(
        seg, Cadence(key_ms=100, jitter=0, line_pause_ms=700, word_pause_ms=300), random.Random(0)
    )
    assert [round(k.delay_ms) for k in keys] == [
        100,
        100,
        400,
        100,
        400,
        100,
        800,
        100,
        400,
        100,
        400,
        100,
        700,
    ]


def test_segments_respect_context_minimums():
    rng = random.Random(0)
    seg = pick_segment("a.py", CODE, 2, rng, min_before=200, min_after=100)
    assert len(seg.before) >= 200 and len(seg.after) >= 100
    assert pick_segment("a.py", CODE, 2, rng, min_before=10**6) is None


def test_would_accept_whole_and_first_line():
    assert would_accept("foo(x)\n", "foo(x)\nbar()") == (True, True)
    assert would_accept("foo(x)\nbaz()", "foo(x)\nbar()") == (False, True)
    assert would_accept("fo", "foo(x)\n") == (True, False)  # a prefix of the line: whole, not line
    assert would_accept("   ", "foo") == (False, False)


def test_percentile_is_nearest_rank():
    assert percentile([], 50) is None
    assert percentile([3, 1, 2], 50) == 2
    assert percentile(list(range(1, 101)), 99) == 99


def _record(**kw):
    base = dict(
        editor="nvim",
        segment="a.py",
        version=2,
        typed_chars=1,
        context_chars=10,
        key_at=0.0,
        sent_at=0.2,
        answer_at=0.5,
        outcome="shown",
        text="x",
        truth="x\n",
        first_token_at=0.4,
        usage=None,
        engine_ms=None,
        engine_first_token_ms=150.0,
        deltas=5,
        decode_s=0.1,
        error=None,
        ghost_ms=500.0,
        first_token_ms=400.0,
        request_first_token_ms=200.0,
        mode="cache-on",
    )
    base.update(kw)
    return base


def test_summary_and_report(tmp_path):
    records = [
        _record(),
        _record(outcome="cancelled", text="", first_token_ms=None, request_first_token_ms=None),
        _record(outcome="error", error="boom"),
    ]
    s = summarize(
        records,
        [{"typing_through": 2, "superseded": 1, "errors": 0}],
        {
            "requests": 3,
            "completed": 1,
            "cancelled": 1,
            "failed": 0,
            "prompt_tokens": 100,
            "cache_hit_tokens": 80,
            "evictions": 0,
        },
    )
    assert s["shown"] == 1 and s["cancelled"] == 1 and s["errors"] == 1
    assert (
        s["keystroke_to_ghost_ms"]["p50"] == 500.0 and abs(s["decode_tokens_per_s"] - 40.0) < 1e-9
    )
    assert s["would_accept_whole"] == 1.0 and s["engine"]["cache_hit_ratio_all"] == 0.8
    result = dict(
        kind="compare",
        modes={"cache-on": {"nvim": s, "all": s}},
        ratios={"x": 0.5},
        records=records,
        config=dict(
            modes=["cache-on"],
            editors=["nvim"],
            segments=["a.py"],
            cadence=dict(key_ms=110, jitter=0.3, line_pause_ms=700),
            model="default",
        ),
    )
    written = write(result, tmp_path)
    assert {p.name for p in written} == {
        "latency.json",
        "latency.md",
        "latency_cdf.png",
        "latency_vs_context.png",
    }
    assert "| cache-on | nvim |" in (tmp_path / "latency.md").read_text()
