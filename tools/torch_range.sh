#!/usr/bin/env bash
# torchmeg on each end of its torch range (pyproject: torch >= 2.11, < 2.15). For each version: a
# fresh venv with that torch; the core install (`pip install -e .`, no extras) running the README's
# first command, shortened to 20 steps; then the test extra and the quick tier (`-m "not slow"`).
# One line per version at the end: the loss at step 20 and the quick tier's count.
#
#   tools/torch_range.sh                      # torch 2.11.0 and 2.14.1
#   tools/torch_range.sh 2.12.1 2.13.0        # any versions pip can install here
#   TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu tools/torch_range.sh   # CPU wheels, where reachable
#
# (Without TORCH_INDEX_URL pip takes the version from its configured index: on PyPI a CUDA build,
# which runs on a CPU as well.) Venvs go under $TORCHMEG_RANGE_DIR (default /tmp/torchmeg-torch-range);
# each holds a torch install (1-5 GB). Quoted results: docs/testing.md "torch versions".
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
base=${TORCHMEG_RANGE_DIR:-/tmp/torchmeg-torch-range}
[ $# -gt 0 ] || set -- 2.11.0 2.14.1
mkdir -p "$base"
summary=()
for v in "$@"; do
  venv=$base/torch-$v
  echo "== torch $v: $venv"
  rm -rf "$venv" && python3 -m venv "$venv"
  py=$venv/bin/python
  echo "torch==$v" > "$venv/constraint.txt"
  "$py" -m pip install -q torch=="$v" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
  # the README's install as written (pip install -e .), torch held at this version
  "$py" -m pip install -q -c "$venv/constraint.txt" -e "$root"
  run=$(mktemp -d)
  (cd "$run" && "$py" -m torchmeg.train --config "$root/recipes/debug_llama.toml" --training.steps=20 \
      --metrics.log_freq=10 --validation.enable=false --checkpoint.enable=false) | tee "$venv/first_command.log"
  loss=$(grep -E '^step +20 ' "$venv/first_command.log" | sed -E 's/.*loss ([0-9.]+).*/\1/')
  rm -rf "$run"
  "$py" -m pip install -q -c "$venv/constraint.txt" -e "$root[test]"
  (cd "$root" && "$py" -m pytest -q -m "not slow" -n 2 -p no:cacheprovider tests) | tee "$venv/quick_tier.log"
  got=$("$py" -c "import torchmeg, torch, importlib.metadata as m; print(torch.__version__, 'torchao', m.version('torchao'), 'torchdata', m.version('torchdata'))")
  summary+=("torch $got: README first command (20 steps) loss at step 20 ${loss:-MISSING}; quick tier: $(tail -1 "$venv/quick_tier.log")")
done
echo
printf '%s\n' "${summary[@]}"
