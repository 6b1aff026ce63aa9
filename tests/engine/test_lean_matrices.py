"""The lean CPU forward's weight forms (engine/model/lean_matrices.py) against plain fp32 products,
on fresh random inputs, and the int8 form's exact best logits."""

import pytest
import torch

from engine.loading.random_model import TINY, random_model
from engine.model.lean_matrices import (
    FORMS,
    INPUT_DTYPE,
    MODEL_FP32,
    Fp32Matrix,
    Int4Matrix,
    Int8Matrix,
    ModelFp32Matrix,
    int4_codes,
    int8_available,
    matrix,
)
from engine.model.options import ModelOptions

pytestmark = pytest.mark.skipif(not int8_available(), reason="this torch lacks _weight_int8pack_mm")


def _weights(out, inp, seed=0):
    """Rows of very different magnitudes, so each row's scale matters."""
    g = torch.Generator().manual_seed(seed)
    return 0.02 * torch.randn(out, inp, generator=g) * torch.exp(torch.randn(out, 1, generator=g))


def _dequantized(m: Int8Matrix) -> torch.Tensor:
    return m.q.float() * m.scale.float()[:, None]


def test_int8_rounds_each_weight_to_half_its_rows_step():
    w = _weights(96, 64)
    m = Int8Matrix(w)
    assert m.q.dtype == torch.int8 and m.scale.dtype == torch.bfloat16 and m.q.is_contiguous()
    assert m.q.abs().max() <= 127 and (m.q.abs().amax(1) >= 126).all()  # each row uses its range
    step = m.scale.float()[:, None]
    assert ((_dequantized(m) - w).abs() <= 0.51 * step).all()
    assert m.nbytes == 96 * 64 + 96 * 2


def test_int8_folds_the_norm_weight_into_the_columns():
    w, norm = (
        _weights(32, 48, seed=1),
        1 + torch.rand(48, generator=torch.Generator().manual_seed(2)),
    )
    m = Int8Matrix(w, norm)
    assert ((_dequantized(m) - w * norm).abs() <= 0.51 * m.scale.float()[:, None]).all()


def test_an_all_zero_row_stays_zero_with_a_normal_scale():
    w = _weights(8, 64, seed=3)
    w[5] = 0
    m = Int8Matrix(w)
    assert not m.q[5].any() and m.scale[5] > 0
    for rows in (1, 3):
        y = m.mm(torch.randn(rows, 64))
        assert not y[:, 5].any() and torch.isfinite(y).all()


@pytest.mark.parametrize("rows", [1, 3, 9])
def test_int8_products_match_the_dequantized_weights(rows):
    w = _weights(96, 64, seed=4)
    m = Int8Matrix(w)
    g = torch.Generator().manual_seed(5)
    x, add = torch.randn(rows, 64, generator=g), torch.randn(rows, 96, generator=g)
    # The kernel's inputs are bf16 activations; its sums are fp32, its results bf16.
    want = x.to(torch.bfloat16).float() @ _dequantized(m).t()
    tol = dict(rtol=2**-7, atol=2**-7 * want.abs().max().item())
    got = m.mm(x)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, **tol)
    torch.testing.assert_close(m.mm(x.to(torch.bfloat16)), got, rtol=0, atol=0)  # bf16 in: the same
    torch.testing.assert_close(m.addmm(add, x), add + want, **tol)
    assert m.addmm(add, x).dtype == torch.float32
    torch.testing.assert_close(m.addmm(add, x, alpha=0.5), add + 0.5 * want, **tol)
    torch.testing.assert_close(m.addmm(add[0], x, alpha=0.5), add[0] + 0.5 * want, **tol)
    # Against the fp32 weights themselves: the int8 step and bf16 rounding, a few per cent at most.
    exact = x @ w.t()
    assert ((got.float() - exact).abs().max() / exact.abs().max()) < 0.03


