#!/usr/bin/env bash
# One training run on a lent GPU machine whose calls are at most ~10 minutes each and whose
# transfers are size-limited: the run goes on in the background between calls.
#
#   stage [--clear] PACK...              unpack corpus parts carried by this call, for a later start
#                                       (each call's transfer is size-limited, so a big corpus
#                                       travels over several calls; the machine keeps them while warm);
#                                       a PACK named model.safetensors.partNN is a piece of split
#                                       weights, kept as it is: a RESUME folder that arrives without
#                                       weights gets them joined from the staged pieces (stage the
#                                       first with --clear, so no other run's pieces are left);
#                                       compile_cache-GPU.bin.partNN pieces are a stint's
#                                       compiled training step (engine.train.compile_cache),
#                                       joined for the next start on a GPU of that name
#   start PACK BUDGET_S [train args...]  unpack the carried corpus part, add the staged parts, build
#                                       the rest from the machine's own stdlib and packages, launch
#                                       training and watch it: resuming the embedded default
#                                       model (engine/models/wd-coder-small), or
#                                       RESUME=DIR (a checkpoint or export: its recorded config.json
#                                       is the shape), or SHAPE=config.json alone: a model of that
#                                       shape from scratch; if no step comes within minutes, it
#                                       starts again with FALLBACK's args (default --compile off)
#   watch SECONDS                        print progress for that long, copy the latest checkpoint out
#   finish                               wait for the run's end, copy checkpoint, log, curve out
#   cache                                copy the compiled step's artifacts out, in a call of their
#                                       own (a quantized export's pieces fill a call's return)
#
# Everything that must come back is copied under $OUT (checkpoint shards are <= 16 MB each; a run
# with --fp8-block or --int4-group brings back its quantized export as model.safetensors.partNN, to be joined with cat,
# and export.tgz with its config and training state; `cache` brings back
# compile_cache-GPU.bin.partNN, to be staged as they are for the next stint).
set -uo pipefail
RUN=${RUN_DIR:-/tmp/wd-train}
STAGE=${STAGE_DIR:-/tmp/wd-stage}  # outside the checkout, which each call replaces
MODEL=engine/models/wd-coder-small  # the embedded default: its tokenizer, and RESUME's default
export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
py=${PYTHON:-python3}

copy_out() {  # the newest checkpoint, and one archive of the logs and the corpus build's records
    if [ -d "$RUN/out/ckpt" ] && [ -f "$RUN/export_args" ]; then
        # A run trained through FP8 or int4 rounding comes back as its quantized export, in pieces
        # under the per-file limit: a grown model's bf16 checkpoint would outgrow the transfer
        # limit, and the export holds the same rounded weights the training forward used.
        rm -rf "$RUN/export" && mkdir -p "$RUN/export"
        $py -m engine.train.export --ckpt "$RUN/out/ckpt" --model-dir "$RUN/export" \
            $(cat "$RUN/export_args") || return 1
        split -b 15M -d "$RUN/export/model.safetensors" "$OUT/model.safetensors.part"
        tar -czf "$OUT/export.tgz" -C "$RUN/export" config.json generation_config.json training_state.json
    elif [ -d "$RUN/out/ckpt" ]; then
        mkdir -p "$OUT/ckpt" && cp "$RUN/out/ckpt/"* "$OUT/ckpt/"
    fi
    cp "$RUN/out/log.jsonl" "$RUN/out/loss.png" "$RUN/" 2>/dev/null
    (cd "$RUN" && tar -czf "$OUT/records.tgz" $(ls train.log log.jsonl loss.png manifest-gpu.json \
        heldout-gpu.txt 2>/dev/null))
    true
}

gpu_tag() {  # this GPU's name as a file-name part: a cache serves only the GPU it was made on
    nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr -c 'A-Za-z0-9\n' '_' | tr -d '\n'
}

running() { [ -f "$RUN/pid" ] && kill -0 "$(cat "$RUN/pid")" 2>/dev/null; }

