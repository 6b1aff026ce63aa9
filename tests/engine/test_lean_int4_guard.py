"""The int4 lean step's guard (engine.model.lean_cpu): a step that is not decisive (a routing
near-tie, or a row whose two best logits are close) is computed again from the model's fp32
weights, leaving the cache and a beam search's keys as the fp32 step would; a decisive one keeps
the int4 result. On a random model trained-through-int4 in form, fresh random tokens."""

import math

import pytest
import torch

from engine.decoding.beam_search import BeamTails
from engine.loading.random_model import TINY, random_model
from engine.model import lean_cpu
from engine.model.lean_cpu import LEAN_PROMPT_MAX_ROWS
from engine.model.lean_matrices import int4_available

pytestmark = pytest.mark.skipif(
    not int4_available(), reason="this torch lacks the CPU int4 product"
)

# Longer than LEAN_PROMPT_MAX_ROWS, so the prompt is computed by the general path, as a long cold
# one is, and the lean forwards counted here are the tests' own.
PROMPT = LEAN_PROMPT_MAX_ROWS + 4


@pytest.fixture(scope="module")
def models():
    """(guarded int4, fp32) lean models over the same int4-grid weights."""
    base = random_model(
        dict(TINY, vocab_size=512), dtype=torch.float32, seed=31, quant="int4", quant_size=32
    ).dequantized()
    guarded = base.with_options(lean_weights="int4", lean_guard=True)
    return guarded, base.with_options(lean_weights="fp32")


def _prefilled(model, prompt):
    cache = model.new_cache(1, 32)
    model.forward(prompt, torch.arange(PROMPT)[None], cache)
    return cache


def _prompt_and_tokens(seed, n):
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, 512, (1, PROMPT), generator=g)
    return prompt, torch.randint(0, 512, (n,), generator=g).tolist()


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def _same_best(got, want):
    """The logits greedy reads: the int4 form's lm_head is int8 rows with the logits within
    LEAN_EXACT_MARGIN of a row's best recomputed from fp32, so those must match fp32's."""
    near = want >= want.amax(dim=-1, keepdim=True) - lean_cpu.LEAN_EXACT_MARGIN
    assert torch.equal(got.argmax(dim=-1), want.argmax(dim=-1))
    return _rel(got[near], want[near]) < 1e-5


def _margins(monkeypatch, route, logit):
    monkeypatch.setattr(lean_cpu, "ROUTE_MARGIN", route)
    monkeypatch.setattr(lean_cpu, "LOGIT_MARGIN", logit)


def test_steps_that_are_not_decisive_are_the_fp32_steps(models, monkeypatch):
    int4, fp32 = models
    _margins(monkeypatch, math.inf, 0.3)  # every step counts as a routing near-tie
    prompt, tokens = _prompt_and_tokens(1, 4)
    caches = [_prefilled(m, prompt) for m in (int4, fp32)]
    before = int4.lean.recomputed
    for i, token in enumerate(tokens):
        got, want = (
            m.forward(torch.tensor([[token]]), torch.tensor([[PROMPT + i]]), c)[0, -1]
            for m, c in zip((int4, fp32), caches)
        )
        assert _same_best(got, want)
    assert int4.lean.recomputed - before == len(tokens)
    # The recompute overwrote the int4 attempt's K/V in the same slots.
    keys = [c.layer_stores(0)[0][: PROMPT + len(tokens)] for c in caches]
    assert _rel(keys[0], keys[1]) < 1e-5


def _decode(model, prompt, tokens):
    cache = _prefilled(model, prompt)
    return [
        model.forward(torch.tensor([[token]]), torch.tensor([[PROMPT + i]]), cache)[0, -1]
        for i, token in enumerate(tokens)
    ]


def test_decisive_steps_keep_the_int4_result(models, monkeypatch):
    int4, fp32 = models
    _margins(monkeypatch, -math.inf, -math.inf)
    prompt, tokens = _prompt_and_tokens(2, 3)
    before = int4.lean.recomputed
    guarded = _decode(int4, prompt, tokens)
    assert int4.lean.recomputed == before
    monkeypatch.setattr(int4.lean, "guarded", False)
    unguarded = _decode(int4, prompt, tokens)
    for got, raw, exact in zip(guarded, unguarded, _decode(fp32, prompt, tokens)):
        assert torch.equal(got, raw)
        assert 0 < _rel(got, exact) < 2e-2  # bf16 activations: close, not equal


