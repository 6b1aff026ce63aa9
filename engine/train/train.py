"""Train the default model on one GPU within a wall-clock budget, resumable across runs.

    python -m engine.train.train --corpus .corpus --model-dir engine/models/wd-coder-tiny \\
        --out OUT_DIR --budget-s 450 [--resume PREV_OUT/ckpt]

The learning rate warms up, stays flat and decays linearly (to --final-lr-frac of its peak, 10% by
default) over the last --decay-frac of this run's wall-clock budget, so the run sizes itself to
whatever throughput the machine gives. Progress (loss, router balance loss, tokens/s) is printed
as it goes and appended to OUT/log.jsonl together with the held-out loss and bits per byte; the
checkpoint is rewritten every --save-every-s.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from . import checkpoint, compile_cache
from .config import load_config
from .data import (
    CHUNK_CHARS,
    PackedStream,
    chunk_doc,
    heldout_fim_rows,
    heldout_rows,
    load_tokenizer,
    read_docs,
)
from .export import quant_flags_error
from .grow import add_experts, copy_sources, expert_count, expert_width, router_loads, widen_experts
from .model import MOE_FORMS, Qwen3MoeLM


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--corpus", type=Path, default=Path(".corpus"))
    ap.add_argument(
        "--model-dir", type=Path, required=True, help="holds config.json and tokenizer.json"
    )
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument(
        "--compile-cache",
        type=Path,
        help="torch.compile's artifacts: loaded before the first step if the file exists, "
        "written after it (engine.train.compile_cache); with --compile only",
    )
    ap.add_argument(
        "--resume",
        type=Path,
        help="a checkpoint folder written by an earlier run, or an exported "
        "model folder (model.safetensors + training_state.json)",
    )
    ap.add_argument(
        "--widen-experts",
        type=int,
        help="grow the resumed model's experts to this intermediate "
        "size, keeping its function (engine/train/grow.py)",
    )
    ap.add_argument(
        "--add-experts",
        type=int,
        help="grow the resumed model to this many experts per layer, "
        "copies of the busiest with near-zero router rows (engine/train/grow.py)",
    )
    ap.add_argument(
        "--fp8-block",
        type=int,
        help="train through FP8 rounding of the projections with this block "
        "size, as `export --fp8-block` will ship them (quantization-aware training)",
    )
    ap.add_argument(
        "--int4-group",
        type=int,
        help="train through int4 rounding of the projections with this "
        "group size, as `export --int4-group` will ship them (quantization-aware training)",
    )
    ap.add_argument(
        "--budget-s", type=float, default=450.0, help="training wall-clock for this run"
    )
    ap.add_argument("--max-steps", type=int, default=10**9)
    ap.add_argument(
        "--seq-len",
        type=int,
        default=1024,
        help="row length in tokens; export declares the longest a model trained on as its context",
    )
    ap.add_argument(
        "--chunk-chars",
        type=int,
        default=CHUNK_CHARS,
        help="documents are cut into pieces of about this many characters, one example each: "
        "a FIM example's prefix and suffix together stay within it (about 2.9 x --seq-len, as the "
        "default 3,000 for 1,024: a FIM example longer than a row loses its end)",
    )
    ap.add_argument("--batch-rows", type=int, default=256)
    ap.add_argument("--micro-rows", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup-steps", type=int, default=150)
    ap.add_argument(
        "--decay-frac", type=float, default=0.25, help="share of the budget spent decaying the lr"
    )
    ap.add_argument(
        "--final-lr-frac",
        type=float,
        default=0.1,
        help="where the decay ends, as a share of --lr (a run that anneals for good: near 0)",
    )
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--aux-coef", type=float, default=0.01)
    ap.add_argument("--workers", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--eval-every-s", type=float, default=90.0)
    ap.add_argument("--save-every-s", type=float, default=120.0)
    ap.add_argument("--heldout-rows", type=int, default=64)
    ap.add_argument(
        "--heldout-fim-rows",
        type=int,
        default=256,
        help="single-line SPM examples for the held-out FIM loss",
    )
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--moe",
        choices=["auto", *MOE_FORMS],
        default="auto",
        help="expert arithmetic, the same function in every form (auto: grouped on a Hopper or "
        "newer GPU, dense on an older one, sparse on the CPU)",
    )
    ap.add_argument(
        "--compile",
        choices=["auto", "on", "off"],
        default="auto",
        help="torch.compile the training step (auto: on a GPU)",
    )
    args = ap.parse_args(argv)
    if error := quant_flags_error(args.fp8_block, args.int4_group):
        ap.error(error)
    if not 0.0 <= args.final_lr_frac <= 1.0:
        ap.error("--final-lr-frac must be within [0, 1]")
    on_gpu = args.device.startswith("cuda")
    if args.moe == "auto":
        args.moe = default_moe_form(args.device)
    args.compile = args.compile == "on" or (args.compile == "auto" and on_gpu)
    return args


def default_moe_form(device: str) -> str:
    """The fastest form measured (BENCHMARKS.md, "The MoE layer's training forms"): grouped where
    torch's grouped GEMM has its Hopper kernels, dense on older GPUs, sparse on the CPU (the
    compiled forms pay only on a GPU)."""
    if not device.startswith("cuda"):
        return "sparse"
    return "grouped" if torch.cuda.get_device_capability(device) >= (9, 0) else "dense"


def train_files(corpus: Path) -> list[Path]:
    """train.jsonl plus any other train-*.jsonl (a part built on the GPU machine itself)."""
    files = sorted(corpus.glob("train*.jsonl"))
    if not files:
        raise SystemExit(f"no train*.jsonl in {corpus}")
    return files


def lr_at(step: int, frac: float, args) -> float:
    warm = min(1.0, (step + 1) / args.warmup_steps)
    decay = min(1.0, max(0.0, (1.0 - frac) / args.decay_frac))
    end = args.final_lr_frac
    return args.lr * warm * (end + (1.0 - end) * decay)


def lm_loss(model, rows):
    """Next-token loss of [B, T + 1] rows and the router balance loss; compiled as one graph so the
    [B*T, vocab] logits never reach memory in fp32."""
    logits, aux = model(rows[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1).float(), rows[:, 1:].flatten()), aux


def make_optimizer(model, args):
    decay = [p for n, p in model.named_parameters() if p.ndim == 2 and "embed_tokens" not in n]
    no_decay = [
        p for n, p in model.named_parameters() if not (p.ndim == 2 and "embed_tokens" not in n)
    ]
    groups = [
        {"params": decay, "weight_decay": args.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=args.device.startswith("cuda")
    )


@torch.no_grad()
def heldout_eval(model, rows, byte_lens, device, autocast, fim_sets: dict | None = None) -> dict:
    """Left-to-right loss and bits per byte on held-out rows, and per FIM set (name -> rows, mask)
    on the middles of held-out single-line SPM examples (what a completion predicts): `NAME_loss`,
    and `NAME_exact`, the share of examples whose every middle token and end is the argmax, at one
    forward pass each. That is greedy exact match without healing, save that greedy also counts a
    different split of the same text and a newline instead of <|endoftext|> at the end, and the
    eval stops a single line at 24 new tokens."""
    model.eval()
    nats, tokens = 0.0, 0
    for i in range(0, len(rows), 16):
        batch = rows[i : i + 16].to(device)
        with autocast:
            logits, _ = model(batch[:, :-1])
        nats += F.cross_entropy(
            logits.float().flatten(0, 1), batch[:, 1:].flatten(), reduction="sum"
        ).item()
        tokens += batch[:, 1:].numel()
    result = {
        "heldout_loss": nats / tokens,
        "heldout_bpb": nats / math.log(2) / int(byte_lens.sum()),
    }
    for name, (fim_rows, fim_mask) in (fim_sets or {}).items():
        if not len(fim_rows):
            continue
        fim_nats, fim_tokens, exact = 0.0, 0, 0
        for i in range(0, len(fim_rows), 16):
            batch, mask = fim_rows[i : i + 16].to(device), fim_mask[i : i + 16].to(device)
            with autocast:
                logits, _ = model(batch[:, :-1])
            losses = F.cross_entropy(
                logits.float().flatten(0, 1), batch[:, 1:].flatten(), reduction="none"
            )
            fim_nats += losses[mask.flatten()].sum().item()
            fim_tokens += int(mask.sum())
            exact += int(((logits.argmax(-1) == batch[:, 1:]) | ~mask).all(dim=1).sum())
        result[f"{name}_loss"] = fim_nats / fim_tokens
        result[f"{name}_exact"] = exact / len(fim_rows)
    model.train()
    return result


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    device = args.device
    config = load_config(args.model_dir)
    tok_path = args.model_dir / "tokenizer.json"
    args.out.mkdir(parents=True, exist_ok=True)

    state = {"step": 0, "tokens_seen": 0, "train_seconds": 0.0, "runs": []}
    run = {}
    weights = checkpoint.load_weights(args.resume) if args.resume else None
    if weights:  # a grown run's sizes differ from config.json
        config = {
            **config,
            "moe_intermediate_size": expert_width(weights),
            "num_experts": expert_count(weights),
        }
    width, count = config["moe_intermediate_size"], config["num_experts"]
    if args.widen_experts and args.widen_experts < width:  # refused before any data is read
        raise SystemExit(
            f"--widen-experts {args.widen_experts} is narrower than the experts ({width})"
        )
    if args.add_experts and args.add_experts < count:
        raise SystemExit(f"--add-experts {args.add_experts} is fewer than the experts ({count})")
    # The held-out rows come first: adding experts measures the router's loads on them.
    held_docs, tokenizer = read_docs(args.corpus / "heldout.jsonl"), load_tokenizer(tok_path)
    held_rows, held_bytes = heldout_rows(held_docs, tokenizer, args.seq_len, args.heldout_rows)
    if args.widen_experts and args.widen_experts != width:
        if weights:
            weights = widen_experts(
                weights, args.widen_experts, std=config["initializer_range"], seed=args.seed
            )
            run["widened_experts"] = [width, args.widen_experts]
            print(f"experts widened {width} -> {args.widen_experts}", flush=True)
        config = {**config, "moe_intermediate_size": args.widen_experts}
    if args.add_experts and args.add_experts != count:
        if weights:
            before = Qwen3MoeLM(config)
            before.load_state_dict({k: v.float() for k, v in weights.items()})
            loads = router_loads(before, held_rows[:8])
            weights = add_experts(weights, args.add_experts, loads, seed=args.seed)
            run["added_experts"] = [count, args.add_experts]
            print(
                f"experts added {count} -> {args.add_experts}, copies of these by layer: "
                f"{copy_sources(loads, args.add_experts - count)}",
                flush=True,
            )
        config = {**config, "num_experts": args.add_experts}
    model = Qwen3MoeLM(config, moe=args.moe)
    if args.fp8_block:
        model.set_fp8_training(args.fp8_block)
        run["fp8_block"] = args.fp8_block
    if args.int4_group:
        model.set_int4_training(args.int4_group)
        run["int4_group"] = args.int4_group
    if args.resume:
        model.load_state_dict({k: v.float() for k, v in weights.items()})
        state = checkpoint.load_state(args.resume)
        prev_log = checkpoint.previous_log(args.resume)
        if prev_log:
            (args.out / "log.jsonl").write_text(prev_log.read_text())
        print(f"resumed at step {state['step']}, {state['tokens_seen']:,} tokens", flush=True)
    else:
        model.init_weights(args.seed)
    model.to(device)
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"params {n_params:,}; device {device}; moe {args.moe}; compile {args.compile}",
        flush=True,
    )
    # The compiled step shares the module's parameters; checkpoints and evals use the plain module.
    step_loss = torch.compile(lm_loss) if args.compile else lm_loss
    cache_path = args.compile_cache if args.compile else None  # nothing to cache uncompiled
    if cache_path:
        print(compile_cache.load(cache_path), flush=True)

    t_load = time.time()
    files = train_files(args.corpus)
    chunks = [c for f in files for d in read_docs(f) for c in chunk_doc(d, args.chunk_chars)]
    # The middle's loss with the indentation in the prefix, and with it moved into the middle as
    # healing prompts.
    fim_sets = {
        name: heldout_fim_rows(
            held_docs, tokenizer, args.seq_len, args.heldout_fim_rows, healed=healed
        )
        for name, healed in (("heldout_fim", False), ("heldout_fim_healed", True))
    }
    print(
        f"{len(chunks):,} train chunks from {', '.join(f.name for f in files)}, "
        f"{len(held_rows)} held-out rows ({time.time() - t_load:.1f}s)",
        flush=True,
    )
    # A resumed run draws a fresh shuffle and fresh FIM spans instead of replaying the first run's.
    stream = PackedStream(
        chunks, tok_path, args.seq_len, args.micro_rows, seed=args.seed + state["step"]
    )
    loader = torch.utils.data.DataLoader(
        stream,
        batch_size=None,
        num_workers=args.workers,
        pin_memory=device.startswith("cuda"),
        prefetch_factor=4 if args.workers else None,
        persistent_workers=bool(args.workers),
    )
    batches = iter(loader)

    opt = make_optimizer(model, args)
    autocast = torch.autocast(
        device_type="cuda" if device.startswith("cuda") else "cpu", dtype=torch.bfloat16
    )
    accum = args.batch_rows // args.micro_rows
    log_f = open(args.out / "log.jsonl", "a")
    run = {
        **run,
        "start_step": state["step"],
        "budget_s": args.budget_s,
        "batch_tokens": args.batch_rows * args.seq_len,
        "seq_len": args.seq_len,
        "chunk_chars": args.chunk_chars,
        "train_files": [f.name for f in files],
        "peak_lr": args.lr,
    }

    def log(record: dict) -> None:
        log_f.write(json.dumps(record) + "\n")
        log_f.flush()

    def save(until: float | None = None) -> None:
        """Record this run as it stands: a run cut off mid-way still has its time and steps."""
        seconds = (until or time.time()) - t0
        checkpoint.save(
            model,
            {
                **state,
                "train_seconds": state["train_seconds"] + seconds,
                "runs": state["runs"] + [{**run, "end_step": state["step"]}],
            },
            args.out / "ckpt",
            config,
        )

    t0 = last_eval = last_save = time.time()
    window_tokens, window_t = 0, time.time()
    step0 = state["step"]
    while True:
        elapsed = time.time() - t0
        frac = elapsed / args.budget_s
        if frac >= 1.0 or state["step"] - step0 >= args.max_steps:
            break
        lr = lr_at(state["step"] - step0, frac, args)
        for g in opt.param_groups:
            g["lr"] = lr
        loss_sum = aux_sum = 0.0
        for _ in range(accum):
            rows = next(batches).to(device, non_blocking=True)
            with autocast:
                loss, aux = step_loss(model, rows)
            ((loss + args.aux_coef * aux) / accum).backward()
            loss_sum += loss.detach()
            aux_sum += aux.detach()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        state["step"] += 1
        state["tokens_seen"] += args.batch_rows * args.seq_len
        window_tokens += args.batch_rows * args.seq_len
        if cache_path and state["step"] == step0 + 1:
            # The forward and backward are compiled by now: what the next stint can reuse.
            print(compile_cache.save(cache_path), flush=True)

        if state["step"] % args.log_every == 0 or state["step"] - step0 <= 3:
            now = time.time()
            rec = {
                "step": state["step"],
                "tokens_seen": state["tokens_seen"],
                "loss": float(loss_sum) / accum,
                "aux": float(aux_sum) / accum,
                "lr": lr,
                "grad_norm": float(grad_norm),
                "tok_per_s": window_tokens / (now - window_t),
                "elapsed_s": now - t0,
            }
            window_tokens, window_t = 0, now
            log(rec)
            print(
                " ".join(
                    f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in rec.items()
                ),
                flush=True,
            )
        if time.time() - last_eval > args.eval_every_s:
            rec = {
                "step": state["step"],
                "tokens_seen": state["tokens_seen"],
                **heldout_eval(model, held_rows, held_bytes, device, autocast, fim_sets),
            }
            log(rec)
            print("eval", rec, flush=True)
            last_eval = time.time()
        if time.time() - last_save > args.save_every_s:
            save()
            last_save = time.time()

    train_end = time.time()
    final = {
        "step": state["step"],
        "tokens_seen": state["tokens_seen"],
        "final": True,
        **heldout_eval(model, held_rows, held_bytes, device, autocast, fim_sets),
    }
    log(final)
    print("final", final, flush=True)
    state["final_heldout"] = final
    save(until=train_end)
    log_f.close()
    try:
        from .plot import plot_loss

        plot_loss(args.out / "log.jsonl", args.out / "loss.png")
    except Exception as e:  # matplotlib is optional; the curve can be drawn later from log.jsonl
        print("no plot:", e, flush=True)
    print("done", flush=True)


if __name__ == "__main__":
    main()
