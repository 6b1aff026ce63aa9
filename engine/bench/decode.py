"""Whole-model decode and prefill speed on the GPU, against the floor and against transformers.

    python -m engine.bench.decode --out decode.json          # H200: Qwen3-30B-A3B, random bf16
    python -m engine.bench.decode --shape tiny --device cpu  # the same code at a tiny shape

Builds the model with random weights straight on the device (no download), fills a KV pool with
random keys/values for every sequence, and measures in one run:
- decode tokens/s at each batch size and context: the engine's decode step (`DecodeGraphs`:
  fused small ops, warp-decode MoE, paged attention) replayed as a CUDA graph, median of many
  replays; the same with the expert-centric MoE; the eager forward the engine used before;
- the floor: bytes one step must read (attention and router weights, the experts the batch
  touches, the KV cache, the lm_head) over the measured read bandwidth;
- the split of a step: the graph again with the MoE or the attention left out;
- prefill tokens/s at 4K (one forward, and in the scheduler's 512-token chunks);
- transformers' own forward (logits against the engine's) and generate on the same weights.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

from engine.kv.pool import KVPool, PagedBatch
from engine.loading.random_model import SHAPES, random_model
from engine.model.cuda_graph import DecodeGraphs
from engine.model.qwen3_moe import Qwen3MoeModel, weight_bytes
from engine.model.step_kernels import (
    ATTENTION_MERGE,
    FUSIONS,
    GEMV,
    NORM_QKV,
    QKV_EPILOGUE,
    ROUTER,
    StepKernels,
)
from kernels.quant import dequantize, is_quantized


def expected_experts(batch: int, experts: int, top_k: int) -> float:
    """Distinct experts a batch touches when each token picks k of E uniformly."""
    return experts * (1 - (1 - top_k / experts) ** batch)


# Bytes per projection weight, scales included: bf16; FP8 with an fp32 scale per 128x128 block;
# int4 with a bf16 scale per group of 128.
WEIGHT_BYTES = {None: 2.0, "fp8": 1 + 4 / 128**2, "int4": 0.5 + 2 / 128}


def step_bytes(
    cfg, batch: int, context: int, quant: str | None = None, quant_lm_head: bool = False
) -> dict:
    """Bytes one decode step must read, by part (projections, and with `quant_lm_head` the
    lm_head, in `quant`'s format; the rest and the KV in bf16)."""
    h, d, e, w = cfg.hidden_size, cfg.head_dim, 2, WEIGHT_BYTES[quant]
    attn = (cfg.num_heads + 2 * cfg.num_kv_heads) * d * h + h * cfg.num_heads * d
    experts = (
        expected_experts(batch, cfg.num_experts, cfg.num_experts_per_tok)
        * 3
        * h
        * cfg.moe_intermediate_size
    )
    router = cfg.num_experts * h
    kv = batch * (context + 1) * 2 * cfg.num_kv_heads * d
    parts = dict(attention=attn * w, experts=experts * w, router=router * e, kv_cache=kv * e)
    parts = {k: v * cfg.num_layers for k, v in parts.items()}
    parts["lm_head"] = cfg.vocab_size * h * (w if quant_lm_head else e)
    return parts


class Timer:
    """Median seconds of a callable: CUDA events around graph replays, or wall clock on the CPU."""

    def __init__(self, device: str, repeats: int):
        self.cuda = device.startswith("cuda")
        self.repeats = repeats

    def __call__(self, fn) -> float:
        fn()
        if not self.cuda:
            times = []
            for _ in range(max(3, self.repeats // 10)):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            return statistics.median(times)
        torch.cuda.synchronize()
        pairs = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(self.repeats)
        ]
        for start, end in pairs:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in pairs) / 1e3


class Bench:
    def __init__(self, model, pool, timer, log):
        self.model, self.pool, self.timer, self.log = model, pool, timer, log
        self.block_size = pool.block_size

    def tables(self, batch: int, context: int) -> list[list[int]]:
        """Each sequence its own run of blocks, holding context + 1 tokens (the new one)."""
        per = -(-(context + 1) // self.block_size)
        return [list(range(b * per, (b + 1) * per)) for b in range(batch)]

    def step_time(self, graphs: DecodeGraphs, batch: int, context: int) -> float:
        """Seconds of one decode step of `batch` sequences after `context` cached tokens."""
        tokens = torch.randint(0, self.model.config.vocab_size, (batch,)).tolist()
        graphs.run(tokens, [context] * batch, self.tables(batch, context))  # load (and capture)
        rows = min(r for r in graphs.steps if r >= batch)
        graph = graphs.graphs.get(rows)
        return self.timer(graph.replay if graph is not None else graphs.steps[rows])

    def eager_forward_time(self, batch: int, context: int) -> float:
        """The plain forward (torch ops from Python, one launch each), as before the graphs."""
        device = self.model.device
        tables = self.tables(batch, context)
        tokens = torch.randint(0, self.model.config.vocab_size, (batch, 1), device=device)
        positions = torch.full((batch, 1), context, device=device)

        def run():
            self.model.forward(tokens, positions, PagedBatch(self.pool, tables, device))

        timer = Timer(str(device), max(5, self.timer.repeats // 20))
        return timer(run)

    def prefill(self, tokens: int, chunk: int, flash: bool = True):
        """A function that prefills `tokens` random tokens in chunks of `chunk` and returns the
        last logits; `flash`: prompt chunks' attention as flash attention where it applies
        (engine.kv.prefill_attention), else the masked SDPA."""
        device = self.model.device
        table = self.tables(1, tokens)[0]
        gen = torch.Generator(device=device).manual_seed(tokens)
        ids = torch.randint(
            0, self.model.config.vocab_size, (1, tokens), device=device, generator=gen
        )

        def run():
            for start in range(0, tokens, chunk):
                end = min(tokens, start + chunk)
                pos = torch.arange(start, end, device=device)[None]
                view = PagedBatch(self.pool, [table], device, flash_prefill=flash)
                logits = self.model.forward(ids[:, start:end], pos, view, last_only=True)
            run.flash_applied = bool(view.chunk_flash)
            return logits

        return run

    def prefill_time(self, tokens: int, chunk: int, flash: bool = True) -> float:
        return Timer(str(self.model.device), 30)(self.prefill(tokens, chunk, flash))


# Flash and masked prefill attention of one layer: the same sums in another order, in bf16.
PREFILL_AGREEMENT = 1e-2


def prefill_attention_agreement(cfg, tokens: int, dtype, device) -> float:
    """One layer's attention of the last prompt chunk (2,048 queries, or all of a shorter
    prompt) over `tokens` keys, flash against masked SDPA, on random inputs: relative error."""
    from engine.kv.prefill_attention import chunk_attention, masked_attention

    gen = torch.Generator(device=device).manual_seed(11)
    n = min(tokens, 2048)
    d = cfg.head_dim

    def draw(heads, length):
        return torch.randn(1, heads, length, d, generator=gen, device=device).to(dtype)

    q, k, v = draw(cfg.num_heads, n), draw(cfg.num_kv_heads, tokens), draw(cfg.num_kv_heads, tokens)
    positions = torch.arange(tokens - n, tokens, device=device)[None]
    want = masked_attention(q, k, v, positions, None).float()
    return float((chunk_attention(q, k, v).float() - want).norm() / want.norm())


def fill_pool(pool: KVPool, seed: int = 0) -> None:
    gen = torch.Generator(device=pool.keys[0].device).manual_seed(seed)
    for layer in range(len(pool.keys)):
        for store in (pool.keys[layer], pool.values[layer]):
            store.copy_(
                torch.randn(store.shape, generator=gen, device=store.device, dtype=torch.float32)
            )


UNFUSED = StepKernels(fusions=frozenset())
ALL_FUSED = StepKernels(fusions=frozenset(FUSIONS))
# Fusions added one at a time (engine.model.step_kernels), the ones that won on their own
# first; each row timed in its own graph.
FUSION_STEPS = (
    (),
    (ROUTER,),
    (ROUTER, GEMV),
    (ROUTER, GEMV, QKV_EPILOGUE),
    (ROUTER, GEMV, NORM_QKV),
    (ROUTER, GEMV, NORM_QKV, ATTENTION_MERGE),
    FUSIONS,
)


STAGES = ("check", "decode", "split", "variants", "eager", "prefill", "compare")


# A --variants item's knobs after ":" (name=value, joined by ","), and the StepKernels field
# each sets: "router+pdl:splits=16,route_e=4,unlink=moe/projections".
KNOBS = {"splits": "n_splits", "route_e": "router_block_e", "unlink": "unlinked"}


@dataclasses.dataclass(frozen=True)
class Variant:
    """A decode step to time: its fusions, and StepKernels knobs beyond them."""

    fusions: tuple[str, ...]
    knobs: tuple[tuple[str, object], ...] = ()
    spec: str = ""  # as --variants named it

    @property
    def label(self) -> str:
        return self.spec or "+".join(self.fusions) or "unfused"

    def kernels(self) -> StepKernels:
        return StepKernels(fusions=frozenset(self.fusions), **dict(self.knobs))


def parse_variants(spec: str) -> tuple[Variant, ...]:
    """--variants: step variants separated by "|", each its fusions joined by "+" ("unfused"
    for none), as step_variants labels them, then optionally ":" and knobs (KNOBS):
    "unfused|router|router+pdl|router+pdl:splits=16,unlink=moe"."""
    steps = []
    for item in spec.split("|"):
        item = item.strip()
        fusion_part, _, knob_part = item.partition(":")
        names = () if fusion_part == "unfused" else tuple(n.strip() for n in fusion_part.split("+"))
        unknown = set(names) - set(FUSIONS)
        if unknown or not fusion_part:
            raise argparse.ArgumentTypeError(
                f"bad variant {item!r}: fusions are {FUSIONS} (or 'unfused')"
            )
        knobs = []
        for knob in filter(None, knob_part.split(",")):
            key, _, value = knob.partition("=")
            if key not in KNOBS or not value:
                raise argparse.ArgumentTypeError(
                    f"bad variant {item!r}: knobs are {', '.join(f'{k}=...' for k in KNOBS)}"
                )
            if key == "unlink":
                knobs.append((KNOBS[key], frozenset(value.split("/"))))
            else:
                knobs.append((KNOBS[key], int(value)))
        variant = Variant(names, tuple(knobs), item)
        try:
            variant.kernels()
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"bad variant {item!r}: {exc}") from None
        steps.append(variant)
    return tuple(steps)


def step_variants(cfg, batch: int, context: int, variants: tuple[Variant, ...] | None = None):
    """(name, the step's kernels) to time against the default: `variants` (default
    FUSION_STEPS, then all fusions at other attention splits)."""
    from kernels.paged_attention import default_splits

    auto = default_splits(batch, cfg.num_kv_heads, context + 16)
    for variant in variants or [Variant(names) for names in FUSION_STEPS]:
        kernels = variant.kernels()
        yield f"{variant.label} ({kernels.n_splits or auto} splits)", kernels
    if variants:
        return
    for splits in (8, 16, 32):
        if splits != auto:
            yield (
                f"all fusions, attention {splits} splits",
                StepKernels(n_splits=splits, fusions=frozenset(FUSIONS)),
            )


def fused_against_unfused(
    config, quant, dtype, device, batch, context, log, layers=4, variants=()
) -> list:
    """Each fusion alone, the engine's step, all fusions and each of `variants` (the step
    variants a run times) against the unfused step, on a model
    of the shape's widths with `layers` layers: past a few layers a random model's near-tied
    routers amplify rounding until two valid paths part ways, which would hide a wrong kernel.
    Two inputs alternate (A, B, A, B) and B is compared: a kernel reading state a previous
    replay left (stale routing, counters) gives A's answer for B."""
    model = random_model(dict(config, num_hidden_layers=layers), dtype, device, quant=quant)
    cfg = model.config
    per = -(-(context + 1) // 16)
    pool = KVPool(
        cfg.num_layers, per * batch + 1, 16, cfg.num_kv_heads, cfg.head_dim, dtype, device
    )
    fill_pool(pool)
    tables = [list(range(b * per, (b + 1) * per)) for b in range(batch)]
    gen = torch.Generator().manual_seed(batch)
    a, b = (torch.randint(0, cfg.vocab_size, (batch,), generator=gen).tolist() for _ in range(2))

    def logits(kernels):
        graphs = DecodeGraphs(model, pool, context + 16, buckets=(batch,), kernels=kernels)
        runs = [graphs.run(t, [context] * batch, tables)[0].clone() for t in (a, b, a, b)]
        del graphs
        return runs[1], runs[3]

    reference, _ = logits(UNFUSED)
    checks = [(name, StepKernels(fusions=frozenset({name}))) for name in FUSIONS]
    checks += [("engine's step", StepKernels()), ("all fusions", ALL_FUSED)]
    checks += [
        (v.label, v.kernels())
        for v in variants
        if v.knobs or (len(v.fusions) > 1 and set(v.fusions) != set(FUSIONS))
    ]
    rows = []
    for name, kernels in checks:
        first, again = logits(kernels)
        rel = float((first - reference).norm() / reference.norm())
        rows.append(
            dict(
                batch=batch,
                variant=name,
                rel=rel,
                replays_identical=bool(torch.equal(first, again)),
            )
        )
        log(
            f"  B={batch} {name:<16} logits against the unfused step: relative {rel:.2e}; "
            f"the same bits on a later replay: {rows[-1]['replays_identical']}"
        )
    return rows


def zero_moe(x, w_gate_up, w_down, topk_ids, topk_weights):
    return torch.zeros_like(x)


def expert_centric_moe(x, w_gate_up, w_down, topk_ids, topk_weights):
    from kernels.dispatch import EXPERT_CENTRIC, run_path

    return run_path(EXPERT_CENTRIC, x, w_gate_up, w_down, topk_ids, topk_weights)


def skip_attention(q, *args, **kwargs):
    return q


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batches", default="1,4,8")
    ap.add_argument("--contexts", default="1024,4096,16384")
    ap.add_argument("--split-at", default="1,4096", help="batch,context of the stage split")
    ap.add_argument("--prefill", type=int, default=4096, help="prefill prompt length (0: skip)")
    ap.add_argument("--replays", type=int, default=100)
    ap.add_argument("--transformers", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--hf-new-tokens", type=int, default=32)
    ap.add_argument("--hf-contexts", default="1024,4096", help="contexts of transformers' generate")
    ap.add_argument(
        "--quant",
        choices=("fp8", "int4"),
        help="projections quantized by the project's quantizer (FP8 blocks / int4 groups of 128)",
    )
    ap.add_argument(
        "--quant-lm-head",
        action="store_true",
        help="with --quant: the lm_head quantized too (wd-engine quantize --lm-head)",
    )
    ap.add_argument(
        "--stages",
        default=",".join(STAGES),
        help=f"what to run, of {','.join(STAGES)} (check: the fused steps' logits against the "
        "unfused step; compare: the quantized step against bf16 and transformers)",
    )
    ap.add_argument(
        "--variants",
        type=parse_variants,
        help='step variants to time, e.g. "unfused|router|router+pdl|router+pdl:splits=16,'
        'route_e=4,unlink=moe" (default: fusions added one at a time, then all of them at other '
        "attention splits)",
    )
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if args.quant_lm_head and not args.quant:
        ap.error("--quant-lm-head needs --quant")
    stages = set(args.stages.split(","))
    if stages - set(STAGES):
        ap.error(f"unknown stages {sorted(stages - set(STAGES))}; known: {','.join(STAGES)}")

    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    split_batch, split_context = (int(v) for v in args.split_at.split(","))
    results: dict = dict(shape=args.shape, device=args.device)
    out_lines = []

    def log(msg=""):
        print(msg, flush=True)
        out_lines.append(msg)

    def save():
        if args.out:
            args.out.write_text(json.dumps(results, indent=1))

    cuda = args.device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    t0 = time.perf_counter()
    model = random_model(
        SHAPES[args.shape],
        dtype=dtype,
        device=args.device,
        quant=args.quant,
        quant_lm_head=args.quant_lm_head,
    )
    cfg = model.config
    results["quant"] = args.quant
    results["quant_lm_head"] = args.quant_lm_head
    results["weight_bytes"] = weight_bytes(model)
    log(
        f"model {args.shape}: {results['weight_bytes'] / 1e9:.2f} GB of {dtype} weights "
        f"({args.quant or 'unquantized'} projections"
        f"{', lm_head too' if args.quant_lm_head else ''}) "
        f"built in {time.perf_counter() - t0:.1f} s"
    )
    if cuda:
        from kernels.bench.gpu_timing import read_bandwidth

        bw = read_bandwidth()
        results["bandwidth"] = bw
        log(
            f"read bandwidth {bw['read_bytes_per_s'] / 1e12:.2f} TB/s "
            f"(copy {bw['copy_bytes_per_s'] / 1e12:.2f})"
        )
        bandwidth = bw["read_bytes_per_s"]
    else:
        bandwidth = None

    max_context = max(contexts + [split_context, args.prefill])
    per_seq = -(-(max_context + 1) // 16)
    pool = KVPool(
        cfg.num_layers,
        per_seq * max(batches + [split_batch]) + 1,
        16,
        cfg.num_kv_heads,
        cfg.head_dim,
        dtype,
        args.device,
    )
    fill_pool(pool)
    bench = Bench(model, pool, Timer(args.device, args.replays), log)
    graph_tokens = max_context + 16

    # -- the fused step against the unfused one first: timings of a wrong step mean nothing ------
    if "check" in stages:
        log("\nfused steps against the unfused step (4 layers of the shape)")
        results["fused_vs_unfused"] = [
            row
            for batch in sorted({split_batch, *batches})
            for row in fused_against_unfused(
                SHAPES[args.shape],
                args.quant,
                dtype,
                args.device,
                batch,
                split_context,
                log,
                variants=args.variants or (),
            )
        ]
        save()

    # -- decode: the engine's step, warp decode and expert-centric ---------------------------------
    if "decode" in stages:
        log(
            "\ndecode, batch x context: ms per step, tokens/s (all sequences), floor, "
            "fraction of the floor"
        )
        decode = []
        paths = (
            ("warp", None, StepKernels()),  # the engine's step
            ("warp unfused", None, UNFUSED),
            ("warp all fusions", None, ALL_FUSED),
            ("expert_centric", expert_centric_moe, StepKernels()),
        )
        for moe_name, moe_fn, kernels in paths:
            path_model = model.with_options(moe_fn=moe_fn)
            for batch in batches:
                graphs = DecodeGraphs(
                    path_model, pool, graph_tokens, buckets=(batch,), kernels=kernels
                )
                for context in contexts:
                    if moe_name == "expert_centric" and context != split_context:
                        continue  # the comparison of MoE paths at one context is enough
                    seconds = bench.step_time(graphs, batch, context)
                    parts = step_bytes(cfg, batch, context, args.quant, args.quant_lm_head)
                    row = dict(
                        moe=moe_name,
                        batch=batch,
                        context=context,
                        step_ms=seconds * 1e3,
                        tok_s=batch / seconds,
                        bytes=sum(parts.values()),
                        bytes_by_part=parts,
                    )
                    if bandwidth:
                        row["floor_ms"] = row["bytes"] / bandwidth * 1e3
                        row["floor_tok_s"] = batch / (row["bytes"] / bandwidth)
                        row["of_floor"] = row["floor_ms"] / row["step_ms"]
                    decode.append(row)
                    floor = (
                        f"{row['floor_ms']:7.3f} ms {row['floor_tok_s']:7.0f} tok/s "
                        f"{row['of_floor']:5.0%}"
                        if bandwidth
                        else ""
                    )
                    log(
                        f"  {moe_name:>16} B={batch:<2} ctx={context:<6} {row['step_ms']:8.3f} ms "
                        f"{row['tok_s']:8.1f} tok/s  {floor}"
                    )
                del graphs
                results["decode"] = decode
                save()

    # -- where a step's time goes ------------------------------------------------------------------
    if "split" in stages:
        log(
            f"\nsplit of a step at B={split_batch}, ctx={split_context} "
            "(leave a stage out, take differences)"
        )
        split = {}
        for name, moe_fn, attention in (
            ("full", None, None),
            ("no_moe", zero_moe, None),
            ("no_attention", None, skip_attention),
            ("neither", zero_moe, skip_attention),
        ):
            stage_model = model.with_options(moe_fn=moe_fn)
            kernels = StepKernels() if attention is None else StepKernels(attention=attention)
            graphs = DecodeGraphs(
                stage_model, pool, graph_tokens, buckets=(split_batch,), kernels=kernels
            )
            split[name] = bench.step_time(graphs, split_batch, split_context) * 1e3
            del graphs
        split["moe"] = split["full"] - split["no_moe"]
        split["attention"] = split["full"] - split["no_attention"]
        split["rest"] = split["neither"]
        results["split_ms"] = split
        log("  " + ", ".join(f"{k} {v:.3f} ms" for k, v in split.items()))

    # -- kernel choices for the step, side by side (each its own graph) ----------------------------
    if "variants" in stages:
        variants = {}
        # A quantized lm_head's variants are timed again with it in bf16, side by side.
        heads = [("", model)]
        if is_quantized(model.lm_head):
            heads.append((", bf16 lm_head", with_plain_lm_head(model)))
        for batch in sorted({split_batch, *batches}):
            for name, kernels in step_variants(cfg, batch, split_context, args.variants):
                for head, head_model in heads:
                    graphs = DecodeGraphs(
                        head_model, pool, graph_tokens, buckets=(batch,), kernels=kernels
                    )
                    ms = bench.step_time(graphs, batch, split_context) * 1e3
                    variants[f"B{batch} {name}{head}"] = ms
                    log(f"  variant B={batch} ctx={split_context} {name + head:<44} {ms:7.3f} ms")
                    del graphs
        results["step_variants_ms"] = variants
        del heads
        save()

    if "eager" in stages:
        graphs = DecodeGraphs(model, pool, graph_tokens, buckets=(split_batch,), capture=False)
        eager_step = bench.step_time(graphs, split_batch, split_context) * 1e3
        eager_forward = bench.eager_forward_time(split_batch, split_context) * 1e3
        results["eager_ms"] = dict(step_without_graph=eager_step, plain_forward=eager_forward)
        log(
            f"  same step without the graph {eager_step:.2f} ms; "
            f"the plain eager forward {eager_forward:.2f} ms"
        )
        del graphs
        save()

    # -- prefill -----------------------------------------------------------------------------------
    if args.prefill and "prefill" in stages:
        # The two attentions of a prompt chunk side by side (engine.kv.prefill_attention),
        # checked against each other first: flash is timed only where it applies and agrees.
        attention_rel = prefill_attention_agreement(cfg, args.prefill, dtype, args.device)
        with_flash = bench.prefill(args.prefill, 2048, True)
        flash_logits = with_flash()[0, -1].float()
        masked_logits = bench.prefill(args.prefill, 2048, False)()[0, -1].float()
        rel = float((flash_logits - masked_logits).norm() / masked_logits.norm())
        flash_ok = with_flash.flash_applied and attention_rel < PREFILL_AGREEMENT
        prefill = dict(
            flash_applied=with_flash.flash_applied,
            attention_rel=attention_rel,
            logits_rel=rel,
        )
        log(
            f"\nprefill attention, flash against masked SDPA: one layer's output relative "
            f"{attention_rel:.2e}, the model's last logits {rel:.2e}"
            + ("" if with_flash.flash_applied else " (flash does not apply here: not timed)")
            + ("" if attention_rel < PREFILL_AGREEMENT else " DISAGREE: flash not timed")
        )
        for chunk in dict.fromkeys(min(c, args.prefill) for c in (args.prefill, 2048)):
            for flash in (False, True) if flash_ok else (False,):
                seconds = bench.prefill_time(args.prefill, chunk, flash)
                name = f"chunk_{chunk}_{'flash' if flash else 'masked'}"
                prefill[name] = dict(ms=seconds * 1e3, tok_s=args.prefill / seconds)
                log(
                    f"prefill {args.prefill} tokens in chunks of {chunk}, "
                    f"{'flash' if flash else 'masked'} attention: {seconds * 1e3:.1f} ms, "
                    f"{args.prefill / seconds:,.0f} tok/s"
                )
        results["prefill"] = prefill
        save()

    if "compare" in stages and args.quant:
        results["vs_dequantized"] = compare_with_dequantized(model, 16, 64, log)
        save()
    if (
        "compare" in stages and args.transformers and not args.quant
    ):  # transformers runs the dequantized weights
        try:
            results["transformers"] = compare_transformers(
                model, [int(c) for c in args.hf_contexts.split(",")], args.hf_new_tokens, log
            )
        except Exception as exc:  # noqa: BLE001 - the engine's numbers stand without it
            log(f"transformers comparison failed: {type(exc).__name__}: {exc}")
            results["transformers"] = dict(error=f"{type(exc).__name__}: {exc}")
        save()
    if args.out:
        args.out.with_suffix(".txt").write_text("\n".join(out_lines) + "\n")
    return 0


def compare_with_dequantized(model, prompt_tokens: int, positions: int, log) -> dict:
    """The quantized decode step against the engine's bf16 step on the dequantized weights: one
    sequence, `prompt_tokens` random tokens then the quantized model's greedy choices (both
    models see the same tokens), compared at the last `positions` steps. Where the dequantized
    copy of every layer does not fit beside the model (48 layers of the 30B-A3B shape need 61 GB
    more), both models are cut to the first layers that fit, and the output says so."""
    layers = _layers_whose_copy_fits(model)
    if layers < model.config.num_layers:
        log(
            f"the dequantized copy of all {model.config.num_layers} layers does not fit: "
            f"comparing the first {layers}"
        )
        model = Qwen3MoeModel(
            dataclasses.replace(model.config, num_layers=layers),
            model.embed,
            model.layers[:layers],
            model.final_norm,
            model.lm_head,
            model.options,
        )
    plain = model.dequantized()
    cfg, n = model.config, prompt_tokens + positions
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, cfg.vocab_size, (prompt_tokens,), generator=gen).tolist()
    steps = []
    for m in (model, plain):
        pool = KVPool(
            cfg.num_layers, -(-n // 16), 16, cfg.num_kv_heads, cfg.head_dim, m.dtype, m.device
        )
        steps.append(DecodeGraphs(m, pool, n, buckets=(1,), capture=False))
    table = list(range(-(-n // 16)))
    same, max_diff, rel = 0, 0.0, []
    for pos in range(n - 1):  # the logits at pos predict the token at pos + 1
        quantized, reference = (g.run([tokens[pos]], [pos], [table])[0][0].clone() for g in steps)
        if pos + 1 < prompt_tokens:
            continue
        tokens.append(int(quantized.argmax()))
        same += int(quantized.argmax() == reference.argmax())
        max_diff = max(max_diff, float((quantized - reference).abs().max()))
        rel.append(float((quantized - reference).norm() / reference.norm()))
    out = dict(
        positions=positions,
        layers=cfg.num_layers,
        argmax_same=same,
        max_logit_diff=max_diff,
        rel=max(rel),
    )
    log(
        f"quantized step vs bf16 on the dequantized weights: argmax same at {same}/{positions} "
        f"positions; max |logit diff| {max_diff:.4f}, largest relative {max(rel):.2e}"
    )
    del plain, steps
    return out


def with_plain_lm_head(model: Qwen3MoeModel) -> Qwen3MoeModel:
    """The model (its weights shared) with its quantized lm_head dequantized to its dtype."""
    return Qwen3MoeModel(
        model.config,
        model.embed,
        model.layers,
        model.final_norm,
        dequantize(model.lm_head, model.dtype),
        model.options,
    )


def _layers_whose_copy_fits(model, margin_bytes: int = 4 << 30) -> int:
    """How many of the model's first layers a dequantized copy can hold in the GPU's free
    memory (all of them off the GPU)."""
    if model.device.type != "cuda":
        return model.config.num_layers
    torch.cuda.empty_cache()
    free = torch.cuda.mem_get_info(model.device)[0] - margin_bytes
    per_layer = max(
        sum(
            math.prod(w.shape) * model.dtype.itemsize
            for w in vars(layer).values()
            if is_quantized(w)
        )
        for layer in model.layers
    )
    lm_head = model.lm_head
    lm_head = math.prod(lm_head.shape) * model.dtype.itemsize if is_quantized(lm_head) else 0
    return max(1, min(model.config.num_layers, int((free - lm_head) // max(1, per_layer))))


def hf_model_on_engine_weights(model):
    """transformers' Qwen3MoeForCausalLM whose parameters are views of the engine's tensors."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = model.config
    raw = dict(cfg.raw) if hasattr(cfg, "raw") else None
    hf_config = Qwen3MoeConfig(**(raw or _config_dict(cfg)))
    with torch.device("meta"):
        hf = Qwen3MoeForCausalLM(hf_config)
    d = cfg.head_dim
    hq, hkv = cfg.num_heads * d, cfg.num_kv_heads * d
    state = {
        "model.embed_tokens.weight": model.embed,
        "model.norm.weight": model.final_norm,
        "lm_head.weight": model.lm_head,
    }
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        q, k, v = layer.w_qkv.split([hq, hkv, hkv])
        state.update(
            {
                p + "input_layernorm.weight": layer.input_norm,
                p + "post_attention_layernorm.weight": layer.post_attention_norm,
                p + "self_attn.q_proj.weight": q,
                p + "self_attn.k_proj.weight": k,
                p + "self_attn.v_proj.weight": v,
                p + "self_attn.o_proj.weight": layer.w_o,
                p + "self_attn.q_norm.weight": layer.q_norm,
                p + "self_attn.k_norm.weight": layer.k_norm,
                p + "mlp.gate.weight": layer.router,
                p + "mlp.experts.gate_up_proj": layer.w_gate_up,
                p + "mlp.experts.down_proj": layer.w_down,
            }
        )
    hf.load_state_dict(state, assign=True, strict=False)
    # Buffers made on the meta device (RoPE's inverse frequencies) are rebuilt on the real one.
    with torch.device(model.device):
        hf.model.rotary_emb = type(hf.model.rotary_emb)(hf_config)
    hf.eval()
    return hf


def _config_dict(cfg) -> dict:
    return dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        moe_intermediate_size=cfg.moe_intermediate_size,
        num_experts=cfg.num_experts,
        num_experts_per_tok=cfg.num_experts_per_tok,
        norm_topk_prob=cfg.norm_topk_prob,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=False,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )


@torch.inference_mode()
def compare_transformers(model, contexts, new_tokens, log) -> dict:
    hf = hf_model_on_engine_weights(model)
    device = model.device
    vocab = model.config.vocab_size
    gen = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.randint(0, vocab, (1, 64), generator=gen).to(device)
    ours = model.forward(ids, torch.arange(64, device=device)[None], model.new_cache(1, 128))[
        0
    ].float()
    theirs = hf(ids).logits[0].float()
    rel = ((ours - theirs).abs().max() / theirs.abs().max()).item()
    agree = (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item()
    out = dict(logits_max_rel_diff=rel, argmax_agreement=agree, generate=[])
    log(
        f"\ntransformers on the same weights: logits max rel diff {rel:.2e}, "
        f"argmax agreement {agree:.0%} (64 tokens)"
    )
    for context in contexts:
        prompt = torch.randint(0, vocab, (1, context), generator=gen).to(device)
        timings = {}
        for n in (1, 1 + new_tokens):
            kwargs = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
            hf.generate(prompt, **kwargs)  # warm-up
            _sync(device)
            t0 = time.perf_counter()
            hf.generate(prompt, **kwargs)
            _sync(device)
            timings[n] = time.perf_counter() - t0
        rate = new_tokens / (timings[1 + new_tokens] - timings[1])
        out["generate"].append(
            dict(context=context, decode_tok_s=rate, first_token_ms=timings[1] * 1e3)
        )
        log(
            f"  transformers generate, B=1 ctx={context}: {rate:.1f} tok/s decode, "
            f"first token {timings[1] * 1e3:.0f} ms"
        )
    del hf
    return out


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


if __name__ == "__main__":
    sys.exit(main())
