"""The GPU memory check (engine.loading.memory): the weights' bytes known before loading equal what
the loaded model holds; a model that does not fit is refused with the size, the budget and the
quantization that would fit; under a cap the KV pool takes what the weights and the reserve
leave."""

import json
import logging
from types import SimpleNamespace

import pytest
import torch
from checkpoints import quantized_folder

from engine import cli
from engine.kv.pool import KVPool
from engine.loading import memory
from engine.loading.loader import load_model
from engine.loading.random_model import TINY, random_model, shape_config
from engine.model.config import ModelConfig, ModelFormatError
from engine.model.qwen3_moe import weight_bytes

GB = memory.GB


def _budget(gb: float, what="allowed (--gpu-memory-gb)", capped=True) -> memory.GpuBudget:
    return memory.GpuBudget("cuda:0", int(gb * GB), what, capped)


@pytest.mark.parametrize("tie", [False, True])
def test_a_bf16_folder_estimate_equals_the_loaded_models_bytes(checkpoint_factory, tie):
    folder = checkpoint_factory(tie=tie, dtype=torch.bfloat16)
    for dtype in (torch.bfloat16, torch.float32):
        model = load_model(folder, dtype=dtype)
        estimate = memory.checkpoint_weight_bytes(folder, dtype, "cpu")
        assert estimate.total == weight_bytes(model)
        assert estimate.format == {torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype]
    # Nothing quantized: a GPU holds the same bytes; the config alone gives them too.
    assert memory.checkpoint_weight_bytes(folder, "bfloat16", "cuda").total == weight_bytes(
        load_model(folder, dtype=torch.bfloat16)
    )
    raw = ModelConfig.from_dir(folder).raw
    assert memory.config_weight_bytes(raw, None, "bfloat16").total == weight_bytes(
        load_model(folder, dtype=torch.bfloat16)
    )


def test_a_dense_layer_and_a_sharded_folder_are_counted(checkpoint_factory):
    folder = checkpoint_factory(mlp_only_layers=(1,), max_shard_size="40KB")
    assert (folder / "model.safetensors.index.json").is_file()
    model = load_model(folder, dtype=torch.bfloat16)
    assert memory.checkpoint_weight_bytes(folder, torch.bfloat16, "cpu").total == weight_bytes(
        model
    )


def _hand_count(cfg: ModelConfig, projection_bytes, plain_bytes: int = 2) -> int:
    """The tiny checkpoint's weights by hand: projections as `projection_bytes(out, in)` (q/k/v
    and gate/up joined), the rest (embedding, lm_head, router, norms) in bf16."""
    h, d, e = cfg.hidden_size, cfg.head_dim, cfg.num_experts
    hq, hkv, inter = cfg.num_heads * d, cfg.num_kv_heads * d, cfg.moe_intermediate_size
    per_layer = (
        projection_bytes(hq + 2 * hkv, h)
        + projection_bytes(h, hq)
        + e * (projection_bytes(2 * inter, h) + projection_bytes(h, inter))
        + plain_bytes * (e * h + 2 * h + 2 * d)
    )
    head = 0 if cfg.tie_word_embeddings else cfg.vocab_size * h
    return cfg.num_layers * per_layer + plain_bytes * (cfg.vocab_size * h + h + head)


