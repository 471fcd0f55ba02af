#!/usr/bin/env bash
# The GPU checks of the FP8 norm copies and side-by-side projections (the norms feeding block-FP8
# projections write the quantized copy; the official FP8 GDN input projections write into one
# buffer) and of the FP8 KV cache's float16 decode dots: the kernels' bits against quantize_act
# and alone, the FP8 engines on the Triton kernels against the reference and bitwise alone / in a
# batch, the FP8 KV engine bitwise across batches, the attention's FP8 cases.
set -o pipefail  # a failing command fails the script, not the tail it pipes into
python3 -m pytest -q -rf --timeout 200 -p no:cacheprovider \
  tests/kernels/test_fp8.py::test_norm_fp8_copy_is_quantize_act_of_its_output \
  tests/kernels/test_fp8.py::test_linears_write_into_columns_of_a_wider_buffer \
  tests/kernels/test_engine_triton.py::test_fp8_engine_on_the_triton_kernels_matches_the_reference \
  tests/kernels/test_engine_triton.py::test_fp8_kv_cache_engine_matches_the_reference \
  tests/gpu/test_engine_gpu.py::test_fp8_kv_cache_invariant_engine_bitwise \
  tests/kernels/test_invariance_interp.py::test_fp8_kv_cache_written_and_read_as_the_reference \
  tests/kernels/test_invariance_interp.py::test_attention_rows_invariant_across_batches_and_forms \
  2>&1 | tail -30
