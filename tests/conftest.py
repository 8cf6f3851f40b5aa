"""Test-session set-up shared by all test files."""
import gc


def pytest_collection_finish(session):
    # Everything imported so far (torch, transformers, the test modules) lives for the whole session.
    # Freezing it keeps gc.collect() -- which the pool-accounting tests call to drop garbage that may
    # hold pooled tensors -- from rescanning those objects every time (about 1 s per call otherwise).
    gc.collect()
    gc.freeze()