@pytest.mark.parametrize("fmt,size", [("fp8", 16), ("int4", 16)])
def test_a_quantized_folder_estimate_counts_its_stored_bytes(
    checkpoint_factory, tmp_path, fmt, size
):
    folder = quantized_folder(checkpoint_factory(), tmp_path / fmt, fmt, size)
    cfg = ModelConfig.from_dir(folder)
    if fmt == "fp8":  # a byte an element, an fp32 scale a 16x16 block

        def projection(out_f, in_f):
            return out_f * in_f + 4 * -(-out_f // size) * -(-in_f // size)
    else:  # half a byte an element, a bf16 scale a row and group of 16

        def projection(out_f, in_f):
            return out_f * in_f // 2 + 2 * out_f * (in_f // size)

    estimate = memory.checkpoint_weight_bytes(folder, "auto", "cuda")
    assert estimate.format == fmt
    assert estimate.total == _hand_count(cfg, projection)
    # What the loader keeps on CUDA, kept on the CPU here: the same bytes.
    assert estimate.total == weight_bytes(load_model(folder, torch.bfloat16, keep_quantized=True))
    # The config and the format give it too, for a folder whose blocks fit its shapes.
    assert (
        estimate.total == memory.config_weight_bytes(cfg.raw, fmt, "auto", "cuda", size, size).total
    )
    # On the CPU everything is dequantized, to fp32 by default.
    assert memory.checkpoint_weight_bytes(folder, "auto", "cpu").total == weight_bytes(
        load_model(folder)
    )


@pytest.mark.parametrize("fmt,size", [("fp8", 32), ("int4", 8)])
def test_weights_the_loader_dequantizes_are_counted_in_the_run_dtype(
    checkpoint_factory, tmp_path, fmt, size
):
    """FP8 blocks of 32 would straddle the experts' gate and up (48 rows each); int4 groups of 8
    are narrower than the kernels' tiles: the loader holds those in bf16, and so does the count."""
    folder = quantized_folder(checkpoint_factory(), tmp_path / fmt, fmt, size)
    kept = load_model(folder, torch.bfloat16, keep_quantized=True)
    plain = load_model(folder, torch.bfloat16, keep_quantized=False)
    estimate = memory.checkpoint_weight_bytes(folder, torch.bfloat16, "cuda")
    assert estimate.total == weight_bytes(kept)
    if fmt == "int4":
        assert estimate.total == weight_bytes(plain) and estimate.format == "bf16"
    else:
        assert weight_bytes(kept) < weight_bytes(plain) and estimate.format == "fp8"


@pytest.mark.parametrize(
    "quant,lm_head", [(None, False), ("fp8", False), ("int4", False), ("fp8", True), ("int4", True)]
)
def test_a_random_shapes_estimate_equals_the_built_model(quant, lm_head):
    config = dict(TINY, vocab_size=512, hidden_size=128, moe_intermediate_size=64, head_dim=32)
    if lm_head:
        config["tie_word_embeddings"] = False
    model = random_model(
        config, dtype=torch.bfloat16, quant=quant, quant_size=32, quant_lm_head=lm_head
    )
    estimate = memory.config_weight_bytes(
        config, quant, torch.bfloat16, "cuda", 32, 32, quant_lm_head=lm_head
    )
    assert estimate.total == weight_bytes(model)


def test_the_30b_shapes_figures():
    config = shape_config("qwen3-30b-a3b")
    figures = {q: memory.config_weight_bytes(config, q).total / GB for q in (None, "fp8", "int4")}
    print("qwen3-30b-a3b weights, GB:", {q or "bf16": round(gb, 2) for q, gb in figures.items()})
    assert 60 < figures[None] < 62
    assert 30.5 < figures["fp8"] < 32.5
    assert 16 < figures["int4"] < 18
    # On the CPU quantized weights are dequantized: fp32 by default.
    assert 121 < memory.config_weight_bytes(config, "fp8", device_type="cpu").total / GB < 123


def test_a_model_too_big_is_refused_naming_its_size_the_cap_and_what_fits(tmp_path):
    config = shape_config("qwen3-30b-a3b")
    kv = memory.MIN_KV_TOKENS * memory.kv_bytes_per_token(ModelConfig.from_dict(config))
    bf16 = memory.config_weight_bytes(config)
    src = tmp_path / "Qwen3-Coder-30B-A3B"
    how = memory.quantize_command(src)
    with pytest.raises(memory.NotEnoughGpuMemory) as caught:
        memory.check_fits("Qwen3-Coder-30B-A3B", bf16, config, _budget(40), kv, how)
    message = str(caught.value)
    print(message)
    assert isinstance(caught.value, ModelFormatError) and "\n" not in message
    assert message.startswith("Qwen3-Coder-30B-A3B needs 61.1 GB of GPU memory")
    assert "in bf16" in message and "40.0 GB allowed (--gpu-memory-gb)" in message
    assert "an FP8 copy needs ~31 GB and an int4 copy ~17 GB" in message
    assert message.endswith(f"`wd-engine quantize --to fp8 {src} {src}-fp8`")
    # 24 GB: only int4 fits.
    with pytest.raises(memory.NotEnoughGpuMemory, match=r"24\.0 GB.*--to int4"):
        memory.check_fits("m", bf16, config, _budget(24), kv, how)
    # 12 GB: nothing does.
    with pytest.raises(memory.NotEnoughGpuMemory, match="neither fits"):
        memory.check_fits("m", bf16, config, _budget(12), kv, how)
    # FP8 weights that fit alone but not with the KV cache's minimum and the reserve.
    fp8_weights = memory.config_weight_bytes(config, "fp8")
    with pytest.raises(memory.NotEnoughGpuMemory) as caught:
        memory.check_fits("m", fp8_weights, config, _budget(32), kv, lambda f: f"`--quant {f}`")
    message = str(caught.value)
    assert "31.2 GB" in message and "in fp8 and" in message and "KV cache" in message
    assert "FP8 copy" not in message and message.endswith(
        "an int4 copy needs ~17 GB: `--quant int4`"
    )
    # Without a cap the free memory is the budget, and it is named.
    with pytest.raises(memory.NotEnoughGpuMemory, match=r"16\.7 GB .* 12\.0 GB free on cuda:0$"):
        memory.check_fits(
            "m",
            memory.config_weight_bytes(config, "int4"),
            config,
            _budget(12, "free on cuda:0", capped=False),
            kv,
            how,
        )
    with pytest.raises(memory.NotEnoughGpuMemory, match="~17 GB: that does not fit either"):
        memory.check_fits("m", fp8_weights, config, _budget(12), kv, how)
    # What fits passes.
    memory.check_fits("m", fp8_weights, config, _budget(40), kv, how)
    memory.check_fits("m", bf16, config, _budget(80), kv, how)


def test_a_folder_is_checked_from_its_headers(checkpoint_factory, monkeypatch):
    folder = checkpoint_factory()
    weights = memory.checkpoint_weight_bytes(folder, "auto", "cuda").total
    kv = memory.MIN_KV_TOKENS * memory.kv_bytes_per_token(ModelConfig.from_dir(folder))

    def budget_of(gb):
        return lambda device, cap_gb, log: _budget(gb)

    fits = (weights + kv + memory.RESERVE_BYTES) / GB
    monkeypatch.setattr(memory, "gpu_budget", budget_of(fits + 0.01))
    assert memory.check_before_load("cuda", fits + 0.01, None, model_dir=folder).bytes
    monkeypatch.setattr(memory, "gpu_budget", budget_of(fits - 0.01))
    with pytest.raises(memory.NotEnoughGpuMemory, match=rf"^{folder.name} needs [\d.]+ MB"):
        memory.check_before_load("cuda", fits - 0.01, None, model_dir=folder)
    # A quantized folder's smaller copy comes from its unquantized checkpoint.
    assert memory.quantize_command(folder, quantized=True)("int4") == (
        "`wd-engine quantize --to int4 SRC DST` of its unquantized checkpoint"
    )
    # Random weights: the config and the format; the hint is the flag.
    monkeypatch.setattr(memory, "gpu_budget", budget_of(24))
    with pytest.raises(memory.NotEnoughGpuMemory, match="add `--quant int4`$"):
        memory.check_before_load(
            "cuda", 24, None, config=shape_config("qwen3-30b-a3b"), name="random qwen3-30b-a3b"
        )
    memory.check_before_load("cuda", 24, None, config=shape_config("qwen3-30b-a3b"), quant="int4")


def test_off_cuda_the_cap_applies_to_nothing_and_says_so(caplog):
    log = logging.getLogger("wd_engine")
    with caplog.at_level(logging.WARNING, "wd_engine"):
        assert memory.check_before_load("cpu", 1.0, log, model_dir="/nonexistent") is None
    assert "ignored on cpu" in caplog.text
    caplog.clear()
    assert memory.gpu_budget("cpu", None, log) is None and not caplog.text


class FakeCuda:
    """torch.cuda's memory calls on a machine with no GPU: a 141 GB device, `free` of it free."""

    def __init__(self, monkeypatch, free_gb: float, total_gb: float = 141.0):
        self.free, self.total, self.fraction = int(free_gb * GB), int(total_gb * GB), None
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index: (self.free, self.total))
        monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", self._set)

    def _set(self, fraction, index):
        self.fraction = fraction


