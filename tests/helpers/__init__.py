"""Helpers shared by the test files (pytest puts tests/ on sys.path): ``devices`` (CUDA availability and
the device parametrisation), ``hf_models`` (tiny Hugging Face models and the tolerances they are
compared with), ``kernel_refs`` (plain-PyTorch references of the fused ops and their comparisons).
tests/reference.py holds the reference stacks and steps of the checkpointing tests."""
