"""`wd-engine`: the engine's command line."""

from __future__ import annotations

import argparse
import sys
import time

from engine.models import default_model_dir


def _generate(args: argparse.Namespace) -> int:
    # Heavy imports here, not at module level, so `wd-engine --help` stays instant.
    from engine.config import ModelFormatError
    from engine.fim import FimUnsupported, build_fim_prompt
    from engine.generate import PromptTooLong, generate
    from engine.loader import load_model
    from engine.tokenizer import Tokenizer

    model_dir = args.model or default_model_dir()
    try:
        t0 = time.perf_counter()
        model = load_model(model_dir, dtype=args.dtype, device=args.device)
        tokenizer = Tokenizer.from_dir(model_dir, extra_eos_ids=model.config.eos_token_ids)
        load_s = time.perf_counter() - t0
        if args.moe_path:
            model.moe_path = args.moe_path
        if args.fim_prefix is not None or args.fim_suffix is not None:
            prompt_ids = build_fim_prompt(tokenizer, args.fim_prefix or "", args.fim_suffix or "", args.fim_order)
        elif args.prompt is not None:
            prompt_ids = tokenizer.encode(args.prompt)
        else:
            print("wd-engine generate: give --prompt TEXT or --fim-prefix/--fim-suffix", file=sys.stderr)
            return 2
        stream = generate(
            model,
            tokenizer,
            prompt_ids,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            seed=args.seed,
            stop=args.stop or (),
        )
        for delta in stream:
            sys.stdout.write(delta)
            sys.stdout.flush()
        if args.newline:
            sys.stdout.write("\n")
    except (ModelFormatError, FimUnsupported, PromptTooLong, ValueError) as exc:
        print(f"wd-engine: {exc}", file=sys.stderr)
        return 1
    if args.stats:
        s = stream.stats
        print(
            f"[load {load_s * 1000:.0f} ms | prompt {s.prompt_tokens} tok, prefill {s.prefill_s * 1000:.1f} ms | "
            f"{s.completion_tokens} tok, decode {s.decode_tokens_per_s:.1f} tok/s | finish: {s.finish_reason}]",
            file=sys.stderr,
        )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="wd-engine", description="The wd-lsp inference engine.")
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="complete a prompt and print only the new text")
    gen.add_argument("--model", help="Hugging Face model folder (default: the embedded model, or $WD_LSP_MODEL)")
    gen.add_argument("--prompt", help="plain text prompt")
    gen.add_argument("--fim-prefix", help="text before the cursor (builds a FIM prompt)")
    gen.add_argument("--fim-suffix", help="text after the cursor (builds a FIM prompt)")
    gen.add_argument("--fim-order", choices=("psm", "spm"), default="psm")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto")
    gen.add_argument("--device", default="cpu")
    gen.add_argument("--moe-path", choices=("auto", "expert_centric", "output_centric"))
    gen.add_argument("--stats", action="store_true", help="print timings to stderr")
    gen.add_argument("--newline", action="store_true", help="end the output with a newline")
    gen.set_defaults(run=_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
