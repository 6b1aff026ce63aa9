"""The fused decode step (`engine.model.cuda_graph`) against the model's plain forward.

On the CPU the step runs eagerly through Triton's interpreter: the same code a CUDA graph
captures, so the graph-free and graph-captured step can only differ by the capture itself.
"""

import pytest
import torch

from engine.core.engine import Engine
from engine.core.options import EngineOptions
from engine.core.request import Request
from engine.kv.pool import KVPool, PagedBatch
from engine.loading.loader import load_model
from engine.loading.tokenizer import Tokenizer
from engine.model.cuda_graph import DecodeGraphs, DecodeStep
from engine.model.step_kernels import (
    DEFAULT_FUSIONS,
    FUSIONS,
    ONE_ROW_ROUTER_BLOCK_E,
    StepKernels,
    StepOps,
    default_fusions,
    step_format,
)
from kernels.counters import counters_of
from kernels.gemv import COUNTERS_USER

BLOCK = 4


@pytest.fixture(scope="module")
def tiny(checkpoint_factory):
    path = checkpoint_factory()
    return load_model(path), Tokenizer.from_dir(path)


def _pool(model, fp8=False, blocks=24):
    cfg = model.config
    return KVPool(
        cfg.num_layers,
        blocks,
        BLOCK,
        cfg.num_kv_heads,
        cfg.head_dim,
        model.dtype,
        model.device,
        fp8,
    )


def _prefill(model, pool, table, tokens):
    n = len(tokens)
    model.forward(torch.tensor([tokens]), torch.arange(n)[None], PagedBatch(pool, [table], "cpu"))


def _clone(pool):
    twin = _pool_like(pool)
    for layer in range(len(pool.keys)):
        twin.keys[layer].copy_(pool.keys[layer])
        twin.values[layer].copy_(pool.values[layer])
        if pool.fp8:
            twin.key_scales[layer].copy_(pool.key_scales[layer])
            twin.value_scales[layer].copy_(pool.value_scales[layer])
    return twin


def _pool_like(pool):
    keys = pool.keys[0]
    return KVPool(
        len(pool.keys),
        pool.num_blocks,
        pool.block_size,
        keys.shape[1],
        keys.shape[2],
        pool.dtype,
        keys.device,
        pool.fp8,
    )


def _max_rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("fused", [False, True], ids=["default", "all fusions"])
@pytest.mark.parametrize("fp8", [False, True])
def test_batched_decode_matches_forward(tiny, fp8, fused):
    """Two sequences, blocks scattered over the pool, one step each, padded to a bucket of 4;
    the engine's default step and the step with every fusion."""
    model, _ = tiny
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompts = [
        torch.randint(1, vocab, (9,), generator=g).tolist(),
        torch.randint(1, vocab, (14,), generator=g).tolist(),
    ]
    tables = [[7, 2, 11], [5, 19, 0, 3]]  # room for the next token in each
    pool = _pool(model, fp8)
    for table, prompt in zip(tables, prompts):
        _prefill(model, pool, table, prompt)
    nxt = torch.randint(1, vocab, (2,), generator=g).tolist()
    positions = [len(p) for p in prompts]

    twin = _clone(pool)
    expected = model.forward(
        torch.tensor(nxt)[:, None],
        torch.tensor(positions)[:, None],
        PagedBatch(twin, tables, "cpu"),
    )

    kernels = StepKernels(fusions=frozenset(FUSIONS if fused else DEFAULT_FUSIONS))
    step = DecodeStep(model, pool, rows=4, max_blocks=8, kernels=kernels)
    step.load(nxt, positions, tables)
    step()
    tol = 2e-2 if fp8 else 1e-4
    assert _max_rel(step.logits[:2], expected[:, 0]) < tol
    assert torch.equal(step.greedy[:2], step.logits[:2].argmax(-1))
    # The step wrote the new tokens' K/V where the plain forward did.
    for layer in range(model.config.num_layers):
        a, b = (
            pool.read(layer, torch.tensor([[7 * BLOCK + 1, 3 * BLOCK + 2]]))[0],
            twin.read(layer, torch.tensor([[7 * BLOCK + 1, 3 * BLOCK + 2]]))[0],
        )
        assert _max_rel(a, b) < (2e-2 if fp8 else 1e-5)


def test_rows_of_one_sequence_are_causal(tiny):
    """Several new tokens of one sequence as rows (a warm prompt's tail) equal a chunked prefill."""
    model, _ = tiny
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(1, model.config.vocab_size, (13,), generator=g).tolist()
    table = [4, 9, 1, 15]
    pool = _pool(model)
    _prefill(model, pool, table, tokens[:10])
    twin = _clone(pool)
    expected = model.forward(
        torch.tensor([tokens[10:]]), torch.arange(10, 13)[None], PagedBatch(twin, [table], "cpu")
    )

    graphs = DecodeGraphs(model, pool, max_tokens=64, buckets=(1, 4))
    assert not graphs.capture  # CPU: eager, same step
    logits, greedy = graphs.run(tokens[10:], [10, 11, 12], [table] * 3)
    assert logits.shape[0] == 3
    assert _max_rel(logits, expected[0]) < 1e-4


