#!/usr/bin/env bash
# The quality benchmark in one pass on one GPU host (about 9 minutes): the target and its answers, then our trainer,
# SpecForge (after the hidden-state dump it needs) and prompt lookup side by side. They share the GPU, so the step
# times of this pass are each trainer's under the same load, not alone.
# Wheels for SpecForge (specforge, yunchang, pydantic and its parts) are installed from $WHEELS, never from the network;
# fetch them where pip works, for the GPU host's Python (3.12 here), without their pins' dependencies:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 -d .whl \
#     specforge==0.2.0 yunchang==0.6.4 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
#     typing-inspection==0.4.5 typing-extensions==4.16.0
set -euo pipefail
WORK=${WORK:-/tmp/qual}; OUTDIR=${OUTDIR:-$WORK/out}; WHEELS=${WHEELS:-.whl}
mkdir -p "$OUTDIR"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/sfsite "$WHEELS"/*.whl
q() { python3 bench/quality/run_quality.py --work "$WORK" "$@"; }
# everything a phase wrote so far, in one archive (results, per-prompt taus, logs), kept after each step
keep() { (cd "$WORK" && tar czf "$OUTDIR/quality.tgz" --exclude=regen.jsonl -- *.json *.jsonl *.log) 2>/dev/null || true; }
[ -f "$WORK/target.json" ] || q --phase target; keep
[ -f "$WORK/data.json" ] || q --phase data; keep
# PHASES=prepare: the target, its answers and the hidden-state dump only (a pass in two calls of a time limit)
if [ "${PHASES:-all}" = prepare ]; then [ -f "$WORK/features.json" ] || q --phase features; keep; exit 0; fi
( while sleep 30; do keep; done ) & keeper=$!  # a pass cut by its time limit still leaves what it measured
trap 'kill $keeper 2>/dev/null' EXIT
q --phase ours > "$WORK/ours.out" 2>&1 & ours=$!
( ([ -f "$WORK/features.json" ] || q --phase features) && PYTHONPATH=/tmp/sfsite q --phase specforge) > "$WORK/specforge.out" 2>&1 & sf=$!
# variants of ours beside the rest, for the "why" runs, e.g. VARIANT='--set tag=-b2 --set betas=[0.9,0.999]'
# (VARIANT2, VARIANT3 more of them: --set init_std=0.02 for Hugging Face's initialisation, --set buckets=[1024] for
# batches mixed across lengths and padded, as SpecForge's)
for v in VARIANT VARIANT2 VARIANT3; do
  if [ -n "${!v:-}" ]; then eval "q --phase ours ${!v}" > "$WORK/$v.out" 2>&1 & fi
done
[ "${LOOKUP:-1}" = 0 ] || q --phase lookup > "$WORK/lookup.out" 2>&1 || true
keep
wait $ours || echo "ours failed: $(tail -5 "$WORK/ours.out")"
keep
wait $sf || echo "specforge failed: $(tail -30 "$WORK/specforge.out")"
kill $keeper 2>/dev/null
wait
keep
