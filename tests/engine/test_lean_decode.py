"""The CPU's lone decode path (one sequence, one token, fp32) against the general path and the
reference ops it replaces, on fresh random inputs."""

import dataclasses

import pytest
import torch
from checkpoints import LEAN_PATH_TOLERANCE as TOLERANCE
from checkpoints import lean_path_model

from engine.kv.pool import KVPool, PagedBatch
from engine.loading.random_model import TINY, random_model
from engine.model.lean_cpu import LEAN_MAX_ROWS, LEAN_PROMPT_MAX_ROWS
from engine.model.lean_matrices import int8_available
from engine.model.options import ModelOptions
from kernels import reference as ref


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def test_rope_matrix_equals_apply_rope():
    g = torch.Generator().manual_seed(11)
    inv = ref.rope_inv_freq(64, 10000.0)
    x = torch.randn(6, 64, generator=g)
    for pos in (0, 1, 37, 4000):
        cos, sin = ref.rope_cos_sin(torch.tensor([pos]), inv, torch.float32)
        expected = ref.apply_rope(x, cos, sin)
        assert torch.allclose(x @ ref.rope_matrix(pos, inv), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("run_lengths", [[9], [3, 16, 5]])
def test_attention_lean_equals_attention_over_runs(run_lengths):
    g = torch.Generator().manual_seed(12)
    q = torch.randn(4, 16, generator=g)
    keys = [torch.randn(n, 2, 16, generator=g) for n in run_lengths]
    values = [torch.randn(n, 2, 16, generator=g) for n in run_lengths]
    seq = sum(run_lengths)
    expected = ref.attention_over_runs(q[:, None], keys, values, torch.tensor([seq - 1]))[:, 0]
    out = ref.attention_lean(q * 16**-0.5, keys, values)
    assert torch.allclose(out, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_route_one_equals_route(norm_topk_prob):
    g = torch.Generator().manual_seed(13)
    x, router = torch.randn(4, 32, generator=g), torch.randn(8, 32, generator=g)
    ids, weights = ref.route(x, router, 2, norm_topk_prob)
    for t in range(4):
        chosen = ref.route_one((x[t] @ router.T).tolist(), 2, norm_topk_prob)
        assert [e for e, _ in chosen] == ids[t].tolist()
        assert torch.allclose(
            torch.tensor([w for _, w in chosen], dtype=torch.float64),
            weights[t].double(),
            rtol=1e-6,
        )


def _decode_both(model, cache_for, steps=12, prompt=7, seed=0):
    """Prefill, then decode greedily with the lone path and the general path side by side;
    returns the relative logit difference (the worst step for fp32, the median one for int8)
    and both token lists. cache_for() gives a
    function that returns the cache argument of each forward. With int8 weights the lone path
    follows the general path's tokens (teacher-forced), since near-ties of a random model may
    pick otherwise."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (1, prompt), generator=g)
    models = (model, model.with_options(lean_decode=False))
    assert models[0].lean_path_applies() and not models[1].lean_path_applies()
    caches, tokens, diffs = [cache_for(), cache_for()], [[], []], []
    for cache in caches:
        model.forward(ids, torch.arange(prompt)[None], cache())
    nxt = [int(ids[0, -1])] * 2
    form = model.lean.form
    for pos in range(prompt, prompt + steps):
        logits = []
        for i, path in enumerate(models):
            logits.append(
                path.forward(torch.tensor([[nxt[i]]]), torch.tensor([[pos]]), caches[i]())[0, -1]
            )
            tokens[i].append(int(logits[i].argmax()))
        nxt = [tokens[1][-1] if form == "int8" else tokens[0][-1], tokens[1][-1]]
        diffs.append(_rel(logits[0], logits[1]))
    return (max(diffs) if form == "fp32" else sorted(diffs)[len(diffs) // 2]), tokens


@pytest.mark.parametrize("form", ["fp32", "int8"])
@pytest.mark.parametrize("variant", ["moe", "dense_and_untied", "bias"])
def test_lean_decode_matches_general_path_paged(variant, form):
    model = lean_path_model(variant, form)
    c = model.config
    # Blocks out of order, so the keys lie in several runs of slots.
    table = [5, 2, 3, 0]

    def paged():
        pool = KVPool(c.num_layers, 6, 4, c.num_kv_heads, c.head_dim, torch.float32, "cpu")
        return lambda: PagedBatch(pool, [table], "cpu")  # a view per forward, as the engine makes

    worst, (lone, general) = _decode_both(model, paged, steps=9)
    assert 0 < worst < TOLERANCE[form]
    agree = sum(a == b for a, b in zip(lone, general))
    assert agree == len(general) if form == "fp32" else agree >= len(general) - 2


@pytest.mark.parametrize("form", ["fp32", "int8"])
def test_lean_decode_matches_general_path_contiguous(form):
    model = random_model(
        dict(TINY, vocab_size=512),
        dtype=torch.float32,
        seed=5,
        options=ModelOptions(lean_weights=form),
    )

    def contiguous():
        cache = model.new_cache(1, capacity=8)  # grows (doubling) during the test
        return lambda: cache

    worst, (lone, general) = _decode_both(model, contiguous)
    assert 0 < worst < TOLERANCE[form]
    agree = sum(a == b for a, b in zip(lone, general))
    assert agree == len(general) if form == "fp32" else agree >= len(general) - 2


def test_lean_path_is_skipped_where_it_does_not_apply():
    model = random_model(dict(TINY, vocab_size=512), dtype=torch.float32, seed=6)
    c = model.config
    pool = KVPool(c.num_layers, 4, 4, c.num_kv_heads, c.head_dim, torch.float32, "cpu", fp8=True)
    assert PagedBatch(pool, [[0, 1]], "cpu").lean_rows(3, 1) is None  # fp8 storage
    pool = KVPool(c.num_layers, 4, 4, c.num_kv_heads, c.head_dim, torch.float32, "cpu")
    assert PagedBatch(pool, [[0], [1]], "cpu").lean_rows(3, 1) is None  # two rows
    cache = model.new_cache(1)
    cache.used = 5
    assert cache.lean_rows(7, 1) is None  # positions 5 and 6 were never written
    assert model.new_cache(2).lean_rows(0, 1) is None  # two rows
    assert not random_model(dict(TINY, vocab_size=512), dtype=torch.bfloat16).lean_path_applies()


def test_a_contiguous_cache_serves_a_rewrite_of_an_earlier_position():
    model = random_model(
        dict(TINY, vocab_size=512),
        dtype=torch.float32,
        seed=14,
        options=ModelOptions(lean_weights="fp32"),
    )
    general = model.with_options(lean_decode=False)
    g = torch.Generator().manual_seed(15)
    prompt = torch.randint(0, model.config.vocab_size, (1, 5), generator=g)
    token = torch.randint(0, model.config.vocab_size, (1, 1), generator=g)
    lean_cache, general_cache = model.new_cache(1), model.new_cache(1)
    model.forward(prompt, torch.arange(5)[None], lean_cache)
    general.forward(prompt, torch.arange(5)[None], general_cache)
    # The run stops at the rewritten position, so the stale keys at 3 and 4 are never read.
    assert lean_cache.lean_rows(2, 1) == ([2], [(0, 3)])
    assert model.lean_path_applies()
    lean = model.forward(token, torch.tensor([[2]]), lean_cache)[0, -1]
    expected = general.forward(token, torch.tensor([[2]]), general_cache)[0, -1]
    assert 0 < _rel(lean, expected) < TOLERANCE["fp32"]  # > 0: the lean forward ran


def test_short_cpu_forwards_leave_the_thread_count_as_they_found_it():
    model = random_model(dict(TINY, vocab_size=512), dtype=torch.float32, seed=7)
    threads = torch.get_num_threads()
    cache = model.new_cache(1)
    model.forward(torch.tensor([[1, 2, 3]]), torch.arange(3)[None], cache)
    model.forward(torch.tensor([[4]]), torch.tensor([[3]]), cache)
    assert torch.get_num_threads() == threads


def test_a_model_past_the_small_size_runs_the_general_path_without_copies(monkeypatch):
    from engine.model import cpu_threads
    from engine.model import qwen3_moe as model_module

    monkeypatch.setattr(model_module, "CPU_SMALL_MODEL_MAX_BYTES", 1000)
    model = random_model(dict(TINY, vocab_size=512), dtype=torch.float32, seed=8)
    assert not model.small_on_cpu and not model.lean_path_applies()
    model.prepare_lean_decode()
    assert model.lean is None  # no second copy of a big model's weights
    threads_seen = []
    monkeypatch.setattr(
        cpu_threads, "intra_op_threads", lambda *_: threads_seen.append(1)
    )  # must not be entered
    cache = model.new_cache(1)
    model.forward(torch.tensor([[1, 2]]), torch.arange(2)[None], cache)
    logits = model.forward(torch.tensor([[3]]), torch.tensor([[2]]), cache)
    assert torch.isfinite(logits).all() and not threads_seen


def test_path_switches_turn_the_lean_path_off():
    model = random_model(dict(TINY, vocab_size=512), dtype=torch.float32, seed=9)
    assert model.lean_path_applies()
    assert not model.with_options(moe_path="expert_centric").lean_path_applies()
    assert not model.with_options(moe_fn=ref.moe_output_centric).lean_path_applies()
    assert not model.with_options(lean_decode=False).lean_path_applies()
    assert model.with_options(moe_path="auto").lean_path_applies()


def test_options_are_fixed_and_another_model_shares_the_weights():
    model = random_model(dict(TINY, vocab_size=512), dtype=torch.float32, seed=10)
    fp32 = model.with_options(lean_weights="fp32")
    assert fp32.options.lean_weights == "fp32" and fp32.options.moe_path == "auto"
    assert fp32.embed is model.embed and fp32.layers is model.layers
    assert fp32.lm_head is model.lm_head and fp32.final_norm is model.final_norm
    general = model.with_options(lean_decode=False)
    assert general.lean is None and model.lean is not None
    # The same form: the lean forward's weight copies are shared too; another form builds its own.
    assert model.with_options(moe_path="auto").lean is model.lean
    if int8_available():
        assert model.with_options(lean_weights="int8").lean is not fp32.lean
    with pytest.raises(dataclasses.FrozenInstanceError):
        model.options.moe_path = "expert_centric"
    with pytest.raises(ValueError, match="moe_path"):
        model.with_options(moe_path="fastest")
    with pytest.raises(ValueError, match="lean_weights"):
        model.with_options(lean_weights="int2")


@pytest.mark.parametrize("form", ["fp32", "int8"])
def test_a_lone_prefills_last_logits_come_from_the_lean_head(form):
    """One sequence's prefill with last_only takes the lean path's lm_head (faster in the one-row
    case): fp32 gives the general path's logits up to rounding; int8 gives its best logit
    exactly."""
    model = lean_path_model("dense_and_untied", form)
    n = LEAN_PROMPT_MAX_ROWS + 5  # a prompt the general path computes, all but its head
    ids = torch.randint(
        0, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(21)
    )
    last = model.forward(ids, torch.arange(n)[None], model.new_cache(1, n), last_only=True)[0, -1]
    full = model.forward(ids, torch.arange(n)[None], model.new_cache(1, n))[0, -1]
    assert last.shape == full.shape
    if form == "fp32":
        assert _rel(last, full) < 1e-5
    else:
        assert 0 < _rel(last, full) < TOLERANCE[form]
        best = int(full.argmax())
        assert int(last.argmax()) == best
        torch.testing.assert_close(last[best], full[best], rtol=1e-5, atol=1e-5)
    # Two sequences take the general head.
    both = model.forward(
        ids.expand(2, -1),
        torch.arange(n)[None].expand(2, -1),
        model.new_cache(2, n),
        last_only=True,
    )
    torch.testing.assert_close(both[0, -1], full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("steps", [1, 3])
def test_one_beam_decodes_as_the_lean_step_does(steps):
    """A beam search's forward of a single beam (computed as one row) against plain decode steps
    of the same tokens: the beam's own keys in its tails, the steps' in the cache."""
    from engine.decoding.beam_search import BeamTails

    model = lean_path_model("moe", "fp32")
    c = model.config
    g = torch.Generator().manual_seed(23)
    prompt = torch.randint(0, c.vocab_size, (1, 6), generator=g)
    tokens = torch.randint(0, c.vocab_size, (steps,), generator=g).tolist()
    beam_cache, step_cache = model.new_cache(1, 16), model.new_cache(1, 16)
    for cache in (beam_cache, step_cache):
        model.forward(prompt, torch.arange(6)[None], cache)
    tails = BeamTails(c.num_layers)
    for i, token in enumerate(tokens):
        beam = model.forward_beams([token], 6 + i, beam_cache, tails)
        step = model.forward(torch.tensor([[token]]), torch.tensor([[6 + i]]), step_cache)[0]
        assert beam.shape == step.shape == (1, c.vocab_size)
        assert _rel(beam, step) < TOLERANCE["fp32"]
    assert tails.length == steps


@pytest.mark.parametrize("new_tokens", [2, LEAN_MAX_ROWS + 1, LEAN_PROMPT_MAX_ROWS])
def test_a_prompts_short_tail_takes_the_lean_forward(new_tokens):
    # A prompt's few tokens (after a cache hit here) run on the lean forward: the same logits as
    # the general path's within fp32 rounding (> 0: the lean forward ran), every row or the last.
    model = lean_path_model("moe", "fp32")
    general = model.with_options(lean_decode=False)
    g = torch.Generator().manual_seed(22)
    cached_len = LEAN_PROMPT_MAX_ROWS + 8  # longer: computed by the general path
    cached = torch.randint(0, model.config.vocab_size, (1, cached_len), generator=g)
    tail = torch.randint(0, model.config.vocab_size, (1, new_tokens), generator=g)
    positions = torch.arange(cached_len, cached_len + new_tokens)[None]
    for last_only in (False, True):
        lean_cache, general_cache = model.new_cache(1), model.new_cache(1)
        model.forward(cached, torch.arange(cached_len)[None], lean_cache)
        general.forward(cached, torch.arange(cached_len)[None], general_cache)
        steps_before = model.lean.steps
        lean = model.forward(tail, positions, lean_cache, last_only=last_only)
        assert model.lean.steps == steps_before + 1
        expected = general.forward(tail, positions, general_cache, last_only=last_only)
        assert lean.shape == expected.shape == (1, 1 if last_only else new_tokens, 512)
        assert 0 < _rel(lean, expected) < TOLERANCE["fp32"]
    # Past LEAN_PROMPT_MAX_ROWS rows the general path runs.
    steps_before = model.lean.steps
    longer = torch.randint(0, model.config.vocab_size, (1, LEAN_PROMPT_MAX_ROWS + 1), generator=g)
    model.forward(longer, torch.arange(LEAN_PROMPT_MAX_ROWS + 1)[None], model.new_cache(1))
    assert model.lean.steps == steps_before


@pytest.mark.parametrize("form", ["fp32", "int8"])
def test_a_short_cold_prompt_takes_the_lean_forward(form):
    # A prompt of a few tokens on an empty cache (position 0 on): the lean forward computes it,
    # and the decode step after it reads the keys it wrote; against the general path throughout.
    model = lean_path_model("moe", form)
    general = model.with_options(lean_decode=False)
    g = torch.Generator().manual_seed(23)
    prompt = torch.randint(0, model.config.vocab_size, (1, 20), generator=g)
    token = torch.randint(0, model.config.vocab_size, (1, 1), generator=g)
    caches = [model.new_cache(1), general.new_cache(1)]
    steps_before = model.lean.steps
    first = [
        m.forward(prompt, torch.arange(20)[None], c, last_only=True)[0, -1]
        for m, c in zip((model, general), caches)
    ]
    after = [
        m.forward(token, torch.tensor([[20]]), c)[0, -1] for m, c in zip((model, general), caches)
    ]
    assert model.lean.steps == steps_before + 2
    for lean, expected in (first, after):
        assert 0 < _rel(lean, expected) < TOLERANCE[form]
        if form == "fp32":
            assert int(lean.argmax()) == int(expected.argmax())
