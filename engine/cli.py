"""`wd-engine`: the engine's command line."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from engine.ipc.token_files import TokenFileError, read_token_file, runtime_token
from engine.models import ModelNotFound, default_model_dir, display_name, resolve_model

LOOPBACK = ("127.0.0.1", "::1", "localhost")


def _generate(args: argparse.Namespace) -> int:
    # Heavy imports here, not at module level, so `wd-engine --help` stays instant.
    import logging

    from engine.core.engine import Engine
    from engine.core.request import Request, RequestFailed
    from engine.loading import memory
    from engine.loading.loader import load_model
    from engine.loading.tokenizer import Tokenizer
    from engine.model.config import ModelFormatError
    from engine.prompts.fim import FimUnsupported, build_fim_prompt, healed_text
    from engine.prompts.layout import supported_fim_orders

    try:
        model_dir = _model_dir(args.model)
        t0 = time.perf_counter()
        args.device = resolve_device(args.device)
        options = model_options(
            args.device, args.moe_path, args.cpu_decode_weights, args.cpu_decode_guard
        )
        log = logging.getLogger("wd_engine")  # generate sets no handler: warnings go to stderr
        memory.check_before_load(
            args.device, args.gpu_memory_gb, log, model_dir=model_dir, dtype=args.dtype
        )
        model = load_model(model_dir, dtype=args.dtype, device=args.device, options=options)
        tokenizer = Tokenizer.from_dir(model_dir, extra_eos_ids=model.config.eos_token_ids)
        if args.fim_prefix is not None or args.fim_suffix is not None:
            order = args.fim_order
            # The model's cache-friendly suffix-first order when it was trained with it.
            if order == "auto":
                order = "spm" if "spm" in supported_fim_orders(model_dir) else "psm"
            prompt_ids = build_fim_prompt(
                tokenizer, args.fim_prefix or "", args.fim_suffix or "", order, heal=True
            )
            forced_text = healed_text(tokenizer, args.fim_prefix or "")
        elif args.prompt is not None:
            prompt_ids, forced_text = tokenizer.encode_prompt(args.prompt), ""
        else:
            print(
                "wd-engine generate: give --prompt TEXT or --fim-prefix/--fim-suffix",
                file=sys.stderr,
            )
            return 2
        request = Request(
            prompt_ids,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            seed=args.seed,
            stop=tuple(args.stop or ()),
            forced_text=forced_text,
            beams=args.beams,
        )
        # The engine's start (on the CPU the lean decode step's weight copies) counts as load.
        engine = Engine.for_one_request(model, tokenizer, request)
        load_s = time.perf_counter() - t0
        reader_gone = []

        def write_delta(event) -> None:
            if event.kind != "delta" or reader_gone:
                return
            try:
                sys.stdout.write(event.text)
                sys.stdout.flush()
            except BrokenPipeError:  # the reader stopped (`| head`): nothing more to decode
                reader_gone.append(True)
                engine.cancel(request.id)

        done = engine.complete(request, write_delta).check()
        if reader_gone:
            return _reader_gone()
        if args.newline:
            sys.stdout.write("\n")
        if args.stats:
            if done.text and not done.text.endswith("\n") and not args.newline:
                sys.stdout.write("\n")  # keep the timings off the completion's last line
            sys.stdout.flush()
            print(_stats_line(load_s, done), file=sys.stderr)
    except (ModelFormatError, FimUnsupported, RequestFailed, ValueError, ModelNotFound) as exc:
        print(f"wd-engine: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        return _reader_gone()
    return 0


def _model_dir(name: str | None) -> Path:
    """The folder of `--model` (engine.models.resolve_model), else the default model's."""
    return resolve_model(name) if name else default_model_dir()


