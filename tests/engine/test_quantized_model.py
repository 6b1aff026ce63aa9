"""A model whose projections stay quantized (FP8 blocks, int4 groups: kernels.quant), as a
quantized checkpoint loads on CUDA, against the same model with those weights dequantized.

On the CPU the general path dequantizes each weight where it multiplies (kernels.quant_linear,
kernels.dispatch), and the decode step runs through Triton's interpreter: the same code the GPU
runs, over the same stored bytes.
"""

import pytest
import torch
from checkpoints import quantized_folder

from engine.kv.pool import KVPool, PagedBatch
from engine.loading.loader import load_model
from engine.loading.random_model import TINY, random_model
from engine.model.cuda_graph import DecodeStep
from engine.model.options import ModelOptions
from engine.model.qwen3_moe import weight_bytes
from engine.model.step_kernels import default_fusions
from kernels.quant import Fp8Weight, Int4Weight, is_quantized

FORMATS = [("fp8", 16), ("int4", 16), ("int4", 32)]


def _pool(model) -> KVPool:
    cfg = model.config
    return KVPool(cfg.num_layers, 8, 4, cfg.num_kv_heads, cfg.head_dim, model.dtype, model.device)


def _logits(model, tokens):
    n = len(tokens)
    cache = model.new_cache(1, n)
    return model.forward(torch.tensor([tokens]), torch.arange(n)[None], cache)


@pytest.mark.parametrize("fmt,size", [("fp8", 16), ("int4", 16)])  # 16 divides 64, 32, 48
def test_a_quantized_folder_kept_quantized_computes_its_dequantized_weights(
    checkpoint_factory, tmp_path, fmt, size
):
    folder = quantized_folder(checkpoint_factory(), tmp_path / fmt, fmt, size)
    kept = load_model(folder, keep_quantized=True)
    plain = load_model(folder, keep_quantized=False)
    kind = Fp8Weight if fmt == "fp8" else Int4Weight
    layer = kept.layers[0]
    # q/k/v and gate/up joined as stored; the experts stacked; norms and router plain.
    assert all(isinstance(w, kind) for w in (layer.w_qkv, layer.w_o, layer.w_gate_up))
    assert isinstance(layer.w_down, kind) and isinstance(layer.router, torch.Tensor)
    assert not plain.quantized and kept.quantized and not kept.lean_path_applies()
    assert weight_bytes(kept) < weight_bytes(plain)
    tokens = torch.randint(
        3, kept.config.vocab_size, (12,), generator=torch.Generator().manual_seed(1)
    )
    torch.testing.assert_close(
        _logits(kept, tokens.tolist()), _logits(plain, tokens.tolist()), atol=1e-4, rtol=1e-4
    )


@pytest.mark.parametrize("fmt,size", FORMATS)
def test_random_quantized_model_equals_its_dequantized_copy(fmt, size):
    # The general path on both sides: the dequantized copy would otherwise run short prompts on
    # the lean forward (its int4 step where the groups are exact), not the arithmetic compared.
    general = ModelOptions(lean_decode=False)
    model = random_model(
        TINY, dtype=torch.float32, seed=3, quant=fmt, quant_size=size, options=general
    )
    assert model.quantized and is_quantized(model.layers[1].w_down)
    plain = model.dequantized()
    assert not plain.quantized
    tokens = list(range(5, 30, 3))
    torch.testing.assert_close(_logits(model, tokens), _logits(plain, tokens), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "fmt,size,lm_head",
    [("fp8", 16, False), ("int4", 32, False), ("fp8", 16, True), ("int4", 16, True)],
)
def test_the_decode_step_reads_quantized_weights(fmt, size, lm_head):
    """The fused decode step (interpreter) over the stored weights gives the logits of the same
    step over the dequantized ones; `lm_head`: the model's own lm_head is quantized too. The
    step takes the engine's fusions for its weight format."""
    general = ModelOptions(lean_decode=False)  # the prompt by the general path on both sides
    config = dict(TINY, vocab_size=512, tie_word_embeddings=False) if lm_head else TINY
    model = random_model(
        config,
        dtype=torch.float32,
        seed=4,
        quant=fmt,
        quant_size=size,
        options=general,
        quant_lm_head=lm_head,
    )
    assert is_quantized(model.lm_head) == lm_head
    assert DecodeStep(model, _pool(model), rows=1, max_blocks=8).ops.fusions == default_fusions(
        fmt, 1
    )
    logits = []
    for m in (model, model.dequantized()):
        pool = _pool(m)
        table = list(range(8))
        prompt = [7, 11, 13, 17, 19]
        m.forward(torch.tensor([prompt]), torch.arange(5)[None], PagedBatch(pool, [table], "cpu"))
        step = DecodeStep(m, pool, rows=1, max_blocks=8)
        step.load([23], [5], [table])
        step()
        logits.append(step.logits.clone())
    torch.testing.assert_close(logits[0], logits[1], atol=1e-4, rtol=1e-4)


def test_a_quantized_lm_head_needs_quantized_projections_and_an_own_head():
    with pytest.raises(ValueError, match="own lm_head"):
        random_model(TINY, quant="fp8", quant_size=16, quant_lm_head=True)  # tied
    with pytest.raises(ValueError, match="own lm_head"):
        random_model(dict(TINY, tie_word_embeddings=False), quant_lm_head=True)
