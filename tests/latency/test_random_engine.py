"""The pieces of the GPU latency run (`tests/latency/gpu_run.sh`) that the CPU can check: a daemon
serving a random-weight shape with a forced MoE path, its warm-up, and how arms are named and
compared."""

import asyncio
import os
import shutil

import pytest

from wd_lsp.bench.compare import ratios
from wd_lsp.bench.engines import Arm, start_daemon, wait_ready, warm_up


def test_arms_name_a_mode_and_an_optional_moe_path():
    arm = Arm.parse("cache-warm@expert_centric")
    assert (arm.mode.name, arm.moe_path, arm.engine_args()) == (
        "cache-warm",
        "expert_centric",
        ["--moe-path", "expert_centric"],
    )
    assert Arm.parse("cache-off").engine_args() == []
    for bad in ("cache-hot", "cache-on@fastest"):
        with pytest.raises(ValueError):
            Arm.parse(bad)


def test_ratios_compare_cache_modes_and_moe_paths():
    def summary(first_token, decode):
        p50 = {"p50": first_token}
        return {
            "all": dict(
                keystroke_to_first_token_ms=p50,
                request_to_first_token_ms=p50,
                keystroke_to_ghost_ms=p50,
                engine_first_token_ms=p50,
                decode_tokens_per_s=decode,
            )
        }

    out = ratios(
        {
            "cache-off": summary(400, 10),
            "cache-warm": summary(100, 20),
            "cache-warm@expert_centric": summary(150, 10),
        }
    )
    assert out["cache-warm / cache-off p50 request_to_first_token"] == 0.25
    assert out["cache-warm@expert_centric / cache-warm p50 engine_first_token"] == 1.5
    assert out["cache-warm@expert_centric / cache-warm decode tok/s"] == 0.5
    assert not any(
        k.startswith("cache-warm@expert_centric / cache-off") for k in out
    )  # another path


def test_daemon_serves_a_random_shape_with_a_forced_moe_path(tmp_path):
    # A vocabulary larger than the tokenizer's, as the Qwen3-30B-A3B shape has.
    run_dir = tmp_path.parent / f"rnd{os.getpid()}"  # short: AF_UNIX paths are limited
    daemon = start_daemon(
        run_dir,
        "cache-warm@expert_centric",
        True,
        extra_args=[
            "--random-shape",
            "tiny",
            "--random-vocab-size",
            "20000",
            "--moe-path",
            "expert_centric",
        ],
    )

    async def check():
        try:
            await wait_ready(daemon, timeout_s=120)
            info = await daemon.client.request("model_info")
            assert (info["layers"], info["vocab_size"], info["device"]) == (2, 20000, "cpu")
            assert await warm_up(daemon, max_tokens=2) > 0
            stream = await daemon.client.complete(
                {"prefix": "def add(a, b):\n    return ", "suffix": "\n", "max_tokens": 12}
            )
            [_ async for _ in stream]
            assert stream.result["usage"]["completion_tokens"] > 0
            stats = await daemon.stats()
            assert stats["completed"] == 6 and stats["failed"] == 0
        finally:
            await daemon.stop()

    try:
        asyncio.run(check())
        assert "MoE path expert_centric" in (run_dir / "cache-warm-expert_centric.log").read_text()
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
