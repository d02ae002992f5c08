#!/usr/bin/env bash
# What a pass has measured so far, from WORK into OUT (at most a few files of 16 MiB: results, per-prompt taus, logs,
# the record and its plot, the regenerated answers compressed), so that a pass cut short still leaves its numbers.
#   WORK=/tmp/q62 OUT=DIR bash bench/quality/pack_pass.sh
set -uo pipefail
WORK=${WORK:-/tmp/q62}; : "${OUT:?OUT names where the files go}"
mkdir -p "$OUT"
python3 bench/quality/collect_real.py "$WORK" --out "$WORK/quality-real.json" --plot "$WORK/quality-real.png" \
  --machine "one $(cut -d, -f1 "$WORK/gpu.txt" 2>/dev/null)" > "$WORK/collect.out" 2>&1 || true
(cd "$WORK" && tar czf "$OUT/pass.tgz" --exclude='regen*.jsonl' --exclude='features' -- *.json *.jsonl *.log *.out \
  *.txt prompts/*.json run-*/metrics.jsonl 2>/dev/null) || true
for f in quality-real.json quality-real.png stages.log; do [ -f "$WORK/$f" ] && cp "$WORK/$f" "$OUT/"; done
[ -f "$WORK/regen.jsonl" ] && [ ! -f "$WORK/regen.jsonl.gz" ] && gzip -k -1 "$WORK/regen.jsonl"
[ -f "$WORK/regen.jsonl.gz" ] && [ "$(stat -c %s "$WORK/regen.jsonl.gz")" -lt 16000000 ] && cp "$WORK/regen.jsonl.gz" "$OUT/"
ls -la "$OUT"; tail -5 "$WORK/stages.log" 2>/dev/null