def test_the_cap_becomes_the_allocators_fraction(monkeypatch, caplog):
    log = logging.getLogger("wd_engine")
    cuda = FakeCuda(monkeypatch, free_gb=140)
    budget = memory.gpu_budget("cuda", 40, log)
    assert budget == memory.GpuBudget("cuda:0", 40 * GB, "allowed (--gpu-memory-gb)", True)
    assert cuda.fraction == pytest.approx(40 / 141)
    # No cap: the free memory is the budget, and the allocator is left alone.
    cuda.fraction = None
    assert memory.gpu_budget("cuda:0", None, log) == memory.GpuBudget(
        "cuda:0", 140 * GB, "free on cuda:0", False
    )
    assert cuda.fraction is None
    # More than the device has: the device.
    cuda.free = cuda.total
    with caplog.at_level(logging.WARNING, "wd_engine"):
        assert memory.gpu_budget("cuda", 200, log).bytes == 141 * GB
    assert cuda.fraction == 1.0 and "more than cuda:0 has" in caplog.text
    # Another process holds part of the device: what is free is what there is.
    cuda.free = 30 * GB
    budget = memory.gpu_budget("cuda", 40, log)
    assert budget.bytes == 30 * GB and budget.capped and "free on cuda:0" in budget.what
    with pytest.raises(ValueError, match="positive"):
        memory.gpu_budget("cuda", 0, log)


