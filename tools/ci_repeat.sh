#!/usr/bin/env bash
# Run .ci/run N times in a row, each on a fresh clone of a commit; stop at the first failure.
#   tools/ci_repeat.sh [N=5] [COMMIT=HEAD] [WORKDIR=/tmp/ci_repeat]
# One line per run in WORKDIR/summary.txt (exit code, wall time, pytest's last line); each run's
# full log in WORKDIR/runK.log. This is how the "passes N times in a row" claims are measured.
set -u
N=${1:-5}
REPO=$(cd "$(dirname "$0")/.." && pwd)
COMMIT=$(git -C "$REPO" rev-parse "${2:-HEAD}")
WORK=${3:-/tmp/ci_repeat}
mkdir -p "$WORK"
for i in $(seq 1 "$N"); do
  d="$WORK/clone$i"; rm -rf "$d"
  git clone -q "$REPO" "$d" && git -C "$d" checkout -q "$COMMIT"
  s=$(date +%s)
  (cd "$d" && bash .ci/run) > "$WORK/run$i.log" 2>&1
  rc=$?
  echo "run $i commit ${COMMIT:0:7} rc=$rc wall=$(( $(date +%s) - s ))s $(tail -1 "$WORK/run$i.log")" | tee -a "$WORK/summary.txt"
  rm -rf "$d"
  [ $rc -ne 0 ] && exit $rc
done

exit 0