def _routing_gaps(monkeypatch, model, prompt, tokens):
    """Each row's closest routing decision in a lean int4 forward of `tokens` after `prompt`
    (a decode step for one token, a draft's verification for more), every step decisive."""
    seen = []
    original = lean_cpu.route_gaps

    def recording(logits, top_k):
        seen.append(original(logits, top_k))
        return seen[-1]

    monkeypatch.setattr(lean_cpu, "route_gaps", recording)
    _margins(monkeypatch, -math.inf, -math.inf)
    cache = _prefilled(model, prompt)
    logits = model.forward_tail(tokens, PROMPT, cache)
    monkeypatch.setattr(lean_cpu, "route_gaps", original)
    assert len(seen) == model.config.num_layers
    return [min(layer[row] for layer in seen) for row in range(len(tokens))], logits


def _recomputes(model, prompt, tokens) -> bool:
    before = model.lean.recomputed
    model.forward_tail(tokens, PROMPT, _prefilled(model, prompt))
    return model.lean.recomputed > before


def test_the_closest_routing_gap_decides(models, monkeypatch):
    """The margin between "always" and "never": a step recomputes exactly when its closest
    routing decision is under ROUTE_MARGIN."""
    int4, _ = models
    prompt, tokens = _prompt_and_tokens(3, 1)
    (closest,), _ = _routing_gaps(monkeypatch, int4, prompt, tokens)
    assert 0 < closest < math.inf
    for margin, recomputes in ((closest * 0.999, False), (closest * 1.001, True)):
        _margins(monkeypatch, margin, -math.inf)
        assert _recomputes(int4, prompt, tokens) == recomputes


def test_a_routing_near_tie_ends_the_int4_step_at_its_layer(models, monkeypatch):
    """Its result would be dropped: the int4 forward stops at the first near-tie, and the
    fp32 one computes every layer."""
    int4, fp32 = models
    _margins(monkeypatch, math.inf, 0.3)
    calls = []
    original = lean_cpu._router_logits
    monkeypatch.setattr(lean_cpu, "_router_logits", lambda r, h: calls.append(1) or original(r, h))
    prompt, tokens = _prompt_and_tokens(7, 1)
    cache = _prefilled(int4, prompt)
    got = int4.forward(torch.tensor([tokens]), torch.tensor([[PROMPT]]), cache)[0, -1]
    assert len(calls) == 1 + int4.config.num_layers
    want = fp32.forward(torch.tensor([tokens]), torch.tensor([[PROMPT]]), _prefilled(fp32, prompt))
    assert _same_best(got, want[0, -1])


def test_only_the_draft_rows_greedy_may_read_count(models, monkeypatch):
    """A draft's rows after the first one greedy rejects are thrown away: a near-tie there does
    not recompute the step; once the draft is accepted through that row, it does."""
    int4, _ = models
    for seed in range(20, 60):
        prompt, tokens = _prompt_and_tokens(seed, 3)
        gaps, logits = _routing_gaps(monkeypatch, int4, prompt, tokens)
        if not gaps[0] > min(gaps[1:]):
            continue
        accepted = [tokens[0], int(logits[0].argmax()), tokens[2]]
        accepted_gaps, _ = _routing_gaps(monkeypatch, int4, prompt, accepted)
        if accepted_gaps[0] > accepted_gaps[1] and int(logits[0].argmax()) != tokens[1]:
            break
    else:
        pytest.fail("no seed gave the rows' routing gaps this test needs")
    # LOGIT_MARGIN 0: every row decisive by its logits, and row 0 rejects a drafted token that
    # is not its best.
    _margins(monkeypatch, (gaps[0] + min(gaps[1:])) / 2, 0.0)
    assert not _recomputes(int4, prompt, tokens)
    _margins(monkeypatch, (accepted_gaps[0] + accepted_gaps[1]) / 2, 0.0)
    assert _recomputes(int4, prompt, accepted)


def test_rows_used_stop_after_the_first_rejection():
    logits = torch.tensor([[5.0, 1.0, 0.0], [0.0, 4.0, 3.9], [1.0, 0.0, 9.0]])
    assert lean_cpu._rows_used([7, 0, 1], logits) == 3  # each drafted token its row's best
    assert lean_cpu._rows_used([7, 0, 2], logits) == 3  # within LOGIT_MARGIN of row 1's best
    assert lean_cpu._rows_used([7, 0, 0], logits) == 2  # row 1 rejects it
    assert lean_cpu._rows_used([7, 1, 0], logits) == 1  # row 0 rejects it
    assert lean_cpu._rows_used([7], logits[:1]) == 1


def test_a_close_second_logit_recomputes(models, monkeypatch):
    int4, _ = models
    prompt, tokens = _prompt_and_tokens(4, 1)
    _margins(monkeypatch, -math.inf, -math.inf)
    cache = _prefilled(int4, prompt)
    logits = int4.forward(torch.tensor([[tokens[0]]]), torch.tensor([[PROMPT]]), cache)[0, -1]
    two = logits.topk(2).values
    gap = (two[0] - two[1]).item()
    for margin, recomputes in ((gap * 0.99, False), (gap * 1.01, True)):
        _margins(monkeypatch, -math.inf, margin)
        cache = _prefilled(int4, prompt)
        before = int4.lean.recomputed
        int4.forward(torch.tensor([[tokens[0]]]), torch.tensor([[PROMPT]]), cache)
        assert (int4.lean.recomputed > before) == recomputes


