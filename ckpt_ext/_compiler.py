"""How ckpt_ext meets torch.compile and CUDA graph capture.

torch.compile: the engine (CheckpointFunction, SegmentFunction, the fused layers) is C++ reached through
pybind, which Dynamo cannot trace. Its Python entry points are wrapped with :func:`eager_under_compile`:
Dynamo graph-breaks at the call, once and quietly, and the call runs eagerly -- the user's function
included, so that its forward and its replay in backward run the same (eager) code and draw the same
random numbers. What runs without grad (inference) is not wrapped and compiles as usual.

CUDA graphs: the engine reads and restores generator state on the host, draws dropout seeds on the host
and hands out BoundaryPool memory outside the graph's private pool; none of it can be captured.
:func:`check_not_capturing` raises a clear error instead.
"""
import functools
import sys

import torch

__all__ = ["eager_under_compile", "check_not_capturing"]

try:  # Dynamo's frame-evaluation hook: set while a compiled region (or a frame it resumes) runs
    from torch._C._dynamo.eval_frame import get_eval_frame_callback as _eval_frame_callback
except ImportError:  # pragma: no cover - torches without it: assume the hook may be set once Dynamo is loaded
    _eval_frame_callback = None


def _frame_hook_active() -> bool:
    if _eval_frame_callback is None:
        return "torch._dynamo" in sys.modules
    return _eval_frame_callback() is not None


def eager_under_compile(fn):
    """``fn`` run outside torch.compile: under Dynamo, a call is one graph break and ``fn`` and everything
    it calls run eagerly (``torch._disable_dynamo``: ``torch.compiler.disable`` without importing Dynamo
    at import time). Outside torch.compile, ``fn`` is called directly while Dynamo is not even loaded."""
    not_traced = torch._disable_dynamo(fn)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        # Dynamo folds is_compiling() to True while tracing; the frame hook covers an eager frame run
        # while a compiled region is active (a frame Dynamo gave up on calls the engine), whose callees
        # Dynamo would otherwise compile. Outside both (Dynamo merely imported, as Hugging Face models
        # do), the direct call saves torch._dynamo.disable's ~6 µs per call.
        if torch.compiler.is_compiling() or _frame_hook_active():
            return not_traced(*args, **kwargs)
        return fn(*args, **kwargs)

    return call


def _stream_capturing() -> bool:
    # torch.cuda.is_initialized(): no CUDA context, no capture -- and no context created to ask.
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def check_not_capturing(what: str, instead: str):
    """Raises RuntimeError if the current CUDA stream is capturing a CUDA graph."""
    if _stream_capturing():
        raise RuntimeError(
            f"ckpt_ext: {what} cannot be captured in a CUDA graph (torch.cuda.graph / make_graphed_callables): "
            f"{instead}")
