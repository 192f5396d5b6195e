#!/usr/bin/env bash
# Argument handling and the no-GPU path of scripts/gpu-check (a fake
# nvidia-smi that finds no GPU makes the outcome the same on every machine).
set -euo pipefail
root=${BYTECOMP_SOURCE_ROOT:?}
cd "$root"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fails=0
expect() {  # rc pattern description command...
  local want=$1 pat=$2 what=$3; shift 3
  local rc=0
  "$@" >"$tmp/out" 2>&1 || rc=$?
  if [ "$rc" != "$want" ] || ! grep -qE -- "$pat" "$tmp/out"; then
    echo "FAIL: $what: rc $rc (want $want), output:"; cat "$tmp/out"; fails=$((fails + 1))
  else
    echo "ok: $what"
  fi
}
expect 2 "missing OUTDIR" "no argument" scripts/gpu-check
expect 2 "unknown option '--bogus'" "unknown option" scripts/gpu-check --bogus "$tmp/o"
expect 2 "one output folder only" "two folders" scripts/gpu-check "$tmp/a" "$tmp/b"
expect 2 "needs a value" "option without value" scripts/gpu-check --build-dir
expect 2 "is not a number" "bad timeout scale" scripts/gpu-check --timeout-scale abc "$tmp/o"
expect 0 "OUTDIR" "help" scripts/gpu-check --help
expect 2 "repository root" "outside the repository" bash -c "cd '$tmp' && '$root/scripts/gpu-check' '$tmp/o'"
mkdir -p "$tmp/bin"
printf '#!/bin/sh\necho "NVIDIA-SMI has failed because it could not communicate with the NVIDIA driver"\nexit 9\n' >"$tmp/bin/nvidia-smi"
chmod +x "$tmp/bin/nvidia-smi"
# No GPU: exit 0, every GPU step named as skipped, the JSON line last.
expect 0 "no GPU found" "no GPU" env PATH="$tmp/bin:$PATH" scripts/gpu-check --no-build \
  --build-dir "$tmp/nobuild" "$tmp/nogpu/deep"
if ! grep -q '"gpu": false' "$tmp/nogpu/deep/figures.json" ||
   ! python3 - "$tmp/nogpu/deep/figures.json" "$tmp/out" <<'EOF'
import json, sys
fig = json.load(open(sys.argv[1]))
last = open(sys.argv[2]).read().strip().splitlines()[-1]
assert json.loads(last) == fig, "the output does not end with the JSON line"
for s in ("cuda_tests", "bench", "torch", "staging_figures", "gpu_profile", "intra_node"):
    assert s in fig["skipped"], (s, fig["skipped"])
    assert fig["steps"][s].startswith("skipped"), fig["steps"][s]
assert "awaits_gpu" in fig
EOF
then
  echo "FAIL: figures.json of the no-GPU run:"; cat "$tmp/nogpu/deep/figures.json" || true; fails=$((fails + 1))
fi
[ $fails -eq 0 ] || { echo "$fails check(s) failed"; exit 1; }
echo "all gpu-check checks passed"
