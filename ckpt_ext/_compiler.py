"""How ckpt_ext meets torch.compile and CUDA graph capture.

torch.compile: the engine (the C++ checkpoint frame, SegmentFunction, the fused layers' C++ autograd) is
reached through pybind, which Dynamo cannot trace. While Dynamo traces, ckpt_ext's entry points therefore
take a traced path instead (:func:`traced_under_compile`), with the semantics of the eager engine:

* a checkpointed call (checkpoint, checkpoint_sequential, enable_checkpointing) becomes torch's own
  activation-checkpoint higher-order op (torch.utils.checkpoint under Dynamo: ``tag_activation_checkpoint``),
  so AOTAutograd's partitioner recomputes the region inside compiled code, random ops included through
  its functionalised RNG (the replay draws the forward's masks). ckpt_ext's eager engine is a
  saved-tensor-hook mechanism around autograd; compiled code has no eager autograd graph to hook, and
  the partitioner is where recompute belongs there (docs/design.md, "torch.compile").
* checkpointed fused layers become the registered operator ``ckpt_ext::fused_segment`` (ckpt_ext/compiled.py),
  opaque to the compiler, whose autograd formula replays the segment in C++; its dropout seeds are a
  tensor drawn in the graph, so no step recompiles.

An eager frame that a compiled region runs (a frame Dynamo gave up on, with its frame hook still set)
runs the eager engine with Dynamo disabled, so that the user's function is not compiled between the
forward and its replay. Outside torch.compile the entry points are called directly (no cost).

What the traced path refuses (an exception raised in traced code: fused layers whose mask or rotary tables
require grad, keep-attention of fused segments) must reach the user, never the eager path in its place.
torch 2.11/2.13 run the rest of a frame after such a raise from the graph break it makes, so the raise
itself runs; torch 2.15's Dynamo instead gives up on the whole frame ("Observed exception" ... "Failed
to handle graph break gracefully. Skipping the function and falling back to eager") and runs it again
eagerly, where ``torch.compiler.is_compiling()`` is False. The eager run of an entry point in a compiled
region is therefore marked (:func:`in_compile_fallback`) and the same checks refuse the call there too.

CUDA graphs: the eager engine reads and restores generator state on the host, draws dropout seeds on the
host and hands out BoundaryPool memory outside the graph's private pool; none of it can be captured.
:func:`check_not_capturing` raises a clear error instead.
"""
import functools
import sys
import threading

import torch

__all__ = ["traced_under_compile", "in_compile_fallback", "check_not_capturing"]

try:  # Dynamo's frame-evaluation hook: set while a compiled region (or a frame it resumes) runs
    from torch._C._dynamo.eval_frame import get_eval_frame_callback as _eval_frame_callback
except ImportError:  # pragma: no cover - torches without it: assume the hook may be set once Dynamo is loaded
    _eval_frame_callback = None


def _frame_hook_active() -> bool:
    if _eval_frame_callback is None:
        return "torch._dynamo" in sys.modules
    return _eval_frame_callback() is not None


class _Fallback(threading.local):
    depth = 0  # entry points running eagerly in a frame of a compiled region, on this thread


_fallback = _Fallback()


def in_compile_fallback() -> bool:
    """True while a ckpt_ext entry point (and whatever it calls) runs eagerly inside a torch.compile region:
    Dynamo's frame hook is set but did not trace the call -- it gave up on the frame (an error while
    tracing, which torch 2.15 turns into a fallback to eager, or a graph break it could not resume from).
    The checks that refuse a call under torch.compile refuse it here too, so that the refusal, not the
    eager path, is what the user gets."""
    return _fallback.depth > 0


def traced_under_compile(traced):
    """Decorator: ``fn`` is the eager entry point, ``traced`` (same arguments) what Dynamo traces instead.

    While Dynamo traces (``torch.compiler.is_compiling()``, which Dynamo folds to True) the call is
    ``traced(...)``: no graph break. In an eager frame run while a compiled region is active (Dynamo's
    frame hook set: a frame it gave up on) ``fn`` runs with Dynamo disabled (``torch._disable_dynamo``:
    ``torch.compiler.disable`` without importing Dynamo at import time), so that the functions the
    engine calls are not compiled behind its back, and marked as such (:func:`in_compile_fallback`).
    Otherwise (Dynamo not even loaded, or merely imported, as Hugging Face models do) ``fn`` is called
    directly, which saves torch._dynamo.disable's ~6 µs per call."""

    def wrap(fn):
        not_traced = torch._disable_dynamo(fn)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            if torch.compiler.is_compiling():
                return traced(*args, **kwargs)
            if _frame_hook_active():
                _fallback.depth += 1
                try:
                    return not_traced(*args, **kwargs)
                finally:
                    _fallback.depth -= 1
            return fn(*args, **kwargs)

        return call

    return wrap


def _stream_capturing() -> bool:
    # torch.cuda.is_initialized(): no CUDA context, no capture -- and no context created to ask.
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def check_not_capturing(what: str, instead: str):
    """Raises RuntimeError if the current CUDA stream is capturing a CUDA graph."""
    if _stream_capturing():
        raise RuntimeError(
            f"ckpt_ext: {what} cannot be captured in a CUDA graph (torch.cuda.graph / make_graphed_callables): "
            f"{instead}")


def tag_compile_caches() -> str:
    """Adds a hash of ckpt_ext's operator schemas to torch.compile's cache-key tag and returns the tag part.

    torch.compile's on-disk caches (FX graph, AOTAutograd) key a compiled graph on its code, not on the
    schemas of the custom operators it calls: compiled code cached by one ckpt_ext release would call an
    operator whose arguments another release changed (an upgrade, a rebuild). With the schemas' hash in
    ``torch.compiler.config.cache_key_tag`` such entries are simply not found; caches of an unchanged
    ckpt_ext are reused. A tag the user set (``TORCH_COMPILE_CACHE_KEY_TAG``) is kept, ours appended.
    torch releases without the option (before 2.6) are left as they are.
    """
    import hashlib

    config = getattr(torch.compiler, "config", None)
    if config is None or not hasattr(config, "cache_key_tag"):
        return ""
    schemas = sorted(str(s) for s in torch._C._jit_get_all_schemas() if str(s.name).startswith("ckpt_ext::"))
    part = "ckpt_ext-" + hashlib.sha1("\n".join(schemas).encode()).hexdigest()[:12]
    tag = config.cache_key_tag or ""
    kept = [t for t in tag.split("+") if t and not t.startswith("ckpt_ext-")]
    config.cache_key_tag = "+".join(kept + [part])
    return part
