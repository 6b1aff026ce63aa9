"""CI latency gate: a short real replay (real server, real daemon, embedded model) with the cache
off and with cache + speculative warm, side by side. Gates on ratios only: the machine is shared
and its absolute speed says nothing."""

import asyncio
import os

import pytest

from wd_lsp.bench import sources
from wd_lsp.bench.compare import CompareConfig, run_compare
from wd_lsp.bench.script import Cadence

# Request -> first token p50, warm + cache over cache off: well under 1, as a cached prompt
# recomputes only its suffix part; a broken cache or warm-up gives ~1. Keystroke -> first token
# also holds the editor's 200 ms and the server's 60 ms debounce, which no cache shortens, so its
# bound is looser. The ratios measured on a shared 2-core CPU are in BENCHMARKS.md.
MAX_REQUEST_RATIO = 0.6
MAX_KEYSTROKE_RATIO = 0.8


@pytest.mark.slow
def test_warm_cache_halves_first_token_latency(tmp_path, monkeypatch):
    monkeypatch.setenv("WD_ENGINE_IDLE_TIMEOUT", "30")
    files = [
        (name, text) for name, text in sources.project_files() if name.endswith("wd_lsp/server.py")
    ]
    segments = sources.segments(files, 1, lines=2, seed=1)
    assert segments, "no segment to type"
    # Neovim-style requests (after 200 ms without a key) from a typist who stops after every
    # word, long enough for a cold prompt to answer: every request is measured in both modes,
    # none is cut short, so the median compares like with like.
    config = CompareConfig(
        segments,
        modes=["cache-off", "cache-warm"],
        editors=["nvim"],
        cadence=Cadence(key_ms=100, jitter=0.3, line_pause_ms=2400, word_pause_ms=2400),
        server_options={"maxTokens": 16},
    )
    run_dir = tmp_path.parent / f"lat{os.getpid()}"  # short: AF_UNIX paths are limited
    result = asyncio.run(run_compare(config, run_dir, progress=lambda m: None))
    off, warm = result["modes"]["cache-off"]["all"], result["modes"]["cache-warm"]["all"]
    report = {
        m: (
            s["request_to_first_token_ms"],
            s["keystroke_to_first_token_ms"],
            s["outcomes"],
            s["errors"],
        )
        for m, s in (("off", off), ("warm", warm))
    }
    assert off["errors"] == 0 and warm["errors"] == 0, report
    assert (
        off["request_to_first_token_ms"]["n"] >= 3 and warm["request_to_first_token_ms"]["n"] >= 3
    ), report

    def ratio(metric):
        return warm[metric]["p50"] / off[metric]["p50"]

    print(
        f"warm/off p50: request->first token {ratio('request_to_first_token_ms'):.2f}, "
        f"keystroke->first token {ratio('keystroke_to_first_token_ms'):.2f}",
        report,
    )
    assert ratio("request_to_first_token_ms") <= MAX_REQUEST_RATIO, report
    assert ratio("keystroke_to_first_token_ms") <= MAX_KEYSTROKE_RATIO, report
    assert warm["engine"]["cache_hit_ratio_all"] > 0.5, warm["engine"]
    assert off["engine"]["cache_hit_tokens"] == 0, off["engine"]
