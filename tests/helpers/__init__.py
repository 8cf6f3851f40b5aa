"""Helpers shared by the test files (pytest puts tests/ on sys.path): ``devices`` (CUDA availability and
the device parametrisation), ``hf_models`` (tiny Hugging Face models and the tolerances they are
compared with), ``kernel_refs`` (plain-PyTorch references of the fused ops and their comparisons), and
what one group of test files shares: ``errors`` (test_errors_*), ``faults`` (test_faults),
``kernel_fixtures`` (test_kernels_*), ``pool`` (test_pool_*), ``properties`` (test_properties_*).
tests/reference.py holds the reference stacks and steps of the checkpointing tests."""
