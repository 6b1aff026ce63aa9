#!/usr/bin/env bash
# The latency suite on a GPU: the Qwen3-30B-A3B shape with random bf16 weights (latency only: the
# suggestions are noise), typed through the real language server and engine daemons.
#
# Four arms, two daemons alive at a time (each holds the 61 GB model and a 4 GiB KV pool; DAEMONS=1
# if memory runs short):
#   cache-off, cache-on                         (engine's own MoE path: warp decode at decode sizes)
#   cache-warm, cache-warm@expert_centric       (same, and the Triton expert-centric kernel forced)
# Writes latency.json, latency.md, two PNGs, run.log, engine_logs.txt and gpu_memory.csv to $OUT.
#
#   bash tests/latency/gpu_run.sh                                    # H200, ~5-6 minutes
#   SHAPE=tiny DEVICE=cpu OUT=/tmp/lat bash tests/latency/gpu_run.sh # the same path on a CPU
#
# Knobs (environment): OUT, SHAPE, DEVICE, SEGMENTS, LINES, KV_MB, DAEMONS, MODES, PYTHON; arguments
# go on to `wd-lsp bench compare` (e.g. --word-pause-ms 600).
set -euo pipefail
cd "$(dirname "$0")/../.."

OUT=${OUT:-latency-gpu-out}
SHAPE=${SHAPE:-qwen3-30b-a3b}
DEVICE=${DEVICE:-cuda}
SEGMENTS=${SEGMENTS:-3}
LINES=${LINES:-2}
# A fixed KV pool per daemon (the default, half the free GPU memory, would starve the second one).
[[ $DEVICE == cuda* ]] && KV_MB=${KV_MB:-4096} || KV_MB=${KV_MB:-256}
DAEMONS=${DAEMONS:-2}
MODES=${MODES:-cache-off,cache-on,cache-warm,cache-warm@expert_centric}
PYTHON=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"

# Private sockets and logs (a short path: AF_UNIX); daemons left behind by a crash stop on their own.
WD_ENGINE_DIR=$(mktemp -d /tmp/wdl-XXXXXX)
export WD_ENGINE_DIR WD_ENGINE_IDLE_TIMEOUT=120
POLLER=
finish() {
    [ -n "$POLLER" ] && kill "$POLLER" 2>/dev/null
    for f in "$WD_ENGINE_DIR"/*.log "$WD_ENGINE_DIR"/*.stderr; do
        [ -s "$f" ] && { echo "== $(basename "$f")"; tail -n 40 "$f"; }
    done > "$OUT/engine_logs.txt" 2>/dev/null || true
    rm -rf "$WD_ENGINE_DIR"
}
trap finish EXIT

{
    echo "== $(date -u +%FT%TZ) shape=$SHAPE device=$DEVICE segments=$SEGMENTS lines=$LINES kv_mb=$KV_MB modes=$MODES"
    "$PYTHON" - "$DEVICE" <<'EOF'
import sys
import lsprotocol, pygls, tree_sitter_language_pack, matplotlib, msgpack, tokenizers  # noqa: F401
import torch, triton
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, triton {triton.__version__}")
if sys.argv[1].startswith("cuda"):
    assert torch.cuda.is_available(), "no CUDA device"
    free, total = torch.cuda.mem_get_info()
    print(f"{torch.cuda.get_device_name()}: {free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB")
EOF
} 2>&1 | tee "$OUT/run.log"

if [[ $DEVICE == cuda* ]] && command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=timestamp,memory.used,memory.total,utilization.gpu --format=csv -l 5 \
        > "$OUT/gpu_memory.csv" 2>/dev/null &
    POLLER=$!
fi

start=$SECONDS
"$PYTHON" -m wd_lsp.bench compare --source project --segments "$SEGMENTS" --lines "$LINES" \
    --modes "$MODES" --daemons-at-once "$DAEMONS" --warm-up --run-dir "$WD_ENGINE_DIR" \
    --engine-arg=--random-shape="$SHAPE" --engine-arg=--device="$DEVICE" --engine-arg=--kv-memory-mb="$KV_MB" \
    --out "$OUT" "$@" 2>&1 | tee -a "$OUT/run.log"
echo "== bench took $((SECONDS - start)) s; results in $OUT" | tee -a "$OUT/run.log"