def test_draft_rows_recompute_as_the_fp32_rows(models, monkeypatch):
    int4, fp32 = models
    _margins(monkeypatch, math.inf, 0.3)
    prompt, tokens = _prompt_and_tokens(5, 3)
    got, want = (m.forward_tail(tokens, PROMPT, _prefilled(m, prompt)) for m in (int4, fp32))
    assert got.shape == want.shape == (3, 512) and _same_best(got, want)


def test_beams_recomputed_hold_each_token_once(models, monkeypatch):
    int4, fp32 = models
    _margins(monkeypatch, math.inf, 0.3)
    prompt, tokens = _prompt_and_tokens(6, 6)
    caches = [_prefilled(m, prompt) for m in (int4, fp32)]
    tails = [BeamTails(int4.config.num_layers) for _ in range(2)]
    for step in range(3):
        pair = tokens[2 * step : 2 * step + 2]  # two beams
        got, want = (
            m.forward_beams(pair, PROMPT + step, c, t)
            for m, c, t in zip((int4, fp32), caches, tails)
        )
        assert got.shape == (2, 512) and _same_best(got, want)
    assert tails[0].length == tails[1].length == 3
    assert _rel(tails[0].keys[0], tails[1].keys[0]) < 1e-5


def test_exact_logits_are_the_fp32_heads_everywhere(models):
    """The int4 form's lm_head is int8 rows, exact only near each row's best; a constrained
    choice (a healed text) may pick far from it, and asks for every logit exact."""
    int4, _ = models
    model = int4
    h = torch.randn(3, model.config.hidden_size, generator=torch.Generator().manual_seed(9))
    want = (h * model.final_norm) @ model.lm_head.t()
    assert _rel(int4.lean.logits(h, exact=True), want) < 1e-6
    approximate = int4.lean.logits(h)
    far = want < want.amax(dim=-1, keepdim=True) - lean_cpu.LEAN_EXACT_MARGIN
    assert _same_best(approximate, want) and _rel(approximate[far], want[far]) > 1e-4


def test_the_engine_asks_for_exact_logits_while_a_healed_text_is_forced(monkeypatch):
    from engine.core.engine import Engine
    from engine.core.request import Request
    from engine.loading.loader import load_model
    from engine.loading.tokenizer import Tokenizer
    from engine.models import embedded_model_dir
    from engine.prompts.fim import build_fim_prompt, healed_text

    model_dir = embedded_model_dir()
    model, tok = load_model(model_dir), Tokenizer.from_dir(model_dir)
    asked = []
    forward = model.forward

    def recording(*args, exact_logits=False, **kwargs):
        asked.append(exact_logits)
        return forward(*args, exact_logits=exact_logits, **kwargs)

    monkeypatch.setattr(model, "forward", recording)
    prefix = "def add(a, b):\n    return "
    prompt = build_fim_prompt(tok, prefix, "\n", "spm", heal=True)
    forced = healed_text(tok, prefix)
    assert forced
    req = Request(list(prompt), max_tokens=8, stop_at_eos=False, forced_text=forced)
    Engine.for_one_request(model, tok, req).complete(req).check()
    # The prompt's logits and the steps that still write the healed text, then plain steps.
    assert asked[0] and not asked[-1]
    assert asked == sorted(asked, reverse=True)


class _Built(BaseException):
    """Raised where the command has built its model options: the test needs no more (a
    BaseException, so the command's own error handling lets it through)."""


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_the_guard_is_off_unless_the_command_asks_for_it(command, monkeypatch, tmp_path):
    """The int4 step unguarded is the default (BENCHMARKS.md: it changes fewer greedy answers
    than a bf16 engine does); `--cpu-decode-guard` turns the guard on for the CPU's steps."""
    from engine import cli

    built = []

    def recorded(*args):
        built.append(cli_model_options(*args))
        raise _Built

    cli_model_options = cli.model_options
    monkeypatch.setattr(cli, "model_options", recorded)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))  # serve's socket and log, private
    extra = ["--prompt", "x"] if command == "generate" else []
    for flags, guarded in (([], False), (["--cpu-decode-guard"], True)):
        args = cli.build_parser().parse_args([command, *extra, "--device", "cpu", *flags])
        with pytest.raises(_Built):
            args.run(args)
        assert built[-1].lean_guard is guarded
    base = random_model(
        dict(TINY, vocab_size=512), dtype=torch.float32, seed=5, quant="int4", quant_size=32
    ).dequantized()
    assert not base.with_options(lean_weights="int4").lean.guarded
    assert base.with_options(lean_weights="int4", lean_guard=True).lean.guarded
