"""CPU latency of candidate shapes for the next default model, measured with random weights.

    python -m engine.bench.cpu_shapes [--shapes NAME,...] [--json OUT] [--runs 20]
    python -m engine.bench.cpu_shapes --list

All the named shapes (`SHAPES`, and "embedded") take about 15 minutes on a 2-core CPU.

Each candidate is a Qwen3-MoE config: the embedded model's (vocabulary 16,000, tied embedding,
context 1,024) with another hidden size, depth, attention heads, experts, top-k, expert width and
optionally dense layers (`Shape`). Its random weights are written as a model trained through int4
rounding is exported (the projections as int4 groups of 32 by the project's quantizer; the
embedding, routers and norms in bf16) into a temporary folder, and `load_model` loads that
folder, so that the model measured is the engine's loaded form and its load time is the engine's.

For each candidate it reports:
- parameters: the embedding, and the rest in total and active per token (as the model card counts);
- bytes on disk: FP8 64x64 blocks (the written file), int4 in groups of 32 (compressed-tensors,
  as `export --int4-group 32` writes), int8 rows (one bf16 scale per row: the lean step's form;
  the engine reads no such file, so it is a count), bf16; and the bytes a decode step streams;
- load: `load_model` of the folder, then the lean CPU step's weight copies, which the engine
  builds when it starts (fp32, int8 and int4), on one intra-op thread: on two, a neighbour busy
  on one of the two cores makes them collapse (BENCHMARKS.md, "Lean CPU decode step and one intra-op
  thread"), which is the host's state, not the shape's;
- the cold single-line completion (BENCHMARKS.md, "Cold single-line completion through the
  engine"): the same FIM prompt, 24 forced new tokens, a fresh Engine, p50 of `runs` after
  `warmups`, with the lean step's weights in fp32, int8 and int4 (the int4 form holds these
  weights exactly: engine.model.lean_matrices); the prefill and the decode step
  (the decode time over its 23 steps) from the same runs;
- the first token with a ~1,000-token prompt cached, as `engine.bench.first_token` measures it
  warm (the prompt one keystroke earlier in the prefix cache), and a decode step after it.

The host may be shared, so every number is taken alongside the baseline (the shipped shape, with
random weights too): each round runs the baseline and the candidate one after the other, and the
table gives each candidate's numbers with its ratio to the baseline of the same rounds. The
cores other processes kept busy meanwhile are recorded too (`others_busy_cores`).

Random weights route tokens arbitrarily, which is fine for latency, but a random model's greedy
text is not: it writes one token over and over, which its router sends to the same experts at
every step (fewer distinct weights to stream than a trained model's steps read), and which
prompt-lookup drafts would predict. So each completion writes a script: the embedded model's own
greedy completion of the cold prompt (`Bench.script`). The engine's token chooser still does its
work on the random model's logits at every step; its answer is then replaced by the script's next
token (`scripted_engine`). Speculation is off, so every new token is one decode step. The routing
must also vary as a trained model's does: at the usual scale, the random layers' outputs, much
alike for every token, swamp the embedding, and the router sends the tokens to fewer experts (a
22-token prefill touched 5-8 of 8 experts a layer, the embedded model 6-8), so the weights that
write the residual stream (o_proj, down_proj) are drawn smaller (`RESIDUAL_SCALE`). The
embedding is drawn at a trained model's scale (`EMBED_STD`), so that the int8 lm_head's logits
near the best, which the step computes again in fp32, are as few as a trained model's. The shape
named "embedded" is the embedded model with its own weights: beside its random twin (the
baseline) it checks what random weights miss.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.bench.first_token import prompt_pair, source_text
from engine.core.engine import Engine
from engine.core.options import EngineOptions
from engine.core.request import Request
from engine.loading import fp8, int4
from engine.loading.loader import load_model
from engine.loading.quantize import fp8_quantization_config
from engine.loading.tokenizer import Tokenizer
from engine.model import cpu_threads
from engine.model.host_load import HostLoad
from engine.model.lean_cpu import LeanCpu
from engine.model.qwen3_moe import Qwen3MoeModel
from engine.models import embedded_model_dir
from engine.prompts.fim import build_fim_prompt

FP8_BLOCK = 64  # wd-coder-tiny's blocks
INT4_GROUP = 32  # run 12's groups (export --int4-group 32)
# The embedded model's embedding has a standard deviation of 0.17.
EMBED_STD = 0.15
# o_proj and down_proj are drawn at this fraction of 1/sqrt(fan_in) (see the module's docstring).
# With 0.1 the shipped shape's random twin measured 1-3% below the embedded model in the cold
# single-line p50, prefill and decode step (both weight forms, interleaved); with 1.0, 4-6% below
# (its prefill 9-14% below).
RESIDUAL_SCALE = 0.1
# The cold single-line command of BENCHMARKS.md.
FIM_PREFIX, FIM_SUFFIX = "def fibonacci(n):\n    ", "\n\nprint(fibonacci(10))\n"
NEW_TOKENS = 24
CACHED_PROMPT_TOKENS = 1000
CACHED_DECODE_TOKENS = 17  # a completion of these after the cached prompt: 16 decode steps
FORMS = ("fp32", "int8", "int4")
FOLDER_FORMAT = "int4"  # how the random weights are written (write_folder)
BF16, FP32 = 2, 4  # bytes per value


@dataclass(frozen=True)
class Shape:
    """A candidate's dimensions; the rest of its config is the embedded model's."""

    hidden: int
    layers: int
    q_heads: int
    kv_heads: int
    experts: int
    top_k: int
    moe_inter: int
    head_dim: int = 64
    dense_layers: tuple[int, ...] = ()  # mlp_only_layers: a dense MLP instead of the experts
    dense_inter: int = 0  # their intermediate size

    def config(self, base: dict | None = None) -> dict:
        """The Hugging Face config.json of this shape (without a quantization_config)."""
        base = dict(base if base is not None else embedded_config())
        base.pop("quantization_config", None)
        return dict(
            base,
            hidden_size=self.hidden,
            num_hidden_layers=self.layers,
            num_attention_heads=self.q_heads,
            num_key_value_heads=self.kv_heads,
            head_dim=self.head_dim,
            num_experts=self.experts,
            num_experts_per_tok=self.top_k,
            moe_intermediate_size=self.moe_inter,
            intermediate_size=self.dense_inter or base.get("intermediate_size", 0),
            mlp_only_layers=list(self.dense_layers),
            decoder_sparse_step=1,
            tie_word_embeddings=True,
        )

    @classmethod
    def of_config(cls, config: dict) -> Shape:
        dense = tuple(config.get("mlp_only_layers") or ())
        return cls(
            hidden=config["hidden_size"],
            layers=config["num_hidden_layers"],
            q_heads=config["num_attention_heads"],
            kv_heads=config["num_key_value_heads"],
            experts=config["num_experts"],
            top_k=config["num_experts_per_tok"],
            moe_inter=config["moe_intermediate_size"],
            head_dim=config.get("head_dim")
            or config["hidden_size"] // config["num_attention_heads"],
            dense_layers=dense,
            dense_inter=config["intermediate_size"] if dense else 0,
        )

    def describe(self) -> str:
        text = (
            f"{self.hidden} x {self.layers} layers, {self.q_heads}/{self.kv_heads} heads of "
            f"{self.head_dim}, {self.experts} experts top-{self.top_k} of {self.moe_inter}"
        )
        if self.dense_layers:
            text += f", dense layers {list(self.dense_layers)} of {self.dense_inter}"
        return text


def embedded_config() -> dict:
    return json.loads((embedded_model_dir() / "config.json").read_text())


# The candidates. Attention widens with the hidden size (heads of 64, two query heads per key
# head, as shipped). The larger ones take the widest experts (a multiple of 64) that keep the FP8
# file under 128 MB, in 8 or 16 experts; the smaller ones lie between them and the shipped shape.
SHAPES: dict[str, Shape] = {
    "shipped": Shape.of_config(embedded_config()),  # the embedded default model's
    "h512-l8-e8-i256": Shape(512, 8, 8, 4, 8, 2, 256),
    "h512-l8-e8-i384": Shape(512, 8, 8, 4, 8, 2, 384),
    "h512-l8-e16-i384": Shape(512, 8, 8, 4, 16, 2, 384),
    "h512-l8-e8-i512": Shape(512, 8, 8, 4, 8, 2, 512),
    "h512-l10-e8-i384": Shape(512, 10, 8, 4, 8, 2, 384),
    "h384-l12-e8-i384": Shape(384, 12, 6, 3, 8, 2, 384),
    "h512-l12-e8-i256": Shape(512, 12, 8, 4, 8, 2, 256),
    "h512-l12-e8-i384": Shape(512, 12, 8, 4, 8, 2, 384),
    "h512-l12-e8-i640": Shape(512, 12, 8, 4, 8, 2, 640),
    "h512-l12-e16-i320": Shape(512, 12, 8, 4, 16, 2, 320),
    "h512-l12-e8k4-i640": Shape(512, 12, 8, 4, 8, 4, 640),  # dense-ish: half the experts active
    "h512-l16-e8-i448": Shape(512, 16, 8, 4, 8, 2, 448),
    "h512-l16-e16-i192": Shape(512, 16, 8, 4, 16, 2, 192),
    "h640-l12-e8-i448": Shape(640, 12, 10, 5, 8, 2, 448),
    "h640-l12-e16-i192": Shape(640, 12, 10, 5, 16, 2, 192),
    "h768-l12-e8-i320": Shape(768, 12, 12, 6, 8, 2, 320),
    "h768-l12-e16-i128": Shape(768, 12, 12, 6, 16, 2, 128),
}
BASELINE = "shipped"


# --- what a shape holds --------------------------------------------------------------------


@dataclass(frozen=True)
class TensorSpec:
    name: str  # the Hugging Face name on disk
    shape: tuple[int, ...]
    kind: str  # "embed", "projection" (quantized on disk), "router", "norm"
    fan_in: int = 1
    expert: bool = False  # one expert's projection (a token reads top_k of num_experts)


def tensor_specs(config: dict) -> Iterator[TensorSpec]:
    """Every tensor of the shape's checkpoint, as `engine.train.export` writes it (per-expert
    projections, no lm_head: it is tied)."""
    h, d = config["hidden_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    dense = set(config.get("mlp_only_layers") or ())
    yield TensorSpec("model.embed_tokens.weight", (config["vocab_size"], h), "embed")
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        yield TensorSpec(p + "input_layernorm.weight", (h,), "norm")
        yield TensorSpec(p + "post_attention_layernorm.weight", (h,), "norm")
        yield TensorSpec(a + "q_proj.weight", (q, h), "projection", h)
        yield TensorSpec(a + "k_proj.weight", (kv, h), "projection", h)
        yield TensorSpec(a + "v_proj.weight", (kv, h), "projection", h)
        yield TensorSpec(a + "o_proj.weight", (h, q), "projection", q)
        yield TensorSpec(a + "q_norm.weight", (d,), "norm")
        yield TensorSpec(a + "k_norm.weight", (d,), "norm")
        if i in dense:
            inter = config["intermediate_size"]
            yield TensorSpec(p + "mlp.gate_proj.weight", (inter, h), "projection", h)
            yield TensorSpec(p + "mlp.up_proj.weight", (inter, h), "projection", h)
            yield TensorSpec(p + "mlp.down_proj.weight", (h, inter), "projection", inter)
            continue
        inter = config["moe_intermediate_size"]
        yield TensorSpec(p + "mlp.gate.weight", (config["num_experts"], h), "router", h)
        for e in range(config["num_experts"]):
            x = f"{p}mlp.experts.{e}."
            yield TensorSpec(x + "gate_proj.weight", (inter, h), "projection", h, True)
            yield TensorSpec(x + "up_proj.weight", (inter, h), "projection", h, True)
            yield TensorSpec(x + "down_proj.weight", (h, inter), "projection", inter, True)
    yield TensorSpec("model.norm.weight", (h,), "norm")


def _fp8_bytes(out_f: int, in_f: int) -> int:
    """FP8 values plus one fp32 scale per 64x64 block (the last blocks ragged)."""
    return out_f * in_f + math.ceil(out_f / FP8_BLOCK) * math.ceil(in_f / FP8_BLOCK) * FP32


def _int4_bytes(out_f: int, in_f: int) -> int:
    """Packed int4 values, one bf16 scale per group of 32 columns, and the int32 [2] shape."""
    return out_f * in_f // 2 + out_f * (in_f // INT4_GROUP) * BF16 + 2 * 4


def _int8_bytes(out_f: int, in_f: int) -> int:
    """int8 values and one bf16 scale per row (engine.model.lean_matrices.Int8Matrix)."""
    return out_f * in_f + out_f * BF16


def accounting(config: dict) -> dict:
    """Parameters and bytes of a shape, from its config alone.

    Parameters as the model card counts them: the embedding apart (tied, it is also the
    lm_head), the rest in total and as read for one token (its top_k experts of each MoE layer).
    Bytes on disk are the tensors' (a safetensors header adds a few KB); each format quantizes
    the projections and keeps the embedding, routers and norms in bf16. `step_bytes` is what one
    decode step of the lean CPU path streams: the attention and the chosen experts' matrices,
    the routers (fp32 in both forms) and the lm_head; a dense layer's MLP runs on the general
    path's fp32 weights in both forms."""
    k, e = config["num_experts_per_tok"], config["num_experts"]
    params = dict(embedding=0, total=0, active=0)
    disk = {"fp8-64": 0, "int4-g32": 0, "int8-rows": 0, "bf16": 0}
    step = {"fp32": 0, "int8": 0, "int4": 0}
    for spec in tensor_specs(config):
        n = math.prod(spec.shape)
        share = k / e if spec.expert else 1.0
        if spec.kind == "embed":
            params["embedding"] += n
            step["fp32"] += n * FP32  # the lm_head (int8 rows in the int4 form too)
            step["int8"] += _int8_bytes(*spec.shape)
            step["int4"] += _int8_bytes(*spec.shape)
        else:
            params["total"] += n
            params["active"] += n * share
        if spec.kind == "projection":
            disk["fp8-64"] += _fp8_bytes(*spec.shape)
            disk["int4-g32"] += _int4_bytes(*spec.shape)
            disk["int8-rows"] += _int8_bytes(*spec.shape)
            disk["bf16"] += n * BF16
            dense_mlp = ".mlp." in spec.name and not spec.expert
            step["fp32"] += n * FP32 * share
            step["int8"] += (n * FP32 if dense_mlp else _int8_bytes(*spec.shape)) * share
            step["int4"] += (n * FP32 if dense_mlp else _int4_bytes(*spec.shape)) * share
        else:
            for fmt in disk:
                disk[fmt] += n * BF16
        if spec.kind == "router":
            for form in step:
                step[form] += n * FP32
    params["active"] = round(params["active"])
    return dict(params=params, disk_bytes=disk, step_bytes={f: round(b) for f, b in step.items()})