def test_kernels_chosen_at_construction_are_the_ones_the_step_runs(tiny):
    """Another projection and split count (as the benchmarks pass) give the default's logits."""
    model, _ = tiny
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(1, model.config.vocab_size, (9,), generator=g).tolist()
    table = [6, 1, 13]
    pool = _pool(model)
    _prefill(model, pool, table, tokens[:8])
    calls = []

    def counted_linear(x, w, b=None):
        calls.append(w.shape)
        return torch.nn.functional.linear(x, w, b)

    default = DecodeGraphs(model, _clone(pool), max_tokens=64, buckets=(1,))
    splits = default.steps[1].n_splits + 1
    chosen = StepKernels(linear=counted_linear, n_splits=splits)
    other = DecodeGraphs(model, _clone(pool), max_tokens=64, buckets=(1,), kernels=chosen)
    assert other.steps[1].n_splits == splits
    results = [graphs.run(tokens[8:], [8], [table])[0].clone() for graphs in (default, other)]
    assert len(calls) == 2 * model.config.num_layers  # the q/k/v and o projections of each layer
    assert _max_rel(results[1], results[0]) < 1e-5


@pytest.mark.parametrize("fusions", [(), *((name,) for name in FUSIONS)], ids=str)
def test_each_fusion_computes_what_the_separate_kernels_do(tiny, fusions):
    """The step with one fusion (or none) against the step with all of them, two rows at
    different lengths; the counters the fused kernels finish with are back at zero."""
    model, _ = tiny
    g = torch.Generator().manual_seed(5)
    vocab = model.config.vocab_size
    prompts = [torch.randint(1, vocab, (n,), generator=g).tolist() for n in (6, 11)]
    tables = [[3, 8], [1, 12, 5]]
    pool = _pool(model)
    for table, prompt in zip(tables, prompts):
        _prefill(model, pool, table, prompt[:-1])
    logits = []
    for kernels in (
        StepKernels(fusions=frozenset(FUSIONS)),
        StepKernels(fusions=frozenset(fusions)),
    ):
        step = DecodeStep(model, _clone(pool), rows=2, max_blocks=4, kernels=kernels)
        step.load([p[-1] for p in prompts], [len(p) - 1 for p in prompts], tables)
        step()
        logits.append(step.logits.clone())
        assert not step.ops.router_counters.any() and not step.ops.attention_counters.any()
        gemv_counters = counters_of(torch.device("cpu"), COUNTERS_USER)
        assert gemv_counters is None or not gemv_counters.any()
    assert _max_rel(logits[1], logits[0]) < 1e-5


@pytest.mark.parametrize(
    "weight_format,rows,pdl",
    [("fp8", 1, True), ("fp8", 8, True), ("fp8", 16, False), ("bf16", 1, True)]
    + [("bf16", 2, False), ("int4", 1, True), ("int4", 8, False), ("plain", 1, False)],
)
def test_the_engines_fusions_follow_the_weight_format_and_rows(weight_format, rows, pdl):
    """The router's fusion always; the PDL chain where the step measured faster with it, and
    in a chained step of one row the q/k/v projection's epilogue."""
    fusions = default_fusions(weight_format, rows)
    epilogue = {"qkv_epilogue"} if pdl and rows == 1 else set()
    assert fusions == DEFAULT_FUSIONS | ({"pdl"} if pdl else set()) | epilogue
    ops = StepOps(StepKernels(), rows, 2, 1e-6, "cpu", weight_format)
    assert ops.fusions == fusions and not ops.pdl  # PDL is CUDA's: the CPU runs plain launches
    # Fusions named by hand win.
    assert (
        StepOps(StepKernels(fusions=frozenset()), rows, 2, 1e-6, "cpu", weight_format).fusions
        == set()
    )


def test_a_one_row_step_routes_one_expert_a_program_unless_told():
    """The fused router's experts a program: ONE_ROW_ROUTER_BLOCK_E at one row (where it was
    timed faster), the kernel's default at more, and a benchmark's knob wins at any."""
    one, two = (StepOps(StepKernels(), rows, 2, 1e-6, "cpu", "fp8") for rows in (1, 2))
    assert (one.router_block_e, two.router_block_e) == (ONE_ROW_ROUTER_BLOCK_E, None)
    asked = StepOps(StepKernels(router_block_e=8), 1, 2, 1e-6, "cpu", "fp8")
    assert asked.router_block_e == 8


