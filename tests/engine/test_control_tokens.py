"""A completion never writes a control token as text: the ones that close a middle or a file end
it, the ones that open a prompt section are never sampled, on both generation paths."""

import pytest
import torch
from engine_runs import complete

from engine.core.engine import Engine
from engine.core.options import EngineOptions
from engine.core.request import Request
from engine.kv.pool import PagedBatch
from engine.loading.loader import load_model
from engine.loading.tokenizer import Tokenizer
from engine.models import embedded_model_dir

DEFAULT_MODEL = embedded_model_dir()
ENDING = ["<|endoftext|>", "<|fim_suffix|>", "<|fim_pad|>", "<|file_sep|>"]
UNSAMPLED = ["<|fim_prefix|>", "<|fim_middle|>"]
PROMPT = "def add(a, b):\n    return a"


class Biased:
    """The model, with one token's logit raised far above every other."""

    def __init__(self, model, token_id: int):
        self.model, self.token_id = model, token_id

    def __getattr__(self, name):
        return getattr(self.model, name)

    def forward(self, *args, **kwargs):
        logits = self.model.forward(*args, **kwargs).clone()
        logits[..., self.token_id] += 1e4
        return logits


@pytest.fixture(scope="module")
def tiny(checkpoint_factory):
    path = checkpoint_factory()
    return load_model(path), Tokenizer.from_dir(path)


class GreedyOnDevice:
    """Stands in for CUDA decode graphs on the CPU: the model's logits, with a greedy id taken
    "on the device" that is always `token_id` (as an unmasked argmax would be)."""

    max_rows = 32

    def __init__(self, engine, token_id: int):
        self.engine, self.token_id = engine, token_id

    def run(self, tokens, positions, tables):
        model = self.engine.model
        view = PagedBatch(self.engine.runner.pool, tables, model.device)
        logits = model.forward(
            torch.tensor([[t] for t in tokens]), torch.tensor([[p] for p in positions]), view
        )
        return logits[:, -1], torch.full((len(tokens),), self.token_id)


def _engine_text(model, tok, ids, max_tokens, device_greedy: int | None = None):
    # graphs would bypass Biased
    engine = Engine(model, tok, EngineOptions(num_blocks=32, block_size=8, cuda_graphs=False))
    if device_greedy is not None:
        engine.runner.graphs = GreedyOnDevice(engine, device_greedy)
    events = []
    engine.submit(Request(ids, max_tokens=max_tokens), events.append)
    engine.run_until_idle()
    return "".join(e.text for e in events if e.kind == "delta"), events[-1].finish_reason


def test_the_default_models_tokenizer_knows_the_roles():
    tok = Tokenizer.from_dir(DEFAULT_MODEL)
    assert set(tok.eos_ids) == {tok.token_id(t) for t in ENDING}
    assert set(tok.unsampled_ids) == {tok.token_id(t) for t in UNSAMPLED}


@pytest.mark.parametrize("name", UNSAMPLED)
def test_a_section_opening_token_is_never_sampled(tiny, name):
    """With the marker the model's overwhelming favourite, greedy decoding writes exactly what it
    writes without the bias: the marker is skipped and the next best token taken, every step."""
    model, tok = tiny
    ids = tok.encode(PROMPT)
    plain, _ = complete(model, tok, ids, max_tokens=10, stop_at_eos=False)
    assert plain  # the comparison is about real text
    biased = Biased(model, tok.token_id(name))
    text, stats = complete(biased, tok, ids, max_tokens=10, stop_at_eos=False)
    assert text == plain and tok.token_id(name) not in stats.token_ids
    assert _engine_text(biased, tok, ids, 10)[0] == complete(model, tok, ids, max_tokens=10)[0]
    sampled, _ = complete(
        biased, tok, ids, max_tokens=10, temperature=1.0, seed=3, stop_at_eos=False
    )
    assert name not in sampled


@pytest.mark.parametrize("name", ENDING)
def test_a_closing_token_ends_the_completion(tiny, name):
    model, tok = tiny
    biased = Biased(model, tok.token_id(name))
    text, stats = complete(biased, tok, tok.encode(PROMPT), max_tokens=10)
    assert (text, stats.finish_reason) == ("", "eos")
    assert _engine_text(biased, tok, tok.encode(PROMPT), 10) == ("", "eos")


@pytest.mark.parametrize("name", UNSAMPLED)
def test_a_device_argmax_of_a_forbidden_token_falls_back_to_the_host(tiny, name):
    """The decode graphs take the argmax on the device, which knows nothing of forbidden ids: the
    engine must then choose on the host, and write what it writes without graphs."""
    model, tok = tiny
    ids = tok.encode(PROMPT)
    want = _engine_text(model, tok, ids, 10)
    assert want[0]
    assert _engine_text(model, tok, ids, 10, device_greedy=tok.token_id(name)) == want