# --- the random model's folder ---------------------------------------------------------------


def random_tensor(spec: TensorSpec, gen: torch.Generator) -> torch.Tensor:
    """Drawn at a trained model's scale: projections and routers N(0, 1/fan_in) (o_proj and
    down_proj times RESIDUAL_SCALE), norms near 1, the embedding at EMBED_STD."""
    if spec.kind == "norm":
        return (1.0 + 0.1 * torch.randn(spec.shape, generator=gen)).to(torch.bfloat16)
    if spec.kind == "embed":
        return (EMBED_STD * torch.randn(spec.shape, generator=gen)).to(torch.bfloat16)
    t = torch.randn(spec.shape, generator=gen) / math.sqrt(spec.fan_in)
    if spec.name.endswith(("o_proj.weight", "down_proj.weight")):
        t *= RESIDUAL_SCALE
    return t if spec.kind == "projection" else t.to(torch.bfloat16)


def random_weights(config: dict, seed: int = 0) -> Iterator[tuple[TensorSpec, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    for spec in tensor_specs(config):
        yield spec, random_tensor(spec, gen)


def write_folder(config: dict, folder: Path, seed: int = 0, fmt: str = "fp8") -> Path:
    """A model folder of the shape with random weights: the projections as FP8 64x64 blocks
    (fmt "fp8", as wd-coder-tiny) or int4 groups of 32 ("int4", as wd-coder-small), the rest
    bf16."""
    folder.mkdir(parents=True, exist_ok=True)
    config = dict(config)
    weights = {}
    for spec, t in random_weights(config, seed):
        if spec.kind != "projection":
            weights[spec.name] = t
        elif fmt == "fp8":
            weights[spec.name], weights[spec.name + fp8.SCALE_SUFFIX] = fp8.quantize(t, FP8_BLOCK)
        elif fmt == "int4":
            weights.update(int4.store(spec.name, t, INT4_GROUP))
        else:
            raise ValueError(f"unknown format {fmt!r}; expected fp8 or int4")
    if fmt == "fp8":
        config["quantization_config"] = fp8_quantization_config(config, FP8_BLOCK)
    else:
        config["quantization_config"] = int4.quantization_config(
            INT4_GROUP,
            ["lm_head"]
            + [f"model.layers.{i}.mlp.gate" for i in range(config["num_hidden_layers"])],
        )
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def file_tensor_bytes(path: Path) -> int:
    """The bytes of a safetensors file's tensors (its size less the header)."""
    total = 0
    with safe_open(str(path), framework="pt") as f:
        for name in f.keys():
            part = f.get_slice(name)
            total += math.prod(part.get_shape()) * _DTYPE_BYTES[part.get_dtype()]
    return total


_DTYPE_BYTES = {"F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "I32": 4, "I64": 8}


# --- measurements ----------------------------------------------------------------------------


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return 1000 * (time.perf_counter() - t0), out


def scripted_engine(
    model: Qwen3MoeModel, tokenizer: Tokenizer, script: list[int], options: EngineOptions
) -> Engine:
    """An engine whose completions write `script`, over and over (see the module's docstring):
    its token chooser runs as ever, then its answer is replaced by the script's next token."""
    engine = Engine(model, tokenizer, options)
    choose, position = engine.chooser.choose, itertools.count()

    def scripted(*args, **kwargs) -> int:
        choose(*args, **kwargs)
        return script[next(position) % len(script)]

    engine.chooser.choose = scripted
    return engine


def cold_completion(
    model: Qwen3MoeModel, tokenizer: Tokenizer, prompt: list[int], script: list[int]
) -> dict:
    """The cold single-line command's one run: a fresh Engine, NEW_TOKENS forced new tokens,
    wall time from submit to the end of run_until_idle."""
    engine = scripted_engine(model, tokenizer, script, EngineOptions(speculative=False))
    done = []
    t0 = time.perf_counter()
    engine.submit(Request(prompt, max_tokens=NEW_TOKENS, stop_at_eos=False), done.append)
    engine.run_until_idle()
    total = 1000 * (time.perf_counter() - t0)
    usage = done[-1].usage
    steps = usage["completion_tokens"] - 1
    return dict(
        ms=total,
        prefill_ms=usage["prefill_ms"],
        step_ms=usage["decode_ms"] / steps if steps > 0 else None,
    )


def cached_first_token(
    model: Qwen3MoeModel,
    tokenizer: Tokenizer,
    before: list[int],
    after: list[int],
    script: list[int],
) -> dict:
    """engine.bench.first_token's warm case: the prompt one keystroke earlier is cached, then the
    first token of the typed prompt; then a completion of CACHED_DECODE_TOKENS after it."""
    options = EngineOptions(num_blocks=2 * (len(after) // 16 + 4), block_size=16, speculative=False)
    engine = scripted_engine(model, tokenizer, script, options)
    cold_ms, _ = timed(lambda: engine.complete(Request(before, warm_only=True)).check())
    first = engine.complete(Request(after, max_tokens=1, stop_at_eos=False)).check().usage
    usage = (
        engine.complete(Request(after, max_tokens=CACHED_DECODE_TOKENS, stop_at_eos=False))
        .check()
        .usage
    )
    return dict(
        cold_prefill_ms=cold_ms,
        first_token_ms=first["first_token_ms"],
        step_ms=usage["decode_ms"] / (usage["completion_tokens"] - 1),
    )


@dataclass
class Bench:
    """What every measurement shares: the tokenizer, the prompts, the script, the counts."""

    runs: int = 20
    warmups: int = 2
    cached_repeat: int = 5
    cached_tokens: int = CACHED_PROMPT_TOKENS
    load_repeat: int = 3
    seed: int = 0
    log: Callable[[str], None] = print

    def __post_init__(self):
        folder = embedded_model_dir()
        self.tokenizer = Tokenizer.from_dir(folder)
        self.prompt = build_fim_prompt(self.tokenizer, FIM_PREFIX, FIM_SUFFIX, "spm")
        text = source_text(self.cached_tokens * 8)
        self.before, self.after = prompt_pair(self.tokenizer, text, self.cached_tokens)
        # The embedded model's greedy completion of the cold prompt: what every completion writes.
        engine = Engine(load_model(folder), self.tokenizer, EngineOptions(speculative=False))
        request = Request(self.prompt, max_tokens=NEW_TOKENS, stop_at_eos=False)
        self.script = engine.complete(request).check().token_ids


class Loaded:
    """A shape written to a folder and loaded, with its model in both lean weight forms."""

    def __init__(self, name: str, config: dict, folder: Path, seed: int, write: bool = True):
        """`write`: draw the random weights into `folder` (else it holds a model already)."""
        self.name, self.config, self.folder = name, config, folder
        self.write_s = (
            timed(lambda: write_folder(config, folder, seed, FOLDER_FORMAT))[0] / 1000
            if write
            else 0.0
        )
        self.file_bytes = (folder / "model.safetensors").stat().st_size
        self.file_tensor_bytes = file_tensor_bytes(folder / "model.safetensors")
        self.load_ms: list[float] = []
        self.lean_ms: dict[str, list[float]] = {form: [] for form in FORMS}
        self.models = {}
        self.forms = FORMS  # those its weights take: int4 needs weights on the int4 grid

    def time_load(self) -> None:
        """One load of the folder and one build of each form's lean copies."""
        gc.collect()
        with cpu_threads.intra_op_threads(1):
            ms, model = timed(lambda: load_model(self.folder))
            self.load_ms.append(ms)
            if model.lean.form != "int4":  # load_model's "auto" found no int4 grid
                self.forms = tuple(f for f in FORMS if f != "int4")
            for form in self.forms:
                # The form load_model chose has its int4 check done already, as the engine's has.
                lean = model.lean if form == model.lean.form else LeanCpu(model, form)
                self.lean_ms[form].append(timed(lean.prepare)[0])
        if not self.models:
            self.models = {form: model.with_options(lean_weights=form) for form in self.forms}
            for m in self.models.values():
                m.prepare_lean_decode()

    def release(self) -> None:
        self.models = {}
        gc.collect()


def _median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _summary(rows: list[dict], key: str) -> float | None:
    return _median(r[key] for r in rows)


def measure_pair(bench: Bench, base: Loaded, cand: Loaded) -> dict:
    """The candidate's numbers and the baseline's of the same rounds, interleaved run by run
    (the order alternating from round to round)."""
    pair = (base, cand)
    neighbours = HostLoad()
    for r in range(bench.load_repeat):
        for item in pair if r % 2 == 0 else pair[::-1]:
            item.time_load()
    forms = [f for f in FORMS if f in base.forms and f in cand.forms]
    cold = {(item.name, form): [] for item in pair for form in forms}
    for r in range(bench.warmups + bench.runs):
        for form in forms:
            for item in pair if r % 2 == 0 else pair[::-1]:
                run = cold_completion(
                    item.models[form], bench.tokenizer, bench.prompt, bench.script
                )
                if r >= bench.warmups:
                    cold[(item.name, form)].append(run)
    cached = {(item.name, form): [] for item in pair for form in forms}
    for r in range(bench.cached_repeat):
        for form in forms:
            for item in pair if r % 2 == 0 else pair[::-1]:
                m = item.models[form]
                cached[(item.name, form)].append(
                    cached_first_token(m, bench.tokenizer, bench.before, bench.after, bench.script)
                )

    def numbers(item: Loaded) -> dict:
        out = dict(
            load_ms=_median(item.load_ms),
            lean_copies_ms={form: _median(item.lean_ms[form]) for form in forms},
        )
        for form in forms:
            runs, warm = cold[(item.name, form)], cached[(item.name, form)]
            out[form] = dict(
                cold_p50_ms=_summary(runs, "ms"),
                cold_min_ms=min(run["ms"] for run in runs),
                prefill_ms=_summary(runs, "prefill_ms"),
                step_ms=_summary(runs, "step_ms"),
                cached_first_token_ms=_summary(warm, "first_token_ms"),
                cached_step_ms=_summary(warm, "step_ms"),
                cold_prefill_1k_ms=_summary(warm, "cold_prefill_ms"),
                cold_ms=[round(run["ms"], 2) for run in runs],
            )
        return out

    result = dict(
        candidate=numbers(cand),
        baseline=numbers(base),
        others_busy_cores=neighbours.others_busy_cores(),
    )
    ratios = {}
    for form in forms:
        c, b = result["candidate"][form], result["baseline"][form]
        ratios[form] = {
            key: c[key] / b[key]
            for key in ("cold_p50_ms", "step_ms", "cached_first_token_ms", "prefill_ms")
            if c[key] and b[key]
        }
    ratios["load_ms"] = result["candidate"]["load_ms"] / result["baseline"]["load_ms"]
    result["ratio_to_baseline"] = ratios
    return result


def measure(
    bench: Bench,
    shapes: dict[str, dict],
    baseline: tuple[str, dict],
    workdir: Path,
    embedded: Path | None = None,
) -> list[dict]:
    """Each shape (name -> config) measured against the baseline (name, config). `embedded`: the
    folder of the shape named "embedded" (its own weights, not random ones)."""
    base = Loaded(baseline[0], baseline[1], workdir / "baseline", bench.seed)
    results = []
    for i, (name, config) in enumerate(shapes.items()):
        own = name == "embedded" and embedded is not None
        folder = embedded if own else workdir / f"shape{i}"
        cand = Loaded(name, config, folder, bench.seed + 1 + i, write=not own)
        t0 = time.perf_counter()
        numbers = measure_pair(bench, base, cand)
        row = dict(
            name=name,
            shape=asdict(Shape.of_config(config)),
            description=Shape.of_config(config).describe(),
            **accounting(config),
            file_bytes=cand.file_bytes,
            file_tensor_bytes=cand.file_tensor_bytes,
            write_s=cand.write_s,
            measure_s=time.perf_counter() - t0,
            **numbers,
        )
        cand.release()
        results.append(row)
        bench.log(format_row(row))
    base.release()
    return results


# --- output --------------------------------------------------------------------------------


HEADER = (
    f"{'shape':<22} {'params M':>11} {'MB fp8/int8/int4':>17} {'load s (fp32/int8/int4)':>15} "
    f"{'cold p50 fp32 | int8 | int4 ms (x base)':>50} {'step ms':>17} {'1st tok ms':>17} "
    f"{'others':>6}"
)


def format_row(row: dict) -> str:
    """One shape's line: parameters total/active, MB on disk, load with each form's lean
    copies, cold p50 per form with its ratio to the baseline, decode step and first token
    cached per form (fp32/int8/int4; "-" where the weights do not take a form), other processes'
    busy cores."""
    p, d, c = row["params"], row["disk_bytes"], row["candidate"]
    ratio = row["ratio_to_baseline"]
    forms = [f for f in FORMS if f in c]

    def per_form(fmt) -> str:
        return "/".join(fmt(f) if f in forms else "-" for f in FORMS)

    load_s = per_form(lambda f: f"{(c['load_ms'] + c['lean_copies_ms'][f]) / 1000:.2f}")
    cold = " | ".join(
        f"{c[f]['cold_p50_ms']:6.1f} ({ratio[f].get('cold_p50_ms', 0):.2f})"
        if f in forms
        else f"{'-':>13}"
        for f in FORMS
    )
    return (
        f"{row['name']:<22} {p['total'] / 1e6:5.1f}/{p['active'] / 1e6:5.1f} "
        f"{d['fp8-64'] / 1e6:5.1f}/{d['int8-rows'] / 1e6:5.1f}/{d['int4-g32'] / 1e6:5.1f} "
        f"{load_s:>15} {cold:>50} "
        f"{per_form(lambda f: format(c[f]['step_ms'], '5.2f')):>17} "
        f"{per_form(lambda f: format(c[f]['cached_first_token_ms'], '5.1f')):>17} "
        f"{row['others_busy_cores'] or 0:6.2f}"
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--shapes",
        help=f"comma-separated names (default: all of them); 'embedded' is the embedded model "
        f"with its own weights. Known: embedded, {', '.join(SHAPES)}",
    )
    ap.add_argument(
        "--shapes-file",
        type=Path,
        help="JSON {name: {hidden, layers, q_heads, kv_heads, experts, top_k, moe_inter, "
        "[head_dim, dense_layers, dense_inter]}}: more candidates",
    )
    ap.add_argument("--list", action="store_true", help="list the shapes with their sizes")
    ap.add_argument(
        "--config",
        metavar="NAME",
        help="print the config.json of a named shape (to train it: SHAPE= of "
        "engine/train/gpu_session.sh) and exit",
    )
    ap.add_argument("--runs", type=int, default=20, help="cold runs per shape and form (p50)")
    ap.add_argument("--warmups", type=int, default=2)
    ap.add_argument("--cached-repeat", type=int, default=5)
    ap.add_argument("--load-repeat", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)

    known = dict(SHAPES)
    if args.shapes_file:
        for name, fields in json.loads(args.shapes_file.read_text()).items():
            fields["dense_layers"] = tuple(fields.get("dense_layers", ()))
            known[name] = Shape(**fields)
    if args.config:
        if args.config not in known:
            ap.error(f"unknown shape {args.config!r}; known: {', '.join(known)}")
        print(json.dumps(known[args.config].config(), indent=2))
        return 0
    names = args.shapes.split(",") if args.shapes else ["embedded", *known]
    for name in names:
        if name not in known and name != "embedded":
            ap.error(f"unknown shape {name!r}; known: {', '.join(known)}, embedded")
    configs = {
        name: embedded_config() if name == "embedded" else known[name].config() for name in names
    }
    if args.list:
        for name, config in configs.items():
            a = accounting(config)
            p, d, s = a["params"], a["disk_bytes"], a["step_bytes"]
            print(
                f"{name:<22} {Shape.of_config(config).describe()}\n{'':<22} params "
                f"{p['total'] / 1e6:.1f}M, {p['active'] / 1e6:.1f}M active "
                f"(+{p['embedding'] / 1e6:.1f}M embedding); MB on disk fp8-64 "
                f"{d['fp8-64'] / 1e6:.1f}, int8-rows {d['int8-rows'] / 1e6:.1f}, int4-g32 "
                f"{d['int4-g32'] / 1e6:.1f}, bf16 {d['bf16'] / 1e6:.1f}; a step streams "
                f"{s['fp32'] / 1e6:.1f} MB fp32, {s['int8'] / 1e6:.1f} MB int8, "
                f"{s['int4'] / 1e6:.1f} MB int4"
            )
        return 0

    bench = Bench(
        runs=args.runs,
        warmups=args.warmups,
        cached_repeat=args.cached_repeat,
        load_repeat=args.load_repeat,
        seed=args.seed,
    )
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; cold prompt "
        f"{len(bench.prompt)} tokens + {NEW_TOKENS} new, cached prompt {len(bench.after)} tokens; "
        f"baseline {BASELINE} (random weights), p50 of {args.runs}"
    )
    print(HEADER)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="cpu-shapes-") as tmp:
        results = measure(
            bench,
            configs,
            (BASELINE, known[BASELINE].config()),
            Path(tmp),
            embedded=embedded_model_dir(),
        )
    print(f"{time.perf_counter() - t0:.0f} s in all")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                dict(
                    torch=torch.__version__,
                    threads=torch.get_num_threads(),
                    cold_prompt_tokens=len(bench.prompt),
                    new_tokens=NEW_TOKENS,
                    cached_prompt_tokens=len(bench.after),
                    runs=args.runs,
                    warmups=args.warmups,
                    baseline=BASELINE,
                    embed_std=EMBED_STD,
                    results=results,
                ),
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
