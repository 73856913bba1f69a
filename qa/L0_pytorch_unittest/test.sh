#!/usr/bin/env bash
# Runs the attention test files one by one, TE-style: every file runs even if an earlier one
# fails, failures are listed at the end, and the exit code is non-zero on any failure.
# tests/pytorch/attention/test_qa_list.py fails when a test file is missing from this list.
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

run_file() {
  local file=$1 log="$LOGS/$(basename "$1").log"
  python -m pytest -q -p no:cacheprovider "tests/pytorch/attention/$file" 2>&1 | tee "$log"
  local rc=${PIPESTATUS[0]}
  local summary
  summary=$(tail -n 1 "$log")
  PASSED=$((PASSED + $(count "$summary" passed)))
  SKIPPED=$((SKIPPED + $(count "$summary" skipped)))
  FAILED_TESTS=$((FAILED_TESTS + $(count "$summary" failed) + $(count "$summary" error)))
  # 5 = no test collected: a file that skips everything (GPU-only on a CPU machine) still exits 0.
  if [ "$rc" -ne 0 ]; then FAILED+=("$file"); fi
}

run_file test_dot_product_attention.py
run_file test_fast_path.py
run_file test_backend_selection.py
run_file test_backend_scope.py
run_file test_autotune.py
run_file test_gpu_autotune.py
run_file test_validation.py
run_file test_pad_between_seqs.py
run_file test_per_seq_policy.py
run_file test_policy_compaction.py
run_file test_packed_qkv.py
run_file test_multi_head_attention.py
run_file test_gpu_backends.py
run_file test_gpu_cudnn_features.py
run_file test_gpu_num_splits.py
run_file test_cudnn_wiring.py
run_file test_cudnn_max_logit.py
run_file test_fa3_adapter.py
run_file test_library_adapters.py
run_file test_kernel_interface.py
run_file test_unfused_kernel.py
run_file test_gap_rows.py
run_file test_te_import_surface.py
run_file test_megatron_dropin.py
run_file test_mha_tensor_parallel.py
run_file test_te_checkpoints.py
run_file test_softmax_variants.py
run_file test_fp8.py
run_file test_fp8_emulation.py
run_file test_fp8_cudnn.py
run_file test_gpu_fp8.py
run_file test_unfused_memory.py
run_file test_unfused_probabilities.py
run_file test_gpu_softmax_variants.py
run_file test_context_parallel.py
run_file test_mha_context_parallel.py
run_file test_gpu_context_parallel.py
run_file test_gpu_cp_sync_free.py
run_file test_te_matrix.py
run_file test_thd_properties.py
run_file test_kv_cache.py
run_file test_kv_cache_modules.py
run_file test_kv_cache_backends.py
run_file test_gpu_kv_cache.py
run_file test_hardening.py
run_file test_structure.py
run_file test_install.py
run_file test_qa_list.py

echo
if [ ${#FAILED[@]} -ne 0 ]; then
  echo "Failed test files: ${FAILED[*]}"
fi
# Skips are GPU tests on a CPU machine (and declared refusals); say how many, so a green line
# never hides that most of the GPU suite did not run here.
echo "$PASSED passed, $FAILED_TESTS failed, $SKIPPED skipped"
[ ${#FAILED[@]} -eq 0 ]
