#!/usr/bin/env bash
# The FP8 KV cache's GPU checks (cache.kv_cache_dtype: fp8), most telling first: the invariant
# engine bitwise across batches on the 35B-A3B shape, the kernels' write/read against the
# reference and their row invariance (the interpreter tests, on the GPU), the Triton kernels in a
# whole engine against the reference; then the bf16 attention's GPU invariance tests (the kernel
# files changed: their bf16 bits must not have).
set -o pipefail  # a failing command fails the script, not the tail it pipes into
python3 -m pytest -q -rf --timeout 150 -p no:cacheprovider \
  tests/gpu/test_engine_gpu.py::test_fp8_kv_cache_invariant_engine_bitwise \
  tests/kernels/test_invariance_interp.py::test_fp8_kv_cache_written_and_read_as_the_reference \
  tests/kernels/test_invariance_interp.py::test_attention_rows_invariant_across_batches_and_forms \
  tests/kernels/test_invariance_interp.py::test_prompt_rows_invariant_across_batches_and_chunkings \
  tests/kernels/test_engine_triton.py::test_fp8_kv_cache_engine_matches_the_reference \
  tests/kernels/test_engine_triton.py::test_needle_alone_and_in_a_batch_bitwise \
  tests/gpu/test_kernel_invariance.py::test_attention_row_invariant_across_batches_and_forms \
  tests/gpu/test_kernel_invariance.py::test_verify_rows_at_64_mma_rows_equal_decode_rows \
  tests/unit/test_kv_cache_fp8.py 2>&1 | tail -30
