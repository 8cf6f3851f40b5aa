"""A pytest plugin that runs PyTorch's own checkpoint tests on ckpt_ext (tools/torch_checkpoint_tests.py loads it
with `-p torch_checkpoint_patch`, before any test module is imported).

It replaces `torch.utils.checkpoint.checkpoint` and `checkpoint_sequential` with functions that send every call
that is not `use_reentrant=True` to `ckpt_ext.checkpoint` / `ckpt_ext.checkpoint_sequential` (ckpt_ext is the
non-reentrant variant; omitting `use_reentrant` is a non-reentrant call for ckpt_ext, so it goes to ckpt_ext too)
and leaves `use_reentrant=True` calls to torch's reentrant checkpoint. The replacement happens at plugin import,
so the tests' own `from torch.utils.checkpoint import checkpoint` binds the replacement, and torch's
`checkpoint_sequential`, looking `checkpoint` up in its module, would too.

Per test it counts the calls that went to ckpt_ext, the replays ckpt_ext ran (checkpoint() calls only), and the
calls left to torch's reentrant checkpoint, and writes them with each test's outcome to the JSON file named by
$CKPT_EXT_TORCH_TESTS_REPORT: the tool tells from them which tests exercised ckpt_ext at all. With
$CKPT_EXT_TORCH_TESTS_ROUTE=torch every call goes to torch's own functions, counted the same way (the reference
run: what the same test files give on the installed torch itself).
"""
import json
import os

import pytest
import torch.utils.checkpoint as _tuc

import ckpt_ext

_torch_checkpoint = _tuc.checkpoint
_torch_checkpoint_sequential = _tuc.checkpoint_sequential
_counts = {"ckpt_ext": 0, "replays": 0, "torch_reentrant": 0}
_to_torch = os.environ.get("CKPT_EXT_TORCH_TESTS_ROUTE") == "torch"


def _counting_replays(function):
    def run(*args, **kwargs):
        if ckpt_ext.is_recomputing():
            _counts["replays"] += 1
        return function(*args, **kwargs)

    return run


def checkpoint(function, *args, use_reentrant=None, **kwargs):
    if _to_torch:
        _counts["ckpt_ext" if use_reentrant is not True else "torch_reentrant"] += 1
        return _torch_checkpoint(function, *args, use_reentrant=use_reentrant, **kwargs)
    if use_reentrant is True:
        _counts["torch_reentrant"] += 1
        return _torch_checkpoint(function, *args, use_reentrant=True, **kwargs)
    _counts["ckpt_ext"] += 1
    call = _counting_replays(function) if callable(function) else function
    return ckpt_ext.checkpoint(call, *args, use_reentrant=use_reentrant, **kwargs)


def checkpoint_sequential(functions, segments, input, use_reentrant=None, **kwargs):
    if _to_torch:
        _counts["ckpt_ext" if use_reentrant is not True else "torch_reentrant"] += 1
        return _torch_checkpoint_sequential(functions, segments, input, use_reentrant=use_reentrant, **kwargs)
    if use_reentrant is True:
        _counts["torch_reentrant"] += 1
        return _torch_checkpoint_sequential(functions, segments, input, use_reentrant=True, **kwargs)
    _counts["ckpt_ext"] += 1
    return ckpt_ext.checkpoint_sequential(functions, segments, input, use_reentrant=use_reentrant, **kwargs)


checkpoint.__doc__ = _torch_checkpoint.__doc__
checkpoint_sequential.__doc__ = _torch_checkpoint_sequential.__doc__
_tuc.checkpoint = checkpoint
_tuc.checkpoint_sequential = checkpoint_sequential

_results = {}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    before = dict(_counts)
    yield
    _results.setdefault(item.nodeid, {})["calls"] = {k: _counts[k] - before[k] for k in _counts}


def pytest_runtest_logreport(report):
    entry = _results.setdefault(report.nodeid, {})
    if report.when == "call" or report.outcome != "passed":
        if entry.get("outcome") in (None, "passed"):  # a setup/teardown error or failure is not overwritten
            entry["outcome"] = report.outcome
            if report.outcome == "skipped" and isinstance(report.longrepr, tuple):
                entry["reason"] = report.longrepr[2]
            elif report.outcome == "failed":
                crash = getattr(report.longrepr, "reprcrash", None)
                entry["reason"] = (crash.message if crash else str(report.longrepr)).strip().replace("\n", " ")[:300]


def pytest_sessionfinish(session):
    path = os.environ.get("CKPT_EXT_TORCH_TESTS_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump(_results, f, indent=1, sort_keys=True)
