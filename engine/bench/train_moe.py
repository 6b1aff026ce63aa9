"""The training model's MoE layer in each of its forms (engine/train/model.py, `MOE_FORMS`):
forward and backward of one layer on a training micro-batch, bf16 autocast as the trainer runs,
eager and compiled, after checking that every form gives the sparse form's output and gradients.

    python -m engine.bench.train_moe --config shape.json --tokens 131072 --out train_moe.json
    python -m engine.bench.train_moe --device cpu --tokens 256   # the checks only

`--config` is a model config.json (`python -m engine.bench.cpu_shapes --config NAME` prints one);
`--int4-group` / `--fp8-block` time the layer training through that rounding, as the run will.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from engine.train.model import MOE_FORMS, SparseMoe

# bf16 products summed in other orders differ by about 1e-2 of the largest value; a wrong form
# by far more.
MAX_DIFFERENCE = 5e-2
DEFAULT_CONFIG = {
    "hidden_size": 512,
    "num_experts": 16,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 384,
    "norm_topk_prob": True,
}


def layers(config: dict, forms, device, int4_group, fp8_block, seed: int = 0) -> dict:
    """One layer per form, all holding the same random weights (never zeros)."""
    gen = torch.Generator().manual_seed(seed)
    built = {}
    for form in forms:
        layer = SparseMoe(config, form)
        for m in layer.modules():
            if hasattr(m, "int4_group"):
                m.int4_group, m.fp8_block = int4_group, fp8_block
        built[form] = layer
    for name, p in built[forms[0]].named_parameters():
        value = torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5
        for layer in built.values():
            layer.get_parameter(name).data.copy_(value)
    return {form: layer.to(device) for form, layer in built.items()}


def step(layer, x, grad, autocast):
    """Forward and backward, the input's gradient too (x requires it, as a layer's input does)."""
    x.grad = None  # the last step's, not summed into
    with autocast:
        y, aux = layer(x)
    (y.float() * grad).sum().add(aux).backward()
    return y


def check(built: dict, x, grad, autocast) -> dict:
    """Largest difference from the sparse form, relative to the sparse form's largest value."""
    want = {}
    out = {}
    for form, layer in built.items():
        xf = x.detach().clone().requires_grad_()
        y = step(layer, xf, grad, autocast).detach().float()
        grads = {n: p.grad.float() for n, p in layer.named_parameters() if p.grad is not None}
        grads["x"] = xf.grad.float()
        layer.zero_grad(set_to_none=True)
        if not want:
            want = {"y": y, **grads}
            continue
        got = {"y": y, **grads}
        out[form] = max(
            float((got.get(k, torch.zeros_like(v)) - v).abs().max() / v.abs().max())
            for k, v in want.items()
            if v.abs().max() > 0
        )
    return out


def time_ms(fn, iters: int, device) -> float:
    for _ in range(3):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", type=Path, help="a model config.json (default: h512, 16 experts)")
    ap.add_argument("--tokens", type=int, default=131072, help="a micro-batch: rows x length")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--forms", default=",".join(MOE_FORMS))
    ap.add_argument("--int4-group", type=int)
    ap.add_argument("--fp8-block", type=int)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    config = json.loads(args.config.read_text()) if args.config else DEFAULT_CONFIG
    device = torch.device(args.device)
    forms = args.forms.split(",")
    if forms[0] != "sparse":
        forms = ["sparse", *[f for f in forms if f != "sparse"]]
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(args.tokens, config["hidden_size"], generator=gen).to(device).requires_grad_()
    grad = torch.randn(args.tokens, config["hidden_size"], generator=gen).to(device)
    # The sparse form's weights in fp32 and bf16 products: the checks compare in bf16 autocast
    # with a small batch, where every form runs the same products.
    built = layers(config, forms, device, args.int4_group, args.fp8_block)
    small = min(args.tokens, 4096)
    result = {
        "config": {k: config[k] for k in DEFAULT_CONFIG},
        "tokens": args.tokens,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "int4_group": args.int4_group,
        "fp8_block": args.fp8_block,
        "max_relative_difference_from_sparse": check(built, x[:small], grad[:small], autocast),
        "ms": {},
    }
    differences = result["max_relative_difference_from_sparse"]
    print(json.dumps(differences), flush=True)
    if any(d > MAX_DIFFERENCE for d in differences.values()):
        print(f"a form differs from the sparse one by more than {MAX_DIFFERENCE}: not timed")
        return 1
    if device.type == "cuda":
        for form, layer in built.items():
            runs = {"eager": lambda layer=layer: step(layer, x, grad, autocast)}
            if not args.no_compile and form != "sparse":  # the sparse form syncs by design
                compiled = torch.compile(layer)
                runs["compiled"] = lambda c=compiled: step(c, x, grad, autocast)
            for mode, fn in runs.items():
                try:
                    result["ms"][f"{form}_{mode}"] = time_ms(fn, args.iters, device)
                except Exception as exc:  # noqa: BLE001 - reported, the other forms go on
                    result["ms"][f"{form}_{mode}"] = f"failed: {type(exc).__name__}: {exc}"[:300]
                print(form, mode, result["ms"][f"{form}_{mode}"], flush=True)
                layer.zero_grad(set_to_none=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