def test_under_a_cap_the_kv_pool_takes_what_the_weights_and_reserve_leave():
    cap = _budget(40)
    used, reserve, least = 31 * GB, memory.RESERVE_BYTES, 1 * GB
    left = 40 * GB - used - reserve
    assert memory.capped_kv_pool_bytes(cap, used, None, least) == left
    assert memory.capped_kv_pool_bytes(cap, used, 3 << 30, least) == 3 << 30  # as asked
    with pytest.raises(memory.NotEnoughGpuMemory, match=r"\(--kv-memory-mb\) does not fit"):
        memory.capped_kv_pool_bytes(cap, used, left + 1, least)
    with pytest.raises(memory.NotEnoughGpuMemory, match="no room for the KV cache"):
        memory.capped_kv_pool_bytes(cap, 40 * GB - reserve - least + 1, None, least)
    assert memory.capped_kv_pool_bytes(cap, 40 * GB - reserve - least, None, least) == least


def test_serves_kv_pool_under_a_cap_and_without_one(monkeypatch):
    config = ModelConfig.from_dict(shape_config("qwen3-30b-a3b"))
    model = SimpleNamespace(config=config, dtype=torch.bfloat16, device=torch.device("cuda"))
    monkeypatch.setattr(memory, "gpu_bytes_in_use", lambda device: 31 * GB)
    left = 40 * GB - 31 * GB - memory.RESERVE_BYTES
    assert cli.kv_pool_bytes(None, model, _budget(40)) == left
    assert cli.kv_pool_bytes(1024, model, _budget(40)) == 1 << 30  # --kv-memory-mb wins
    with pytest.raises(memory.NotEnoughGpuMemory):
        cli.kv_pool_bytes(8 * 1024, model, _budget(40))
    FakeCuda(monkeypatch, free_gb=50)  # no cap: half of what is free, as before
    assert cli.kv_pool_bytes(None, model, _budget(140, "free on cuda:0", False)) == 25 * GB
    cpu = SimpleNamespace(config=config, dtype=torch.float32, device=torch.device("cpu"))
    assert cli.kv_pool_bytes(None, cpu, None) == 256 << 20


@pytest.mark.parametrize("kv_fp8", [False, True])
def test_kv_bytes_per_token_match_the_pool(kv_fp8):
    config = ModelConfig.from_dict(shape_config("qwen3-30b-a3b"))
    pool = KVPool(
        config.num_layers,
        1,
        1,
        config.num_kv_heads,
        config.head_dim,
        torch.bfloat16,
        "meta",
        kv_fp8,
    )
    assert memory.kv_bytes_per_token(config, torch.bfloat16, kv_fp8) == pool.bytes_per_token()