def _reader_gone() -> int:
    """Standard output's reader closed the pipe: point stdout at the null device, so that the
    interpreter's flush at exit does not fail again, and exit 1 as an unhandled EPIPE would."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return 1


def _stats_line(load_s: float, done) -> str:
    """`generate --stats`: load, prefill and first token, and the decode rate (the tokens after
    the first over the time from the prompt's end to the request's), from the completion's
    usage."""
    usage = done.usage
    first_ms = usage["first_token_ms"] or usage["total_ms"]
    decode_s = usage["decode_ms"] / 1000
    rate = max(len(done.token_ids) - 1, 0) / decode_s if decode_s > 0 else 0.0
    return (
        f"[load {load_s * 1000:.0f} ms | prompt {usage['prompt_tokens']} tok, "
        f"prefill {usage['prefill_ms']:.1f} ms, first token {first_ms:.1f} ms | "
        f"{done.completion_tokens} tok, decode {rate:.1f} tok/s | finish: {done.finish_reason}]"
    )


DEVICE_HELP = "cpu, cuda or cuda:N; auto (the default): the GPU where torch sees one, else the CPU"


def resolve_device(name: str) -> str:
    """`auto`: CUDA where torch has a GPU, else the CPU (the daemon an editor starts then uses
    the user's GPU without a setting); anything else as given."""
    if name != "auto":
        return name
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def kv_pool_bytes(requested_mb: int | None, model, budget=None, kv_fp8: bool = False) -> int:
    """The KV pool's size: as asked, else 256 MB on the CPU (tens of thousands of tokens for small
    models) or half of the GPU memory left after the weights (a 30B MoE caches ~100 KB a token).
    Under --gpu-memory-gb (`budget`, engine.loading.memory): as asked if it fits, else what the
    cap leaves after the weights and the activations' reserve."""
    device = model.device
    if budget is not None and budget.capped:
        from engine.loading import memory

        per_token = memory.kv_bytes_per_token(model.config, model.dtype, kv_fp8)
        return memory.capped_kv_pool_bytes(
            budget,
            memory.gpu_bytes_in_use(device),
            None if requested_mb is None else requested_mb << 20,
            memory.MIN_KV_TOKENS * per_token,
        )
    if requested_mb is not None:
        return requested_mb << 20
    if device.type == "cuda":
        import torch

        free, _ = torch.cuda.mem_get_info(device)
        return free // 2
    return 256 << 20


def _random_model(args: argparse.Namespace, options):
    """Random weights of a named shape (latency benchmarks only: the text is noise)."""
    import torch

    from engine.loading.random_model import random_model, shape_config

    config = shape_config(args.random_shape, args.random_vocab_size)
    device = torch.device(args.device)
    dtype = {
        "auto": torch.bfloat16 if device.type == "cuda" else torch.float32,
        "float32": torch.float32,
        "bfloat16": torch.bfloat16,
        "float16": torch.float16,
    }[args.dtype]
    model = random_model(
        config,
        dtype=dtype,
        device=device,
        seed=args.random_seed,
        options=options,
        quant=args.quant,
        quant_lm_head=args.quant_lm_head,
    )
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the fp32 draws' blocks: another daemon may need the memory
    return model


GPU_MEMORY_HELP = (
    "cap this process's GPU memory (GB of 10^9 bytes): the weights, then the KV pool sized to "
    "what is left; checked before loading, with an error naming the quantization that would "
    "fit. Without it the free memory is the limit. CUDA only: ignored, with a warning, on the CPU"
)

MODEL_HELP = (
    "a model folder, a Hugging Face repo id ORG/NAME[@REVISION] (from the hub cache: "
    "`wd-engine pull` fetches it) or a name `wd-engine models` lists "
    "(default: $WD_LSP_MODEL, else the embedded model)"
)

FIT_MEMORY_HELP = (
    "judge the fit for one GPU of this many GB (10^9 bytes) instead of the GPUs found "
    "(default: $WD_ENGINE_GPU_MEMORY_GB)"
)

CPU_DECODE_WEIGHTS_HELP = (
    "weights of the CPU's one-sequence decode step: auto (the default) takes a form that holds "
    "the model's weights exactly: int4 for a model trained through int4 groups (an eighth of "
    "fp32's bytes; only the activations are rounded, to bf16), else fp32, which computes as "
    "prefill does; int8 streams a quarter of fp32's bytes but rounds the weights, which changes "
    "some completions; int4 is refused for a model not trained through it"
)
CPU_DECODE_GUARD_HELP = (
    "with int4 CPU decode weights, compute a step again from the fp32 weights where it is not "
    "decisive (a routing near-tie, two close best logits): greedy answers closer still to the "
    "fp32 path's, at the cost of those steps"
)


def model_options(
    device, moe_path: str | None, cpu_decode_weights: str = "auto", cpu_decode_guard: bool = False
):
    """The model's options (engine.model.options) from the command line.

    `moe_path`: None or `auto` is the model's own choice (on CUDA the Triton dispatcher: warp
    decode for a few tokens, expert-centric for many); an explicit path is forced for every MoE
    layer: the torch reference on the CPU, the Triton kernel on CUDA (`output_centric` is warp
    decode there). `cpu_decode_weights`: the weights the lean CPU decode step streams
    (engine.model.lean_matrices); int8 and int4 need torch's int8 and int4 products.
    `cpu_decode_guard`: int4 steps that are not decisive are computed again in fp32."""
    import logging
    from functools import partial

    import torch

    from engine.model.lean_matrices import int4_available, int8_available
    from engine.model.options import ModelOptions
    from kernels import dispatch

    form = cpu_decode_weights
    if form == "int8" and not int8_available():
        logging.getLogger("wd_engine").warning(
            "this torch has no int8 weight-only product: CPU decode steps use fp32 weights"
        )
        form = "fp32"
    if form == "int4" and not int4_available():
        logging.getLogger("wd_engine").warning(
            "this torch has no int4 product for the CPU: CPU decode steps use fp32 weights"
        )
        form = "fp32"
    path = moe_path or "auto"
    if path == "auto" or torch.device(device).type != "cuda":
        return ModelOptions(moe_path=path, lean_weights=form, lean_guard=cpu_decode_guard)
    kernel = dispatch.WARP_DECODE if path == "output_centric" else dispatch.EXPERT_CENTRIC
    return ModelOptions(
        lean_weights=form, lean_guard=cpu_decode_guard, moe_fn=partial(dispatch.run_path, kernel)
    )


def _serve(args: argparse.Namespace) -> int:
    import asyncio

    from engine.ipc import paths
    from engine.ipc.socket_path import SocketInUse, UnsafeSocketPath, prepare_socket_path

    try:
        log = _setup_logging(args)
    except (OSError, paths.UnsafeRuntimeDir, paths.UnsafeLogFile) as exc:
        print(f"wd-engine: cannot log: {exc}", file=sys.stderr)
        return 1
    if args.quant_lm_head and not (args.random_shape and args.quant):
        print(
            "wd-engine: --quant-lm-head applies to --random-shape with --quant (a checkpoint's "
            "lm_head loads as stored; `wd-engine quantize --lm-head` writes it quantized)",
            file=sys.stderr,
        )
        return 2
    # Before the model loads: a model not downloaded, a path in the way or a bad token file is a
    # quick error, not one after a long load (the editor shows the `wd-engine:` line).
    try:
        model_dir = _model_dir(args.model)
        socket_path = Path(args.socket) if args.socket else paths.socket_path()
        prepare_socket_path(socket_path)
        token = _tcp_token(args, log) if args.tcp_port is not None else None
        http = _http_options(args, log) if args.http_port is not None else None
    except (
        UnsafeSocketPath,
        SocketInUse,
        TokenFileError,
        paths.UnsafeRuntimeDir,
        OSError,
        ModelNotFound,
    ) as exc:
        log.error("%s", exc)
        print(f"wd-engine: {exc}", file=sys.stderr)
        return 1
    # torch only now: a daemon refused above exits without the seconds its import takes
    from engine.core.engine import Engine
    from engine.core.options import EngineOptions
    from engine.loading import memory
    from engine.loading.loader import load_model
    from engine.loading.random_model import shape_config
    from engine.loading.tokenizer import Tokenizer
    from engine.serve.daemon import EngineServer, ServeOptions

    name = f"random {args.random_shape}" if args.random_shape else display_name(model_dir)
    try:
        t0 = time.perf_counter()
        args.device = resolve_device(args.device)
        options = model_options(
            args.device, args.moe_path, args.cpu_decode_weights, args.cpu_decode_guard
        )
        # Before the weights load: a model that cannot fit is a quick, clear error.
        budget = memory.check_before_load(
            args.device,
            args.gpu_memory_gb,
            log,
            model_dir=None if args.random_shape else model_dir,
            config=shape_config(args.random_shape, args.random_vocab_size)
            if args.random_shape
            else None,
            quant=args.quant,
            quant_lm_head=args.quant_lm_head,
            dtype=args.dtype,
            kv_bytes=None if args.kv_memory_mb is None else args.kv_memory_mb << 20,
            name="it",  # after "cannot load model NAME: "
        )
        if args.random_shape:  # the folder gives only the tokenizer (and its FIM conventions)
            model = _random_model(args, options)
        else:
            model = load_model(model_dir, dtype=args.dtype, device=args.device, options=options)
        kv_bytes = kv_pool_bytes(args.kv_memory_mb, model, budget, args.kv_fp8)
        tokenizer = Tokenizer.from_dir(model_dir, extra_eos_ids=model.config.eos_token_ids)
        log.info(
            "loaded %s in %.0f ms on %s (%s, MoE path %s, CPU decode weights %s)",
            name,
            1000 * (time.perf_counter() - t0),
            args.device,
            model.dtype,
            args.moe_path,
            model.lean.form if model.lean_path_applies() else "unused",
        )
    except Exception as exc:  # noqa: BLE001 - reported, the exit code says it failed
        log.error("cannot load model %s: %s", name, exc)
        print(f"wd-engine: cannot load model {name}: {exc}", file=sys.stderr)
        return 1
    salt = (
        f"random:{args.random_shape}:{args.random_seed}"
        if args.random_shape
        else str(model_dir.resolve())
    )
    engine_options = EngineOptions(
        block_size=args.block_size,
        kv_fp8=args.kv_fp8,
        kv_memory_bytes=kv_bytes,
        prefill_chunk=args.prefill_chunk,
        salt=f"{salt}:{model.dtype}",
        prefix_cache=not args.no_prefix_cache,
        speculative=not args.no_speculative,
    )
    engine = Engine(model, tokenizer, engine_options)
    log.info("memory: %s", memory.describe(model, engine.runner.pool, budget))
    idle_timeout = args.idle_timeout
    if idle_timeout is None:  # an HTTP server is started on purpose: it stays until stopped
        idle_timeout = float("inf") if http else 900.0
    options = ServeOptions(
        socket_path=socket_path,
        tcp_host=args.tcp_host,
        tcp_port=args.tcp_port,
        token=token,
        idle_timeout_s=idle_timeout,
        max_prompt_tokens=args.max_prompt_tokens,
        http=http,
    )
    try:
        asyncio.run(EngineServer(engine, model_dir, options).serve())
    except RuntimeError as exc:
        log.error("%s", exc)
        print(f"wd-engine: {exc}", file=sys.stderr)
        return 1
    return 0


def _parallel(args: argparse.Namespace) -> int:
    """One rank of expert-parallel generation (engine.model.expert_parallel), one process per
    GPU under torchrun: every rank runs the engine's loop on the same request, rank 0 prints."""
    import torch.distributed as dist

    from engine.core.engine import Engine
    from engine.core.request import Request, RequestFailed
    from engine.loading.loader import load_model, resolve_dtype
    from engine.loading.tokenizer import Tokenizer
    from engine.model import expert_parallel
    from engine.model.config import ModelConfig
    from engine.model.options import ModelOptions

    try:
        model_dir = _model_dir(args.model)
    except ModelNotFound as exc:
        print(f"wd-engine: {exc}", file=sys.stderr)
        return 1
    device = expert_parallel.init_distributed(args.device)
    try:
        experts = expert_parallel.rank_experts(ModelConfig.from_dir(model_dir).num_experts)
        local = load_model(
            model_dir,
            dtype=resolve_dtype(args.dtype, device),
            device=device,
            experts=experts,
            options=ModelOptions(moe_path=args.moe_path),
        )
        model = expert_parallel.shard(local, experts)
        tokenizer = Tokenizer.from_dir(model_dir, extra_eos_ids=model.config.eos_token_ids)
        request = Request(tokenizer.encode_prompt(args.prompt), max_tokens=args.max_tokens)
        try:
            done = Engine.for_one_request(model, tokenizer, request).complete(request).check()
        except RequestFailed as exc:
            print(f"wd-engine: {exc}", file=sys.stderr)
            return 1
        # Every rank decoded the same tokens; check it rather than trust it.
        seen = [None] * dist.get_world_size()
        dist.all_gather_object(seen, done.token_ids)
        if any(s != seen[0] for s in seen):
            raise RuntimeError(f"ranks disagree on the completion's tokens: {seen}")
        if dist.get_rank() == 0:
            sys.stdout.write(done.text)
            sys.stdout.flush()
    finally:
        dist.destroy_process_group()
    return 0


def _quantize(args: argparse.Namespace) -> int:
    """`wd-engine quantize`: engine.loading.quantize.quantize_folder, its refusals as exit 1."""
    from engine.loading.quantize import QuantizeError, quantize_folder

    try:
        summary = quantize_folder(
            resolve_model(args.src),
            args.dst,
            args.to,
            block=args.block,
            group=args.group,
            max_shard_bytes=int(args.max_shard_gb * 1e9),
            lm_head=args.lm_head,
        )
    except (QuantizeError, OSError, ModelNotFound) as exc:
        print(f"wd-engine quantize: {exc}", file=sys.stderr)
        return 1
    print(summary.line(args.to))
    return 0


def _pull(args: argparse.Namespace) -> int:
    """`wd-engine pull`: engine.hub.pull, its refusals as exit 1; an interrupt exits at once."""
    import signal

    from engine.hub.names import parse_repo_ref
    from engine.hub.pull import PullError, pull
    from engine.hub.sizes import size_text

    try:
        ref = parse_repo_ref(args.repo)
    except ValueError as exc:
        print(f"wd-engine pull: {exc}", file=sys.stderr)
        return 2

    def interrupted(signum, frame) -> None:
        # The download's threads would finish their files before an exception got through:
        # leave now. The weights' partial files stay for the next pull to continue. The hub
        # client's temporary files are left alone: one may be another process's download of
        # the same repo (`hf cache` prunes them).
        sys.stderr.write(
            f"\nwd-engine pull: interrupted; run `wd-engine pull {ref}` again to resume\n"
        )
        sys.stderr.flush()
        os._exit(128 + signum)

    signal.signal(signal.SIGINT, interrupted)
    signal.signal(signal.SIGTERM, interrupted)
    try:
        done = pull(ref, args.include_format)
    except PullError as exc:
        print(f"wd-engine pull: {exc}", file=sys.stderr)
        return 1
    fmt = f"{done.format}, " if done.format else ""
    print(f"{ref}: {fmt}{size_text(done.total_bytes)} in {done.path}")
    print(
        f"use it: --model {ref}, or WD_LSP_MODEL={ref} (the editor's `model` setting); "
        "`wd-engine models` says whether it fits this machine"
    )
    return 0


def _gpu_override(args: argparse.Namespace) -> float | None:
    from engine.inventory.machine import gpu_memory_override

    return gpu_memory_override(args.gpu_memory_gb)


def _models(args: argparse.Namespace) -> int:
    """`wd-engine models`: engine.inventory.report as a table or JSON."""
    import json

    from engine.inventory.report import as_json, build_report, render_text

    try:
        report = build_report(_gpu_override(args))
    except ValueError as exc:
        print(f"wd-engine models: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(as_json(report), indent=2) if args.json else render_text(report))
    return 0


def _doctor(args: argparse.Namespace) -> int:
    """`wd-engine doctor`: engine.inventory.doctor's one screen."""
    from engine.inventory import doctor

    try:
        print(doctor.report(_gpu_override(args)))
    except ValueError as exc:
        print(f"wd-engine doctor: {exc}", file=sys.stderr)
        return 2
    return 0


def _setup_logging(args: argparse.Namespace):
    """The daemon's log: created 0600 (in a 0700 dir by default), never written through a link."""
    import logging

    from engine.ipc import paths

    stream = paths.open_private_log(Path(args.log_file) if args.log_file else paths.log_path(), "a")
    handlers = [logging.StreamHandler(stream)]
    if args.foreground:
        handlers.append(logging.StreamHandler())
    logging.basicConfig(
        level=logging.INFO,
        handlers=handlers,
        format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s",
    )
    return logging.getLogger("wd_engine")


def _tcp_token(args: argparse.Namespace, log) -> str:
    """The TCP listener's token: $WD_ENGINE_TOKEN, the --token-file, or the runtime dir's."""
    token = os.environ.get("WD_ENGINE_TOKEN")
    if not token and args.token_file:
        token = read_token_file(Path(args.token_file))
    if not token:
        token = _runtime_token("engine.token", "tcp token", log)
    if args.tcp_host not in LOOPBACK:
        log.warning("tcp listener on %s is reachable beyond this machine", args.tcp_host)
    return token


def _http_options(args: argparse.Namespace, log):
    """The OpenAI-compatible listener's address and bearer token (file, env, or the one kept
    owner-only in the runtime directory)."""
    token = (
        read_token_file(Path(args.http_token_file))
        if args.http_token_file
        else os.environ.get("WD_ENGINE_HTTP_TOKEN")
    )
    if not token:
        token = _runtime_token("http.token", "http bearer token", log)
    # starlette, uvicorn and torch (through engine.core): only once the token is settled
    from engine.serve.openai_http import HttpOptions

    return HttpOptions(host=args.http_host, port=args.http_port, token=token)


def _runtime_token(name: str, what: str, log) -> str:
    from engine.ipc import paths

    path = paths.runtime_dir() / name
    token, written = runtime_token(path)
    log.info("%s %s %s", what, "written to" if written else "read from", path)
    return token


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="wd-engine", description="The wd-lsp inference engine.")
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="complete a prompt and print only the new text")
    gen.add_argument("--model", help=MODEL_HELP)
    gen.add_argument("--prompt", help="plain text prompt")
    gen.add_argument("--fim-prefix", help="text before the cursor (builds a FIM prompt)")
    gen.add_argument("--fim-suffix", help="text after the cursor (builds a FIM prompt)")
    gen.add_argument(
        "--fim-order",
        choices=("auto", "psm", "spm"),
        default="auto",
        help="auto: suffix-first (spm) when the model declares it, else psm",
    )
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument(
        "--beams",
        type=int,
        default=1,
        help="beam search over this many hypotheses (greedy, CPU; meant for a single line)",
    )
    gen.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto")
    gen.add_argument("--device", default="auto", help=DEVICE_HELP)
    gen.add_argument("--gpu-memory-gb", type=float, help=GPU_MEMORY_HELP)
    gen.add_argument("--moe-path", choices=("auto", "expert_centric", "output_centric"))
    gen.add_argument(
        "--cpu-decode-weights",
        choices=("auto", "fp32", "int8", "int4"),
        default="auto",
        help=CPU_DECODE_WEIGHTS_HELP,
    )
    gen.add_argument("--cpu-decode-guard", action="store_true", help=CPU_DECODE_GUARD_HELP)
    gen.add_argument("--stats", action="store_true", help="print timings to stderr")
    gen.add_argument("--newline", action="store_true", help="end the output with a newline")
    gen.set_defaults(run=_generate)

    serve = commands.add_parser("serve", help="run the resident engine daemon")
    serve.add_argument("--model", help=MODEL_HELP)
    serve.add_argument("--socket", help="Unix socket path (default: under $XDG_RUNTIME_DIR/wd-lsp)")
    serve.add_argument(
        "--tcp-port", type=int, help="also listen on TCP (0 picks a free port); needs a token"
    )
    serve.add_argument(
        "--tcp-host", default="127.0.0.1", help="TCP bind address (default loopback only)"
    )
    serve.add_argument(
        "--token-file",
        help="owner-only file holding the TCP token "
        "(default: $WD_ENGINE_TOKEN, or the one kept in engine.token in the runtime dir)",
    )
    idle = os.environ.get("WD_ENGINE_IDLE_TIMEOUT")
    serve.add_argument(
        "--idle-timeout",
        type=float,
        default=float(idle) if idle else None,
        help="exit after this many seconds without clients "
        "(default 900, or $WD_ENGINE_IDLE_TIMEOUT; with --http-port: never)",
    )
    serve.add_argument(
        "--http-port",
        type=int,
        help="also serve an OpenAI-compatible API (/v1/completions, /v1/models) on this port "
        "(0: any)",
    )
    serve.add_argument(
        "--http-host", default="127.0.0.1", help="HTTP bind address (default loopback only)"
    )
    serve.add_argument(
        "--http-token-file",
        help="owner-only file holding the HTTP bearer token "
        "(default: $WD_ENGINE_HTTP_TOKEN, or the one kept in http.token in the runtime dir)",
    )
    serve.add_argument(
        "--kv-memory-mb",
        type=int,
        help="KV block pool size (default: 256 MB on the CPU, half the free memory on a GPU, "
        "what is left of --gpu-memory-gb after the weights)",
    )
    serve.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    serve.add_argument(
        "--kv-fp8", action="store_true", help="store the KV cache in fp8 (e4m3) with scales"
    )
    serve.add_argument(
        "--no-prefix-cache", action="store_true", help="compute every prompt cold (for comparisons)"
    )
    serve.add_argument(
        "--no-speculative",
        action="store_true",
        help="decode one token per step, no prompt-lookup drafts (for comparisons)",
    )
    serve.add_argument(
        "--cpu-decode-weights",
        choices=("auto", "fp32", "int8", "int4"),
        default="auto",
        help=CPU_DECODE_WEIGHTS_HELP,
    )
    serve.add_argument("--cpu-decode-guard", action="store_true", help=CPU_DECODE_GUARD_HELP)
    serve.add_argument(
        "--prefill-chunk",
        type=int,
        help="prompt tokens per scheduler step (default: 4096 on CUDA, 512 on the CPU)",
    )
    serve.add_argument("--max-prompt-tokens", type=int, default=4096)
    serve.add_argument(
        "--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto"
    )
    serve.add_argument("--device", default="auto", help=DEVICE_HELP)
    serve.add_argument("--gpu-memory-gb", type=float, help=GPU_MEMORY_HELP)
    serve.add_argument(
        "--moe-path",
        choices=("auto", "expert_centric", "output_centric"),
        default="auto",
        help="force a MoE path (on CUDA: the Triton expert-centric or warp decode kernel); "
        "auto: the engine's choice by batch size",
    )
    serve.add_argument(
        "--random-shape",
        metavar="SHAPE",
        help="serve random weights of a named shape (qwen3-30b-a3b, tiny) instead of a checkpoint; "
        "--model then only gives the tokenizer. For latency measurements: the text is noise",
    )
    serve.add_argument("--random-seed", type=int, default=0, help="seed of the random weights")
    serve.add_argument(
        "--quant",
        choices=("fp8", "int4"),
        help="with --random-shape: quantize the random projections (FP8 blocks / int4 groups of "
        "128), kept so on the GPU as a quantized checkpoint's are",
    )
    serve.add_argument(
        "--quant-lm-head",
        action="store_true",
        help="with --quant: the random model's own lm_head quantized too (as `quantize --lm-head`)",
    )
    serve.add_argument(
        "--random-vocab-size",
        type=int,
        help="vocabulary of the random model (default: the shape's)",
    )
    serve.add_argument("--log-file", help="log here (default: $XDG_STATE_HOME/wd-lsp/engine.log)")
    serve.add_argument("--foreground", action="store_true", help="also log to stderr")
    serve.set_defaults(run=_serve)

    par = commands.add_parser(
        "parallel",
        help="expert-parallel generation, one process per GPU: "
        "torchrun --nproc-per-node N -m engine.cli parallel --prompt TEXT",
    )
    par.add_argument("--model", help=MODEL_HELP)
    par.add_argument("--prompt", required=True, help="plain text prompt")
    par.add_argument("--max-tokens", type=int, default=32)
    par.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto")
    par.add_argument("--device", help="cuda or cpu (default: cuda when present)")
    par.add_argument(
        "--moe-path", choices=("auto", "expert_centric", "output_centric"), default="auto"
    )
    par.set_defaults(run=_parallel)

    quant = commands.add_parser(
        "quantize",
        help="write a quantized copy of a bf16/fp16/fp32 Hugging Face Qwen3-MoE folder "
        "(fp8: Qwen's FP8 format; int4: compressed-tensors W4A16), which this engine, "
        "transformers and vLLM read",
    )
    quant.add_argument("--to", choices=("fp8", "int4"), required=True, help="the format")
    quant.add_argument(
        "--block",
        type=int,
        default=128,
        help="fp8: rows and columns of a scale's block (default 128, as Qwen's releases); it "
        "must divide the hidden, head and intermediate sizes",
    )
    quant.add_argument(
        "--group",
        type=int,
        default=128,
        help="int4: input columns per scale (default 128; 32 is finer); a multiple of 8 that "
        "divides every projection's input size",
    )
    quant.add_argument(
        "--max-shard-gb",
        type=float,
        default=5.0,
        help="largest weight file written (default 5 GB); more get an index",
    )
    quant.add_argument(
        "--lm-head",
        action="store_true",
        help="quantize the lm_head too (models with their own, such as Qwen3-30B-A3B): a smaller, "
        "faster decode step, every logit a little further from the source's; left as stored by "
        "default, as in Qwen's FP8 releases",
    )
    quant.add_argument(
        "src", metavar="SRC", help="the model to quantize: a folder, or a repo id pulled before"
    )
    quant.add_argument("dst", metavar="DST", help="the new folder (must not exist)")
    quant.set_defaults(run=_quantize)

    from engine.hub.files import FORMATS  # no torch: --help stays instant

    pull = commands.add_parser(
        "pull",
        help="download a Hugging Face model's engine files (config, tokenizer, safetensors) into "
        "the hub cache, resuming an interrupted pull; HF_TOKEN for gated models, HF_ENDPOINT "
        "for a mirror",
    )
    pull.add_argument(
        "repo", metavar="REPO[@REVISION]", help="e.g. Qwen/Qwen3-Coder-30B-A3B-Instruct"
    )
    pull.add_argument(
        "--include-format",
        choices=FORMATS,
        help="the weights' format to accept (bf16: unquantized), checked in config.json before "
        "any weight is downloaded; another format is refused with what to pull or run instead",
    )
    pull.set_defaults(run=_pull)

    models = commands.add_parser(
        "models",
        help="the models on this machine (hub cache, model folders, the embedded ones): "
        "architecture, format, size, context, whether each fits the GPU and the CPU memory, "
        "and the default",
    )
    models.add_argument("--json", action="store_true", help="as JSON, with each model's path")
    models.add_argument("--gpu-memory-gb", type=float, help=FIT_MEMORY_HELP)
    models.set_defaults(run=_models)

    doctor = commands.add_parser(
        "doctor",
        help="one screen on this set-up: Python, torch, CUDA and the GPUs, Triton, the hub, "
        "the engine daemon, the editor integrations, the models and whether they fit",
    )
    doctor.add_argument("--gpu-memory-gb", type=float, help=FIT_MEMORY_HELP)
    doctor.set_defaults(run=_doctor)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
