#!/usr/bin/env bash
# GPU: what the quantized weights are measured by, in one call (results and logs under $OUT):
#   gputests  the tests that need a GPU (skipped in CI): the PDL chain's attention reads,
#           flash prefill against the masked path, the one-pass dequantize, the q/k/v GEMV's
#           epilogue (Triton compiled, not interpreted)
#   moe     the MoE layer in bf16, FP8 and int4 side by side (quantized warp decode tuned first,
#           its tables written to kernels/configs/ and copied to $OUT/configs)
#   projections  the q/k/v, o and lm_head GEMVs in bf16, FP8 and int4 against cuBLAS, their
#           tiles tuned (tables written to kernels/configs/ and copied to $OUT/configs)
#   prefill the expert-centric MoE layer at prompt-chunk sizes (512 and 2,048 tokens) in bf16,
#           FP8 and int4, its tiles tuned per format (tables written to kernels/configs/); the
#           quantized attention projections' dequantize for a chunk's GEMM, torch's against
#           one pass
#   decode  whole-model decode of the Qwen3-30B-A3B shape in bf16, FP8 and int4 (random weights
#           quantized by the project's quantizer), with the quantized step's logits against the
#           bf16 step on the dequantized weights
#   variants  the decode step's fusion sets side by side in bf16, FP8 and int4 (VARIANTS; each
#           checked against the unfused step's logits first)
#   knobs   the engine's step with one knob moved at a time (B=1, 4K) in bf16, int4 and FP8:
#           the fused router's experts a program and attention's splits (KNOBS_BF16,
#           KNOBS_INT4, KNOBS_FP8)
#   profile the engine's decode step kernel by kernel in bf16, FP8 and int4 (8 layers, B=1, 4K;
#           without its graph, so each kernel's device time shows)
#   first_token  the cold and warm first token after one keystroke at 1K and 4K in bf16, FP8
#           and int4, each with a profile of one cold and one warm request at 4K
#   fit     the FP8 model served under a 40 GB cap and the int4 model under 24 GB
#   latency the latency suite on FP8 under a 40 GB cap (keystroke -> first token with cache and
#           warm-up); a machine without the language server's packages needs the wheels of
#           tests/latency/gpu_wheels.sh carried in .whl/, installed here into a private folder
#
#   bash engine/bench/quantized_gpu.sh                 # all stages
#   STAGES=moe,decode bash engine/bench/quantized_gpu.sh
#   STAGES=moe MOE_ARGS="--formats fp8,int4 --batches 1,2,4,8" bash engine/bench/quantized_gpu.sh
#   STAGES=projections PROJECTIONS_ARGS="--formats int4 --projections qkv,o" bash ...
#   STAGES=prefill PREFILL_ARGS="--tokens 2048" bash engine/bench/quantized_gpu.sh
#   QUANT_LM_HEAD=1 STAGES=variants bash engine/bench/quantized_gpu.sh  # FP8/int4 lm_heads too
#           (decode, variants, knobs, fit; results named *_qhead), each variant also timed with
#           the bf16 lm_head
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-quantized-gpu-out}
STAGES=${STAGES:-gputests,moe,projections,prefill,decode,variants,knobs,profile,first_token,fit,latency}
HEAD_FLAG="" HEAD_NAME=""
if [ "${QUANT_LM_HEAD:-0}" = 1 ]; then HEAD_FLAG="--quant-lm-head" HEAD_NAME="_qhead"; fi
MOE_ARGS=${MOE_ARGS:-}
PREFILL_ARGS=${PREFILL_ARGS:-}  # e.g. "--tokens 2048": the CUDA scheduler's chunk only
PROJECTIONS_ARGS=${PROJECTIONS_ARGS:-}  # e.g. "--formats int4 --projections qkv,o"
FIT_ARGS=${FIT_ARGS:-}  # e.g. "--prefill-chunk 4096"
PYTHON=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
has() { [[ ",$STAGES," == *",$1,"* ]]; }

if has gputests; then
    TRITON_INTERPRET=0 "$PYTHON" -m pytest -q -p no:cacheprovider -k "gpu or pdl_chain" \
        tests/engine/test_decode_graph.py tests/engine/test_prefill_attention.py \
        tests/kernels/test_dequantize.py tests/kernels/test_heads_linear.py 2>&1 \
        | tee "$OUT/gputests.log"
fi
if has moe; then
    # shellcheck disable=SC2086
    "$PYTHON" -m engine.bench.moe_formats --tune $MOE_ARGS --out "$OUT/moe_formats.json" 2>&1 \
        | tee "$OUT/moe_formats.log"
fi
if has projections; then
    # shellcheck disable=SC2086
    "$PYTHON" -m engine.bench.projections --tune $PROJECTIONS_ARGS \
        --out "$OUT/projections.json" 2>&1 | tee "$OUT/projections.log"
fi
if has prefill; then
    # shellcheck disable=SC2086
    "$PYTHON" -m engine.bench.prefill_moe --tune $PREFILL_ARGS --out "$OUT/prefill_moe.json" 2>&1 \
        | tee "$OUT/prefill_moe.log"
    "$PYTHON" -m engine.bench.prefill_projections --rows 2048,4096 \
        --out "$OUT/prefill_projections.json" 2>&1 | tee "$OUT/prefill_projections.log"