def test_fp32_products_are_the_plain_ones():
    w, norm = (
        _weights(96, 64, seed=6),
        1 + torch.rand(64, generator=torch.Generator().manual_seed(7)),
    )
    m = Fp32Matrix(w, norm)
    assert m.t.shape == (96, 64) and m.t.t().is_contiguous()  # [in, out] storage
    g = torch.Generator().manual_seed(8)
    x, add = torch.randn(5, 64, generator=g), torch.randn(5, 96, generator=g)
    want = x @ (w * norm).t()
    close = dict(rtol=1e-5, atol=1e-5)
    # Five rows take the matrix product, one row the matrix-vector one: the same values.
    for rows in (slice(None), slice(0, 1)):
        torch.testing.assert_close(m.mm(x[rows]), want[rows], **close)
        torch.testing.assert_close(m.addmm(add[rows], x[rows]), add[rows] + want[rows], **close)
        torch.testing.assert_close(
            m.addmm(add[rows], x[rows], alpha=2.0), add[rows] + 2 * want[rows], **close
        )
    torch.testing.assert_close(m.addmm(add[0], x[:1], alpha=2.0), add[:1] + 2 * want[:1], **close)
    assert m.mm(x[:1]).shape == (1, 96)
    assert m.nbytes == 96 * 64 * 4


def test_model_fp32_products_read_the_models_weights_in_place():
    w, norm = (
        _weights(96, 64, seed=16),
        1 + torch.rand(64, generator=torch.Generator().manual_seed(17)),
    )
    m = ModelFp32Matrix(w, norm)
    assert m.w is w and m.nbytes == 0  # no copy
    g = torch.Generator().manual_seed(18)
    x, add = torch.randn(5, 64, generator=g), torch.randn(5, 96, generator=g)
    want = x @ (w * norm).t()
    close = dict(rtol=1e-5, atol=1e-5)
    for rows in (slice(None), slice(0, 1), 0):  # rows, one row, a vector
        torch.testing.assert_close(m.mm(x[rows]), want[rows], **close)
        torch.testing.assert_close(
            m.addmm(add[rows], x[rows], alpha=0.5), add[rows] + 0.5 * want[rows], **close
        )
    torch.testing.assert_close(ModelFp32Matrix(w).mm(x), x @ w.t(), **close)


def test_forms_are_named():
    w = _weights(8, 16)
    assert isinstance(matrix("int8", w), Int8Matrix) and isinstance(matrix("fp32", w), Fp32Matrix)
    assert set(FORMS) | {MODEL_FP32} == set(INPUT_DTYPE)
    assert isinstance(matrix(MODEL_FP32, w), ModelFp32Matrix)
    with pytest.raises(ValueError, match="lean decode weights are one of"):
        matrix("int2", w)
    with pytest.raises(ValueError, match="not int4 groups of 32 exactly"):
        matrix("int4", _weights(16, 64))


def test_int8_logits_are_exact_where_greedy_looks():
    """The lm_head's int8 logits near a row's best are computed again in fp32: the best logit and
    its neighbours within the margin equal fp32's, so greedy picks what fp32 picks."""
    from engine.model.lean_cpu import LEAN_EXACT_MARGIN

    model = random_model(
        dict(TINY, vocab_size=2048),
        dtype=torch.float32,
        seed=11,
        options=ModelOptions(lean_weights="int8"),
    )
    g = torch.Generator().manual_seed(12)
    h = torch.randn(6, model.config.hidden_size, generator=g) * 3
    got = model.lean.logits(h.clone())
    exact = (h * model.final_norm) @ model.lm_head.t()
    approx = matrix("int8", model.lm_head, model.final_norm).mm(h).float()
    assert got.shape == exact.shape == (6, 2048)
    near = approx >= approx.amax(-1, keepdim=True) - LEAN_EXACT_MARGIN
    torch.testing.assert_close(got[near], exact[near], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[~near], approx[~near], rtol=0, atol=0)
    assert torch.equal(got.argmax(-1), exact.argmax(-1))
    assert (approx != exact).any()  # int8 rounding is there to be corrected


def test_each_form_computes_with_its_own_weights():
    base = random_model(dict(TINY, vocab_size=512), dtype=torch.float32, seed=13)
    cache = base.new_cache(1)
    base.forward(torch.tensor([[1, 2, 3]]), torch.arange(3)[None], cache)
    logits = {}
    for form in ("int8", "fp32", "int8"):
        model = base.with_options(lean_weights=form)
        cache.used = 3
        logits.setdefault(form, []).append(
            model.forward(torch.tensor([[4]]), torch.tensor([[3]]), cache)
        )
        assert isinstance(model.lean.layers[0].w_qkv, Int8Matrix if form == "int8" else Fp32Matrix)
    torch.testing.assert_close(logits["int8"][0], logits["int8"][1], rtol=0, atol=0)
    assert not torch.equal(logits["int8"][0], logits["fp32"][0])


