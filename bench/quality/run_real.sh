#!/usr/bin/env bash
# The quality benchmark on a real pretrained target, one GPU host: the GGUF converted and checked, its answers to the
# training prompts (checked for loops), then ours and SpecForge with SEEDS each (two streams side by side on the GPU:
# ours' seeds one after another, SpecForge's likewise, after the hidden-state dump its offline mode needs), and prompt
# lookup beside them. Last, bench/quality/collect_real.py makes the record and the plot.
#   GGUF=SRC/target.gguf PROMPTS=SRC bash bench/quality/run_real.sh      (SRC: what `real_target.py gather` wrote)
# Wheels for SpecForge (as run_h200.sh says) and gguf==0.19.0 (the conversion) are installed from $WHEELS.
# EXTRA adds --set options to every phase (e.g. EXTRA="--set prompts_train=2000 --set tau_at=[1200]": tau of the
# final checkpoint alone, where measuring every checkpoint would take most of the pass).
# PHASES=prepare stops after the target, its answers and the dump; a second run goes on from the files left in WORK.
set -euo pipefail
WORK=${WORK:-/tmp/qreal}; OUTDIR=${OUTDIR:-$WORK/out}; WHEELS=${WHEELS:-.whl}; SEEDS=${SEEDS:-0 1 2}
: "${GGUF:?GGUF names the target GGUF file}" "${PROMPTS:?PROMPTS names the folder real_target.py gather wrote}"
mkdir -p "$OUTDIR"
[ -d /tmp/sfsite ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/sfsite "$WHEELS"/*.whl
q() { python3 bench/quality/run_quality.py --work "$WORK" --scale real --set "gguf=$GGUF" --set "prompts=$PROMPTS" ${EXTRA:-} "$@"; }
keep() { (cd "$WORK" && tar czf "$OUTDIR/quality-real.tgz" --exclude=regen.jsonl -- *.json *.jsonl *.log) 2>/dev/null || true; }
[ -f "$WORK/target.json" ] || PYTHONPATH=/tmp/sfsite q --phase target; keep
[ -f "$WORK/data.json" ] || q --phase data; keep
if [ "${PHASES:-all}" = prepare ]; then [ -f "$WORK/features.json" ] || q --phase features; keep; exit 0; fi
( while sleep 30; do keep; done ) & keeper=$!
trap 'kill $keeper 2>/dev/null' EXIT
( for s in $SEEDS; do [ -f "$WORK/ours-s$s.json" ] || q --phase ours --set "seed=$s" --set "tag=-s$s"; done ) \
  > "$WORK/ours.out" 2>&1 & ours=$!
( ([ -f "$WORK/features.json" ] || q --phase features) && for s in $SEEDS; do
    [ -f "$WORK/specforge-s$s.json" ] || PYTHONPATH=/tmp/sfsite q --phase specforge --set "seed=$s" --set "tag=-s$s"
  done ) > "$WORK/specforge.out" 2>&1 & sf=$!
# a "why" variant of ours with the same seeds beside them: VARIANT='-i2 --set init_std=0.02' (its tag, then its sets)
if [ -n "${VARIANT:-}" ]; then
  read -r vtag vsets <<<"$VARIANT"
  ( for s in $SEEDS; do [ -f "$WORK/ours$vtag-s$s.json" ] || eval "q --phase ours $vsets --set seed=$s --set tag=$vtag-s$s"
    done ) > "$WORK/variant.out" 2>&1 & variant=$!
fi
[ -f "$WORK/lookup.json" ] || q --phase lookup > "$WORK/lookup.out" 2>&1 || echo "lookup failed: $(tail -5 "$WORK/lookup.out")"
wait $ours || echo "ours failed: $(tail -20 "$WORK/ours.out")"
wait $sf || echo "specforge failed: $(tail -30 "$WORK/specforge.out")"
[ -z "${variant:-}" ] || wait $variant || echo "variant failed: $(tail -20 "$WORK/variant.out")"
kill $keeper 2>/dev/null || true
python3 bench/quality/collect_real.py "$WORK" --out "$OUTDIR/quality-real.json" --plot "$OUTDIR/quality-real.png" || true
keep