model_dir() {  # the folder the trainer reads config.json and tokenizer.json from
    local config=${SHAPE:-}
    if [ -z "$config" ] && [ -n "${RESUME:-}" ] && [ -f "$RESUME/config.json" ]; then
        config=$RESUME/config.json
    fi
    if [ -z "$config" ]; then echo "$MODEL"; return; fi
    mkdir -p "$RUN/model" && cp "$config" "$RUN/model/config.json" \
        && cp "$MODEL/tokenizer.json" "$MODEL/tokenizer_config.json" "$RUN/model/" \
        && echo "$RUN/model"
}

resume_dir() {  # RESUME, its weights joined from staged pieces where they travelled split
    local pieces=("$STAGE"/pieces/model.safetensors.part*) weights=("${RESUME:-}"/*.safetensors)
    # A folder with weights of its own (an export, a checkpoint's shards) is used as it is.
    if [ -z "${RESUME:-}" ] || [ -e "${weights[0]}" ] || [ ! -e "${pieces[0]}" ]; then
        echo "${RESUME:-}"
        return
    fi
    { rm -rf "$RUN/resume" && mkdir -p "$RUN/resume" && cp "$RESUME"/*.json "$RUN/resume/" \
        && cat "${pieces[@]}" > "$RUN/resume/model.safetensors"; } || return 1
    cp "$RESUME"/*.jsonl "$RUN/resume/" 2>/dev/null  # its training log, where it has one
    echo "$RUN/resume"
}

launch() {  # trainer args
    local dir resume
    dir=$(model_dir) || { echo "cannot prepare the model folder (SHAPE=${SHAPE:-})"; exit 1; }
    RESUME=$(resume_dir) || { echo "cannot join the staged pieces of $RESUME"; exit 1; }
    if [ -n "${SHAPE:-}" ]; then resume=${RESUME:-}; else resume=${RESUME:-$MODEL}; fi
    setsid nohup $py -m engine.train.train --model-dir "$dir" --corpus .corpus \
        --out "$RUN/out" --compile-cache "$RUN/compile_cache.bin" ${resume:+--resume "$resume"} \
        "$@" >> "$RUN/train.log" 2>&1 < /dev/null &
    echo $! > "$RUN/pid"
}

stop() {  # the whole process group setsid made (the trainer and its data workers), and wait
    kill -- -"$(cat "$RUN/pid")" 2>/dev/null
    while running; do sleep 1; done
}

watch() {  # $1: seconds
    local end=$((SECONDS + $1))
    while [ $SECONDS -lt $end ] && running; do
        sleep 20
        grep -E "^(step|eval)" "$RUN/train.log" | tail -1
    done
    copy_out
}

case "${1:-}" in
stage)
    shift
    if [ "${1:-}" = --clear ]; then rm -rf "$STAGE"; shift; fi
    mkdir -p "$STAGE"
    for pack in "$@"; do
        case $pack in
        *.tar.xz) tar -xJf "$pack" -C "$STAGE" || exit 1 ;;
        *model.safetensors.part*) mkdir -p "$STAGE/pieces" && cp "$pack" "$STAGE/pieces/" || exit 1 ;;
        *compile_cache-*.bin.part*) mkdir -p "$STAGE/cache" && cp "$pack" "$STAGE/cache/" || exit 1 ;;
        *) echo "neither a corpus part (.tar.xz), a weights piece nor a cache piece: $pack"; exit 1 ;;
        esac
    done
    ls -la "$STAGE"
    ;;
start)
    pack=$2 budget=$3; shift 3
    SECONDS=0
    if running; then echo "a run is already going: watch or finish it"; exit 1; fi
    rm -rf "$RUN/out" "$RUN/train.log" "$RUN/export_args"  # a warm machine keeps the last run's files
    mkdir -p "$RUN" .corpus
    args=("$@")
    for i in "${!args[@]}"; do  # what copy_out brings back: the quantized export of a run trained through it
        case "${args[$i]}" in
        --fp8-block | --int4-group) echo "${args[$i]} ${args[$((i + 1))]}" > "$RUN/export_args" ;;
        esac
    done
    rm -f .corpus/*.jsonl  # the trainer reads every train*.jsonl: none may be left from a last run
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    staged=("$STAGE"/*.jsonl)
    if [ -e "${staged[0]}" ]; then  # staged parts (and maybe the held-out file)
        cp "${staged[@]}" .corpus/ || exit 1
    fi
    tar -xJf "$pack" -C .corpus || exit 1
    [ -f .corpus/heldout.jsonl ] || { echo "no heldout.jsonl carried or staged"; exit 1; }
    rm -f "$RUN/compile_cache.bin"
    cache=("$STAGE"/cache/compile_cache-"$(gpu_tag)".bin.part*)
    if [ -e "${cache[0]}" ]; then  # a stint's compiled step on this GPU, for the trainer to reuse
        cat "${cache[@]}" > "$RUN/compile_cache.bin" || exit 1
    fi
    t0=$SECONDS
    # The machine's own packages, less any that a fetched part already holds.
    fetched=()
    for m in engine/train/data/manifest-extra*.json; do [ -f "$m" ] && fetched+=(--exclude-from "$m"); done
    $py -m engine.train.corpus --out .corpus --heldout-from .corpus/heldout.jsonl --no-npm \
        --train-name train-gpu.jsonl --manifest-out "$RUN/manifest-gpu.json" \
        --heldout-list-out "$RUN/heldout-gpu.txt" "${fetched[@]}" || exit 1
    echo "corpus built here in $((SECONDS - t0)) s"; ls -la .corpus
    launch --budget-s "$budget" "$@"
    # A failure of the compiled step shows within minutes: fall back to FALLBACK's arguments
    # (after the run's own, so they win; default: the plain eager path).
    for _ in $(seq 40); do
        sleep 10
        grep -q "^step=" "$RUN/train.log" && break
        running || break
    done
    if ! grep -q "^step=" "$RUN/train.log"; then
        fallback=${FALLBACK:---compile off}
        tail -30 "$RUN/train.log"; echo "the first step failed: falling back to $fallback"
        stop
        rm -f "$RUN/compile_cache.bin"  # the uncompiled run writes none: carry no suspect one on
        # shellcheck disable=SC2086
        launch --budget-s "$((budget - SECONDS))" "$@" $fallback
    fi
    # Return before the call's limit (copy_out's FP8 export takes a few seconds more); the run
    # goes on, and the machine stays only briefly between calls, so chain the next call at once.
    watch $((${CALL_S:-540} - SECONDS))
    ;;
watch | finish)
    if [ ! -f "$RUN/pid" ]; then  # a machine given back between calls comes back bare
        echo "no run on this machine: it was given back since the start; the last checkpoint copied out is all there is"
        exit 3
    fi
    ;;&
watch) watch "$2" ;;
finish)  # within the call's limit; a run still going then is left to a later "finish"
    end=$((SECONDS + ${CALL_S:-560}))
    while running && [ $SECONDS -lt $end ]; do sleep 10; done
    tail -5 "$RUN/train.log"
    copy_out
    ;;
cache)
    # 4 pieces of 15 MiB at most: a call brings back 64 MiB.
    if [ ! -s "$RUN/compile_cache.bin" ]; then
        echo "no compiled step's cache here (the run did not compile, or was given back)"
    elif [ "$(stat -c %s "$RUN/compile_cache.bin")" -gt $((60 * 1024 * 1024)) ]; then
        echo "the compiled step's cache is over 60 MiB: not brought back"
    else
        split -b 15M -d "$RUN/compile_cache.bin" "$OUT/compile_cache-$(gpu_tag).bin.part"
        ls -la "$OUT"/compile_cache-*
    fi
    ;;
*) sed -n '2,/^set -uo pipefail$/p' "$0" | sed '$d'; exit 2 ;;
esac
