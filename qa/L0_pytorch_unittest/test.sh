#!/usr/bin/env bash
# Runs the attention test files one by one, TE-style: every file runs even if an earlier one
# fails, failures are listed at the end, and the exit code is non-zero on any failure.
# tests/pytorch/attention/test_package_structure.py fails when a test file is missing from this list.
set -u
TE_PATH=${TE_PATH:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}
cd "$TE_PATH" || exit 1
LOGS=$(mktemp -d)
FAILED=()
PASSED=0
FAILED_TESTS=0
SKIPPED=0

count() {  # count "<pytest summary line>" WORD -> the number before WORD, or 0
  echo "$1" | grep -oE "[0-9]+ $2" | awk '{s += $1} END {print s + 0}'
}

# test_gpu_*.py files hold only tests marked gpu (test_package_structure.py checks it): without a
# CUDA device every test in them would skip, so they are not started at all (each pytest start
# imports torch and the package: seconds of CPU). TE_RUN_GPU_FILES=1 starts them anyway.
HAS_CUDA=$(python -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)
GPU_FILES_NOT_RUN=()

run_file() {
  local file=$1 log="$LOGS/$(basename "$1").log"
  if [[ $file == test_gpu_* && $HAS_CUDA != 1 && ${TE_RUN_GPU_FILES:-0} != 1 ]]; then
    GPU_FILES_NOT_RUN+=("$file")
    return
  fi
  # Plugins a file does not use are not loaded (each costs CPU at every start): pytest-benchmark
  # (speed lives in benchmarks/) always, hypothesis's where the file does not use hypothesis.
  local plugins=(-p no:cacheprovider -p no:benchmark)
  grep -q "^from hypothesis\|^import hypothesis" "tests/pytorch/attention/$file" || plugins+=(-p no:hypothesispytest)
  python -m pytest -q "${plugins[@]}" "tests/pytorch/attention/$file" 2>&1 | tee "$log"
  local rc=${PIPESTATUS[0]}
  local summary
  summary=$(tail -n 1 "$log")
  PASSED=$((PASSED + $(count "$summary" passed)))
  SKIPPED=$((SKIPPED + $(count "$summary" skipped)))
  FAILED_TESTS=$((FAILED_TESTS + $(count "$summary" failed) + $(count "$summary" error)))
  # Any non-zero exit fails the file, 5 (no test collected) included; a file whose tests all skip
  # exits 0, and GPU files are not started at all without CUDA (above).
  if [ "$rc" -ne 0 ]; then FAILED+=("$file"); fi
}

# The module's semantics against the float64 reference
run_file test_masks_and_windows.py
run_file test_bias_and_alibi.py
run_file test_dropout_and_rng.py
run_file test_softmax_variants.py
run_file test_max_logit.py
run_file test_fp8.py
run_file test_fp8_emulation.py
run_file test_fp8_cudnn.py
run_file test_thd_gaps.py
run_file test_thd_packings.py
run_file test_per_seq_policy.py
run_file test_packed_qkv.py
run_file test_validation.py
# Selection, the fast path, the backends on their library stand-ins
run_file test_selection.py
run_file test_backend_scope.py
run_file test_fast_path.py
run_file test_metadata_cache.py
run_file test_rows_fact.py
run_file test_bound_calls.py
run_file test_autotune.py
run_file test_library_adapters.py
run_file test_cudnn_adapter.py
run_file test_kernel_interface.py
run_file test_unfused_memory.py
run_file test_unfused_probabilities.py
# Modules, TE's surface and checkpoints, megatron-core
run_file test_multi_head_attention.py
run_file test_mha_tensor_parallel.py
run_file test_te_import_surface.py
run_file test_te_checkpoints.py
run_file test_megatron_dropin.py
run_file test_te_matrix.py
# Context parallelism (gloo ranks), KV cache
run_file test_context_parallel.py
run_file test_mha_context_parallel.py
run_file test_kv_cache.py
run_file test_kv_cache_modules.py
run_file test_kv_cache_backends.py
# The repository's rules
run_file test_package_structure.py
# GPU only
run_file test_gpu_backends.py
run_file test_gpu_cudnn_features.py
run_file test_gpu_num_splits.py
run_file test_gpu_softmax_variants.py
run_file test_gpu_fp8.py
run_file test_gpu_fp8_emulation.py
run_file test_gpu_autotune.py
run_file test_gpu_unfused_memory.py
run_file test_gpu_per_seq_policy.py
run_file test_gpu_validation.py
run_file test_gpu_te_surface.py
run_file test_gpu_te_matrix.py
run_file test_gpu_context_parallel.py
run_file test_gpu_cp_sync_free.py
run_file test_gpu_kv_cache.py

echo
if [ ${#FAILED[@]} -ne 0 ]; then
  echo "Failed test files: ${FAILED[*]}"
fi
# Skips are GPU tests on a CPU machine (and declared refusals); say how many, so a green line
# never hides that most of the GPU suite did not run here.
echo "$PASSED passed, $FAILED_TESTS failed, $SKIPPED skipped"
if [ ${#GPU_FILES_NOT_RUN[@]} -ne 0 ]; then
  echo "not run (no CUDA device): ${#GPU_FILES_NOT_RUN[@]} GPU files: ${GPU_FILES_NOT_RUN[*]}"
fi
[ ${#FAILED[@]} -eq 0 ]