fi
if has moe || has projections || has prefill; then
    mkdir -p "$OUT/configs" && cp kernels/configs/*.json "$OUT/configs/"
fi
decode_bench() {  # NAME QUANT ARGS...: engine.bench.decode on the 30B-A3B shape, B=1 and 8 at 4K
    # (ARGS come last, so a --batches among them wins)
    local name=$1 quant=$2 flag
    shift 2
    flag=$([ "$quant" = bf16 ] || echo "--quant $quant $HEAD_FLAG")
    name=${name}_$quant$([ "$quant" = bf16 ] || echo "$HEAD_NAME")
    # shellcheck disable=SC2086
    "$PYTHON" -m engine.bench.decode --batches 1,8 --contexts 4096 --split-at 1,4096 \
        --no-transformers $flag "$@" --out "$OUT/$name.json" 2>&1 | tee "$OUT/$name.log"
}
if has decode; then
    # The step, its split, prefill chunks (flash against masked) and the quantized step against
    # bf16; fusion sets and knobs have their own stages.
    for quant in bf16 fp8 int4; do
        decode_bench decode "$quant" --prefill 4096 --stages decode,split,prefill,compare
    done
fi
if has variants; then
    variants="unfused|router|router+pdl|router+pdl+qkv_epilogue|router+pdl+attention_merge"
    variants=${VARIANTS:-$variants|router+pdl+qkv_epilogue+norm_qkv}
    for quant in ${VARIANT_FORMATS:-fp8 int4 bf16}; do
        decode_bench variants "$quant" --prefill 0 --stages check,variants --variants "$variants"
    done
fi
if has knobs; then
    # The fused router's experts a program (one in a step of one row; eight, the kernel's own),
    # and fewer attention splits than the 65 a B=1 4K step takes (16 and 32 lost in FP8).
    knobs_bf16="router+pdl|router+pdl:route_e=8|router+pdl:route_e=2|router+pdl:route_e=4"
    knobs_bf16+="|router+pdl:splits=32|router+pdl:splits=48"
    knobs_int4="router+pdl|router+pdl:route_e=8|router+pdl:route_e=2|router+pdl:route_e=4"
    knobs_int4+="|router+pdl:splits=32|router+pdl:splits=48"
    knobs_fp8="router+pdl|router+pdl:route_e=8|router+pdl:route_e=2|router+pdl:route_e=4"
    knobs_fp8+="|router+pdl:splits=48|router+pdl:splits=32"
    for spec in "bf16:${KNOBS_BF16:-$knobs_bf16}" "int4:${KNOBS_INT4:-$knobs_int4}" \
        "fp8:${KNOBS_FP8:-$knobs_fp8}"; do
        decode_bench knobs "${spec%%:*}" --batches 1 --prefill 0 --stages check,variants \
            --variants "${spec#*:}"
    done
fi
if has profile; then
    for quant in bf16 fp8 int4; do
        flag=$([ "$quant" = bf16 ] || echo "--quant $quant")
        # shellcheck disable=SC2086
        "$PYTHON" -m engine.bench.profile_decode --layers 8 --context 4096 --top 30 $flag 2>&1 \
            | tee "$OUT/profile_$quant.log"
    done
fi
if has first_token; then
    for quant in bf16 fp8 int4; do
        flag=$([ "$quant" = bf16 ] || echo "--quant $quant")
        # shellcheck disable=SC2086
        "$PYTHON" -m engine.bench.first_token --shape qwen3-30b-a3b --device cuda $flag \
            --contexts 1024 4096 --repeat 5 --profile 15 --json "$OUT/first_token_$quant.json" 2>&1 \
            | tee "$OUT/first_token_$quant.log"
    done
fi
if has fit; then
    for spec in fp8:40 int4:24; do
        quant=${spec%:*} cap=${spec#*:}
        # shellcheck disable=SC2086
        "$PYTHON" -m engine.bench.fit --quant "$quant" $HEAD_FLAG --gpu-memory-gb "$cap" \
            $FIT_ARGS --out "$OUT/fit_$quant$HEAD_NAME.json" 2>&1 | tee "$OUT/fit_$quant$HEAD_NAME.log"
    done
fi
if has latency; then
    if ! "$PYTHON" -c "import pygls, lsprotocol, tree_sitter_language_pack" 2>/dev/null; then
        ls .whl/*.whl > /dev/null 2>&1 \
            || { echo "no language-server wheels in .whl/: run tests/latency/gpu_wheels.sh" >&2; exit 1; }
        site=$(mktemp -d /tmp/wd-site-XXXXXX)
        "$PYTHON" -m pip install -q --no-index --no-deps --target "$site" .whl/*.whl
        export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
    fi
    OUT="$OUT/latency_fp8" MODES=${MODES:-cache-on,cache-warm} SEGMENTS=${SEGMENTS:-2} \
        KV_MB=${KV_MB:-4096} bash tests/latency/gpu_run.sh --engine-arg=--quant=fp8 \
        --engine-arg=--gpu-memory-gb=40
fi
