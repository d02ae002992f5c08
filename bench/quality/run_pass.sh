#!/usr/bin/env bash
# Issue 62's pass on one GPU host, every step side by side where the GPU has room, each result written as it comes:
#   1. the target converted from its pinned GGUF (real_target.py convert, through run_quality.py --phase target)
#   2. its greedy answers to every training prompt (ShareGPT + code requests) by the static engine, after the same
#      prompts' first REGEN_BASELINE by model.generate for the speed it replaces
#   3. in three waves: prompt lookup on the 244 held-out prompts beside SpecForge's features for the first
#      sf_samples answers; ours on exactly those answers (SEEDS, STEPS steps) beside SpecForge's first seed; its
#      other seeds beside ours on every answer (FULL_STEPS) and a variant of ours (VARIANT); every checkpoint's tau
#      on the 244 prompts by the same bench_tau
#   4. collect_real.py: bench/results/quality-real.json's record and the tau-against-GPU-seconds plot
#   SRC=DIR WHEELS=DIR bash bench/quality/run_pass.sh      (SRC: what `real_target.py gather` wrote)
# Wheels (SpecForge's, and gguf for the conversion) are installed from $WHEELS; nothing is fetched. Run it from its
# own copy of the repository (a call that refreshes the working tree must not change the code under a running pass).
set -uo pipefail
WORK=${WORK:-/tmp/q62}; WHEELS=${WHEELS:-.whl}; SEEDS=${SEEDS:-0 1}
STEPS=${STEPS:-1000}; SAVE=${SAVE:-500}; FULL_STEPS=${FULL_STEPS:-2000}; FULL_SAVE=${FULL_SAVE:-1000}
VARIANT=${VARIANT:--full-b4 --set 'buckets=[256,512,768,1024]' --set data=full --set steps=1000 --set eval_every=500}
: "${SRC:?SRC names the folder real_target.py gather wrote}"
mkdir -p "$WORK"
mark() { echo "$(date +%s) $*" >> "$WORK/stages.log"; }
q() { python3 bench/quality/run_quality.py --work "$WORK" --scale real --set "gguf=$SRC/target.gguf" \
        --set "prompts=$SRC" ${EXTRA:-} "$@"; }
ours() {  # ours TAG SETS...: one run of ours, skipped when its result is there
  local tag=$1; shift
  [ -f "$WORK/ours$tag.json" ] || eval "q --phase ours $* --set tag=$tag"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$WORK/gpu.txt" 2>&1
mark start
[ -d /tmp/sfsite ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/sfsite \
  "$WHEELS"/*.whl
[ -f "$WORK/target.json" ] || PYTHONPATH=/tmp/sfsite q --phase target; mark target
[ -f "$WORK/target.json" ] || { mark "target failed"; exit 1; }
[ -f "$WORK/data.json" ] || q --phase data; mark data
[ -f "$WORK/data.json" ] || { mark "data failed"; exit 1; }
# The GPU is shared in waves: the first pass ran all of it at once and ran out of the H100's 80 GB (SpecForge's
# training alone peaks near 40 GB at batch 16, each bench_tau at batch 256 near 13 GB, each run of ours near 10 GB).
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
( [ -f "$WORK/lookup.json" ] || q --phase lookup; mark lookup ) > "$WORK/lookup.out" 2>&1 &
( [ -f "$WORK/features.json" ] || q --phase features; mark features ) > "$WORK/features.out" 2>&1 &
wait
sf() { [ -f "$WORK/specforge-s$1.json" ] || PYTHONPATH=/tmp/sfsite q --phase specforge --set steps="$STEPS" \
         --set eval_every="$SAVE" --set seed="$1" --set tag="-s$1"; mark "specforge-s$1"; }
first=${SEEDS%% *}
for s in $SEEDS; do
  ( ours "-s$s" --set data=sub --set steps="$STEPS" --set eval_every="$SAVE" --set seed="$s"; mark "ours-s$s" ) \
    > "$WORK/ours-s$s.out" 2>&1 &
done
sf "$first" > "$WORK/specforge-s$first.out" 2>&1 &
wait
for s in $SEEDS; do [ "$s" = "$first" ] || sf "$s" > "$WORK/specforge-s$s.out" 2>&1 & done
( ours -full-s0 --set data=full --set steps="$FULL_STEPS" --set eval_every="$FULL_SAVE" --set seed=0
  mark ours-full ) > "$WORK/ours-full.out" 2>&1 &
( read -r vtag vsets <<<"$VARIANT"; ours "$vtag-s0" "$vsets" --set seed=0; mark variant ) \
  > "$WORK/variant.out" 2>&1 &
wait
python3 bench/quality/collect_real.py "$WORK" --out "$WORK/quality-real.json" --plot "$WORK/quality-real.png" \
  --machine "one $(cut -d, -f1 "$WORK/gpu.txt")" > "$WORK/collect.out" 2>&1
mark done
