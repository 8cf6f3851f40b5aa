"""Row widths of the CUDA norm tests that exercise the mixed-dtype register kernels (docs/cuda-audit.md).

Those kernels (a bfloat16/float16 x, out, out2 or gradient beside a float32 stream, and the fanout's second
gradient, G2) are instantiated per launch bucket (slots per thread x warps per row, norms.cu's with_row_shape) and
only with 16-byte accesses, so each bucket is its own never-run code until a test launches it. These widths reach
every float32 bucket of forward and backward (test_norm_kernels.py's test_cuda_tests_reach_every_register_bucket
checks it with the launch-shape model), plus an unaligned width (1023) and one past the register kernels (8200),
which convert around the float kernels.
"""

# LayerNorm (and the fanout's RMSNorm): 72 -> the smallest buckets, 200 -> backward's (2, 1), 384 -> (4, 1),
# 1024 -> forward (8, 1) / backward (4, 2), 1536 -> forward (8, 2) / backward (4, 4), 4096, 6000 -> the widest.
MIXED_HIDDENS = [72, 200, 384, 1023, 1024, 1536, 4096, 6000, 8200]
# RMSNorm with a lower-precision x: the same and 64 (a whole number of one-warp slots).
MIXED_RMS_HIDDENS = [64] + MIXED_HIDDENS
