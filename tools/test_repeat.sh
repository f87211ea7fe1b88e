#!/usr/bin/env bash
# Run one or more tests N times in a row (each a fresh pytest session), count the outcomes, keep the
# log of each failure. For a failure seen once: how often it happens, and under what load.
#   tools/test_repeat.sh N TEST_ID [TEST_ID ...]      e.g. tools/test_repeat.sh 50 'tests/test_dpo.py::test_dpo_layout_matches_one_process[tp2]'
# WORKDIR (default /tmp/test_repeat) holds failK.log for each failed run; one summary line at the end.
set -u
N=$1; shift
WORK=${WORKDIR:-/tmp/test_repeat}
mkdir -p "$WORK"
cd "$(dirname "$0")/.." || exit 2
pass=0; fail=0; s=$(date +%s)
for i in $(seq 1 "$N"); do
  if python -m pytest -q -p no:cacheprovider --timeout=300 "$@" > "$WORK/run.log" 2>&1; then
    pass=$((pass + 1)); echo "run $i passed ($(( $(date +%s) - s )) s in all)"
  else
    fail=$((fail + 1)); cp "$WORK/run.log" "$WORK/fail$i.log"
    echo "run $i failed: $(grep -m1 -E '^(FAILED|ERROR|E  )' "$WORK/run.log")"
  fi
done
echo "$pass passed, $fail failed ($N runs of $*; $(( $(date +%s) - s )) s; load $(cut -d' ' -f1-3 /proc/loadavg))"
[ "$fail" -eq 0 ]