def test_serve_logs_weight_and_kv_gigabytes():
    model = random_model(dict(TINY, vocab_size=512), dtype=torch.float32)
    pool = KVPool(2, 10, 16, 2, 16, torch.float32, "cpu")
    line = memory.describe(model, pool, _budget(40))
    assert line == (
        f"weights {weight_bytes(model) / 1e6:.3g} MB, KV pool "
        f"{pool.bytes_per_token() * 160 / 1e6:.3g} MB (160 tokens), "
        "under the 40.0 GB allowed (--gpu-memory-gb)"
    )


def test_a_broken_header_is_a_format_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    (tmp_path / "model.safetensors").write_bytes(
        b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!"
    )
    with pytest.raises(ModelFormatError, match="unreadable safetensors header"):
        memory.checkpoint_weight_bytes(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 8)
    with pytest.raises(ModelFormatError, match="not a safetensors file"):
        memory.checkpoint_weight_bytes(tmp_path)


def test_serve_and_generate_refuse_before_loading(monkeypatch, tmp_path, capsys):
    """The commands' wiring, with a CUDA budget faked on a machine without a GPU: the check runs
    before any weight is made or read, and its reason is the command's error."""
    budgets = []

    def fake_budget(device, cap_gb, log):
        budgets.append((str(device), cap_gb))
        return _budget(cap_gb)

    monkeypatch.setattr(memory, "gpu_budget", fake_budget)
    monkeypatch.setattr(cli, "_setup_logging", lambda args: logging.getLogger("wd_engine"))
    monkeypatch.setattr(cli, "_random_model", lambda *a: pytest.fail("weights were made"))
    argv = ["serve", "--socket", str(tmp_path / "engine.sock"), "--device", "cuda"]
    assert cli.main([*argv, "--random-shape", "qwen3-30b-a3b", "--gpu-memory-gb", "24"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("wd-engine: cannot load model random qwen3-30b-a3b: it needs 61.1 GB")
    assert err.endswith(
        "24.0 GB allowed (--gpu-memory-gb); an FP8 copy needs ~31 GB and an int4 "
        "copy ~17 GB: add `--quant int4`"
    )
    # --kv-memory-mb counts in the check: int4 weights and a 10 GB pool do not fit 24 GB.
    kv = ["--quant", "int4", "--kv-memory-mb", str(10_000)]
    assert cli.main([*argv, "--random-shape", "qwen3-30b-a3b", "--gpu-memory-gb", "24", *kv]) == 1
    assert "for a minimal KV cache and activations" in capsys.readouterr().err
    monkeypatch.setattr(cli, "default_model_dir", lambda: tmp_path / "no-model")
    assert cli.main(["generate", "--prompt", "x", "--device", "cuda", "--gpu-memory-gb", "1"]) == 1
    assert "no config.json" in capsys.readouterr().err
    assert budgets == [("cuda", 24.0), ("cuda", 24.0), ("cuda", 1.0)]


def test_a_quantized_folder_too_big_points_at_its_unquantized_checkpoint(
    checkpoint_factory, tmp_path, monkeypatch
):
    folder = quantized_folder(checkpoint_factory(), tmp_path / "fp8", "fp8", 16)
    monkeypatch.setattr(memory, "gpu_budget", lambda device, cap_gb, log: _budget(cap_gb))
    stored = memory.checkpoint_weight_bytes(folder).total
    smaller = memory.config_weight_bytes(ModelConfig.from_dir(folder).raw, "int4").total
    assert smaller < stored
    cap_gb = (memory.RESERVE_BYTES + (stored + smaller) / 2) / GB  # int4 fits, fp8 does not
    with pytest.raises(memory.NotEnoughGpuMemory) as caught:
        memory.check_before_load("cuda", cap_gb, None, model_dir=folder, kv_bytes=0)
    message = str(caught.value)
    assert message.startswith("fp8 needs ") and " in fp8 and " in message
    assert message.endswith("`wd-engine quantize --to int4 SRC DST` of its unquantized checkpoint")