def test_the_default_form_holds_the_weights_exactly():
    """The default lean step computes as prefill does (fp32 for a model not trained through int4
    groups); int8 is asked for."""
    model = random_model(dict(TINY, vocab_size=512), dtype=torch.float32)
    assert model.options.lean_weights == "auto" and model.lean.form == "fp32"
    assert ModelOptions(lean_weights="int8").lean_weights == "int8"
    with pytest.raises(ValueError, match="lean_weights"):
        ModelOptions(lean_weights="int2")


def exact_int4_group(matrices):
    """The group size at which every matrix is int4 groups exactly, or None."""
    found = int4_codes(matrices)
    return found[0] if found else None


def _int4_exact(out, inp, group, seed=0):
    """Weights on the int4 grid of `group` columns, as a model trained through it has."""
    from engine.loading import int4

    q, scale = int4.quantize(_weights(out, inp, seed), group)
    return (q.float().unflatten(1, (-1, group)) * scale[..., None]).flatten(1)


@pytest.mark.parametrize("group", [32, 64])
def test_int4_holds_weights_trained_through_int4_exactly(group):
    w = _int4_exact(48, 128, group, seed=group)
    assert exact_int4_group([w]) == group
    m = matrix("int4", w, group=group)
    assert isinstance(m, Int4Matrix)
    # One-hot rows read the weights back: every value as stored, no rounding.
    assert torch.equal(m.mm(torch.eye(128)).float(), w.t())
    g = torch.Generator().manual_seed(1)
    x, add = torch.randn(5, 128, generator=g), torch.randn(5, 48, generator=g)
    in_scale = 1 + 0.2 * torch.randn(128, generator=g)
    want = (x * in_scale) @ w.t()
    close = dict(rtol=2e-2, atol=2e-2 * want.abs().max().item())  # bf16 activations and outputs
    scaled = matrix("int4", w, in_scale, group=group)
    torch.testing.assert_close(scaled.mm(x).float(), want, **close)
    torch.testing.assert_close(scaled.mm(x[0]).float(), want[0], **close)
    torch.testing.assert_close(
        scaled.addmm(add[0], x[0], alpha=0.5), add[0] + 0.5 * want[0], **close
    )
    assert m.nbytes < w.numel() * 4 / 6  # about an eighth of fp32, plus the group scales


def test_int4_group_is_the_one_the_weights_were_quantized_with():
    assert exact_int4_group([_int4_exact(32, 256, 128)]) == 128
    assert exact_int4_group([_int4_exact(32, 256, 32), _weights(32, 256)]) is None
    assert exact_int4_group([_int4_exact(8, 64, 32)]) is None  # rows the kernel can't take


def test_int4_step_of_an_int4_trained_model_matches_its_own_arithmetic():
    """A model whose projections are int4 groups (as one trained through them): the lean step on
    int4 weights gives the fp32 step's logits up to bf16 activation rounding and the same
    argmax; a model that is not int4 is refused with a clear error."""
    quantized = random_model(
        dict(TINY, vocab_size=512), dtype=torch.float32, seed=21, quant="int4", quant_size=32
    )
    base = quantized.dequantized()
    logits = {}
    for form in ("fp32", "int4"):
        model = base.with_options(lean_weights=form)
        assert not model.lean.guarded  # the default: the int4 step itself (test_lean_int4_guard)
        cache = model.new_cache(1)
        model.forward(torch.tensor([[5, 6, 7, 8]]), torch.arange(4)[None], cache)
        cache.used = 4
        logits[form] = model.forward(torch.tensor([[9]]), torch.tensor([[4]]), cache)[0, -1]
    assert isinstance(model.lean.layers[0].w_o, Int4Matrix)  # the step ran on int4 weights
    rel = (logits["int4"] - logits["fp32"]).norm() / logits["fp32"].norm()
    assert 0 < rel.item() < 2e-2
    assert logits["int4"].argmax() == logits["fp32"].argmax()
    plain = random_model(dict(TINY, vocab_size=512), dtype=torch.float32, seed=21)
    with pytest.raises(ValueError, match="trained through int4"):
        plain.with_options(lean_weights="int4")
    assert plain.lean.form == "fp32" and base.lean.form == "int4"  # what "auto" takes