def test_bf16_projections_count_as_bf16_only_where_the_gemv_is_tuned(tmp_path, monkeypatch):
    """The PDL chain moves bf16 projections from cuBLAS to the Triton GEMV, which only its tuned
    sizes have measured faster; other plain weights (fp32, fp16, untuned sizes) are "plain"."""
    from kernels import tuned

    monkeypatch.setattr(tuned, "CONFIG_DIR", tmp_path)
    tuned.load.cache_clear()
    try:
        w_qkv, w_o = torch.randn(96, 64).bfloat16(), torch.randn(64, 64).bfloat16()
        assert step_format(w_qkv, w_o) == "plain"
        for w in (w_qkv, w_o):
            tuned.save(f"gemv_bf16_N{w.shape[0]}_K{w.shape[1]}.json", {"configs": {"1": {}}})
        assert step_format(w_qkv, w_o) == "bf16"
        assert step_format(w_qkv.half(), w_o.half()) == "plain"
        assert step_format(w_qkv.float(), w_o.float()) == "plain"
    finally:
        tuned.load.cache_clear()


def test_unknown_fusion_is_refused():
    with pytest.raises(ValueError, match="unknown fusions"):
        StepKernels(fusions=frozenset({"everything"}))


def test_vocab_limit_masks_padded_ids(tiny):
    model, _ = tiny
    pool = _pool(model)
    step = DecodeStep(model, pool, rows=1, max_blocks=4, vocab_limit=10)
    step.load([3], [0], [[2]])
    step()
    assert torch.isinf(step.logits[0, 10:]).all() and step.greedy[0].item() < 10


def test_engine_with_step_generates_what_the_plain_engine_does(tiny):
    """The scheduler's graph path (decode and short prompt tails) against its eager path."""
    model, tok = tiny
    prompt = tok.encode("def add(a, b):\n    return a + b\n\nclass Point:\n    def __init__(self")

    def generate(use_step):
        engine = Engine(model, tok, EngineOptions(num_blocks=64, block_size=BLOCK))
        if use_step:
            engine.runner.graphs = DecodeGraphs(
                model, engine.runner.pool, max_tokens=256, buckets=(1, 2, 4, 8)
            )
        events = []
        engine.submit(Request(prompt[:-3], warm_only=True), events.append)
        engine.run_until_idle()
        engine.submit(
            Request(prompt, max_tokens=6, stop_at_eos=False, return_logits=True), events.append
        )
        engine.run_until_idle()
        done = events[-1]
        assert done.kind == "done", done
        return "".join(e.text for e in events if e.kind == "delta"), done

    text, done = generate(True)
    plain_text, plain = generate(False)
    assert done.usage["cached_tokens"] > 0 and done.usage["completion_tokens"] == 6
    assert text == plain_text
    assert _max_rel(done.logits, plain.logits) < 1e-4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the PDL chain is CUDA's")
@pytest.mark.parametrize("fp8_pool", [False, True])
def test_a_prompts_tail_in_the_pdl_chain_reads_the_keys_its_step_stores(fp8_pool):
    """Paged attention reads its first tile of keys before its PDL wait, then reloads the ones
    this step's rows store: a prompt's tail (a row per new token of one sequence) whose slots
    hold noise before each replay gives the unchained step's logits every time, where an early
    read of the noise would not."""
    from engine.loading.random_model import QWEN3_30B_A3B, random_model

    shape = dict(QWEN3_30B_A3B, num_hidden_layers=2, vocab_size=4096)
    model = random_model(shape, torch.bfloat16, "cuda")
    cfg = model.config
    block = 16
    pool = KVPool(
        cfg.num_layers, 8, block, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16, "cuda", fp8_pool
    )
    gen = torch.Generator(device="cuda").manual_seed(0)
    for store in (*pool.keys, *pool.values):
        store.copy_(torch.randn(store.shape, generator=gen, device="cuda").to(store.dtype))
    table = list(range(8))  # slot = position
    start, n = 100, 6  # lengths 101-106 over two splits of 64: the tail in a split's first tile
    tokens = torch.randint(0, cfg.vocab_size, (n,), generator=gen, device="cuda").tolist()

    def replays(fusions, times=16):
        graphs = DecodeGraphs(
            model, pool, 8 * block, buckets=(8,), kernels=StepKernels(fusions=frozenset(fusions))
        )
        out = []
        for _ in range(times):
            for store in (*pool.keys, *pool.values):
                noise = torch.randn(store[start : start + n].shape, generator=gen, device="cuda")
                store[start : start + n] = (noise * 4).to(store.dtype)
            logits, _ = graphs.run(tokens, list(range(start, start + n)), [table] * n)
            out.append(logits.float().clone())
        return out

    want = replays((), times=1)[0]
    chained = replays(("router", "pdl"))
    for got in chained:
        assert float((got - want).norm() / want.norm()) < 2e-2
    # The q/k/v epilogue computes what the separate launches do, bit for bit.
    for got in replays(("router", "pdl", "qkv_epilogue")):
        assert torch.equal(got, chained[0])
