#!/usr/bin/env bash
# Host and GPU time of DotProductAttention on launch-bound batches, the package at an older
# commit against the working tree, alternated (before, after, before, after) so that drift on
# the machine hits both alike. Needs a GPU (profile_small.py); run from the repository root:
#
#   bash benchmarks/attention/host_before_after.sh 38d1729 OUT_DIR [runs=2] [profile_small.py arguments]
#
# e.g. graph-replayed time of DotProductAttention before and after a restructuring, on both
# libraries: ... 4d21d26 OUT 2 --paths DPA --batches many-short,notes-32k --head-dims 64,128
# (then `python benchmarks/attention/before_after_table.py OUT`).
#
# BEFORE may also be a directory holding transformer_engine/ and transformer_engine_torch/ (the
# device's copy of the checkout has no git history: extract it here with `git archive` and
# carry the directory).
#
# The harness (profile_small.py) is the working tree's: its direct cuDNN calls use the package's
# own cuDNN ops at their current path, so a BEFORE without them fails there (and so does this
# script) unless the run is limited to `--paths DPA` (the public API only).
# Writes OUT_DIR/host_before_N.log and host_after_N.log ([small] lines of profile_small.py).
set -euo pipefail  # a crashed profile run must fail the script, not leave a short log
commit=$1 out=$2 runs=${3:-2}
case $runs in ''|*[!0-9]*) echo "runs (the third argument, before any profile_small.py argument) must be a number; got '$runs'" >&2; exit 2;; esac
shift $(( $# < 3 ? $# : 3 ))
extra=("$@")
[ ${#extra[@]} -gt 0 ] || extra=(--head-dims 128)
if [ -d "$commit" ]; then
  old=$(cd "$commit" && pwd) keep=1
else
  old=$(mktemp -d) keep=0
  git archive "$commit" transformer_engine transformer_engine_torch | tar -x -C "$old"
fi
mkdir -p "$out"
for i in $(seq 1 "$runs"); do
  PYTHONPATH="$old:${PYTHONPATH:-}" PROFILE_KERNELS=0 python benchmarks/attention/profile_small.py "${extra[@]}" 2>&1 \
    | grep '^\[small\]' > "$out/host_before_$i.log"
  PROFILE_KERNELS=0 python benchmarks/attention/profile_small.py "${extra[@]}" 2>&1 | grep '^\[small\]' > "$out/host_after_$i.log"
done
[ "$keep" = 1 ] || rm -rf "$old"
