"""keep="attention": a checkpointed region keeps its attention kernels' outputs and log-sum-exps, and its
replay runs everything but the attention forwards.

With a fused SDPA kernel (CPU: ``_scaled_dot_product_flash_attention_for_cpu``; CUDA: flash, efficient,
cuDNN) the attention backward needs the kernel's inputs q, k, v, its output and its log-sum-exp (LSE), and
on CUDA with dropout the Philox seed/offset it drew. q, k and v are cheap to recompute (projections,
rotary); the output and LSE are small (B x S x H and B x heads x S) while the attention forward is a large
part of a layer's compute at long sequences. So the forward keeps those outputs and the replay hands them
back instead of running the kernel: the attention backward then runs on the forward's own output and LSE,
and every gradient is bit-identical to training without checkpointing (the same ops, in the same order,
on the same values).

Mechanism (chosen for cost, docs/design.md "keep='attention'"): a ``TorchFunctionMode`` around the region
catches only ``torch.nn.functional.scaled_dot_product_attention`` (one Python test per torch call of the
region, no ATen-level dispatch mode over every operator as torch's selective checkpointing uses); around
that one call a ``TorchDispatchMode`` sees the few operators SDPA dispatches below autograd and keeps (in
forward) or hands back (in the replay) the outputs of the fused kernel. Autograd records the kernel's node
as usual in both runs, so the checkpoint engine's checks (what the replay saved, shapes, dtypes) hold.

Where an SDPA call runs a path without an LSE (SDPA's math path: attention dropout on CPU, an unsupported
mask, dtype or head size, ``sdpa_kernel`` restrictions) nothing is kept for it and its replay recomputes it in
full -- the gradients stay exact -- and one warning per reason says so, naming the first layer
(:func:`warn_not_kept`; ``explain()`` lists every layer and why). A layer that calls no SDPA at all (Hugging
Face eager attention) gets the same warning; a Hugging Face model configured for another attention
implementation is refused when checkpointing is enabled (stack.py). Fused layers (C++) follow the same rule.

Under torch.compile the region is traced as torch's checkpoint with a selective-checkpoint policy that
must save the same kernels' outputs (:func:`compiled_context_fn`); AOTAutograd's partitioner then keeps
them and recomputes the rest.
"""
import contextlib
import functools
import threading
import time
import warnings
import weakref
from typing import Any, Callable, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from ._user_frame import user_stacklevel

__all__ = ["KEEP_VALUES", "check_keep", "keep_attention", "KeepAttention", "AttentionProbe", "LSE_OPS",
           "compiled_context_fn", "warn_not_kept"]

# The documented values of keep=, with what each keeps besides the checkpointed segments' inputs.
KEEP_VALUES = {
    "boundaries": "only its input (the segment boundary); the replay runs the whole layer",
    "attention": "its input and its attention kernel's output and log-sum-exp; the replay skips the attention "
                 "forward",
}

_SDPA = F.scaled_dot_product_attention

# The fused SDPA kernels that return an LSE, as autograd sees them (the ops whose backward takes the output
# and LSE). Absent ones (older torches) are skipped.
LSE_OPS = frozenset(
    getattr(torch.ops.aten, name).default
    for name in ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
                 "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                 "_scaled_dot_product_fused_attention_overrideable", "_efficient_attention_forward",
                 "_flash_attention_forward")
    if hasattr(torch.ops.aten, name))


def check_keep(keep: Any) -> str:
    """Validates keep= (None means the default, "boundaries"); returns the value."""
    if keep is None:
        return "boundaries"
    if isinstance(keep, str) and keep in KEEP_VALUES:
        return keep
    allowed = "; ".join(f"{k!r}: each checkpointed layer keeps {v}" for k, v in KEEP_VALUES.items())
    raise ValueError(f"keep must be one of 'boundaries' (the default; None means it) or 'attention', got {keep!r} "
                     f"({allowed})")


# --------------------------------------------------------------------------------------------------
# What one checkpointed call keeps
# --------------------------------------------------------------------------------------------------
def _detach(x):
    # A detached alias (the forward's own output keeps its grad_fn), made with ADInplaceOrView included so
    # that its version counter is the original's (torch's _detach_helper does the same).
    if isinstance(x, torch.Tensor):
        with torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.ADInplaceOrView, False):
            return x.detach()
    return x


def _generator_offset(args) -> Optional[Tuple[torch.Generator, int]]:
    """The default CUDA generator of the call's device and its Philox offset (the fused kernels draw their
    dropout from it), or None on CPU (the CPU flash kernel takes no dropout)."""
    q = args[0] if args and isinstance(args[0], torch.Tensor) else None
    if q is None or q.device.type != "cuda":
        return None
    gen = torch.cuda.default_generators[q.device.index if q.device.index is not None else torch.cuda.current_device()]
    return gen, gen.get_offset()


class _Kept:
    """The outputs of one fused kernel call, kept from forward to the replay."""

    __slots__ = ("op", "outputs", "versions", "shapes", "rng_advance")

    def __init__(self, op, outputs, shapes, rng_advance: int):
        self.op = op
        self.outputs = tree_map(_detach, outputs)
        self.versions = [t._version for t in _tensors(self.outputs)]
        self.shapes = shapes
        self.rng_advance = rng_advance

    def unchanged(self) -> bool:
        return all(t._version == v for t, v in zip(_tensors(self.outputs), self.versions))

    def nbytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in _tensors(self.outputs))


def _tensors(outputs) -> List[torch.Tensor]:
    outs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
    return [t for t in outs if isinstance(t, torch.Tensor)]


def _shapes(args) -> Tuple:
    return tuple(tuple(a.shape) if isinstance(a, torch.Tensor) else None for a in args[:3])


class _Capture(TorchDispatchMode):
    """Forward, around one SDPA call: runs the fused kernel and keeps its outputs."""

    def __init__(self):
        super().__init__()
        self.kept: List[_Kept] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in LSE_OPS:
            return func(*args, **kwargs)
        rng = _generator_offset(args)
        out = func(*args, **kwargs)
        advance = rng[0].get_offset() - rng[1] if rng is not None else 0
        self.kept.append(_Kept(func, out, _shapes(args), advance))
        return out


class _HandBack(TorchDispatchMode):
    """Replay, around one SDPA call: returns the kept outputs in place of running the fused kernel (and
    advances the CUDA generator as the kernel did, so that the random ops after it draw the forward's
    numbers)."""

    def __init__(self, kept: List[_Kept], where: str):
        super().__init__()
        self.kept = kept
        self.next = 0
        self.where = where

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in LSE_OPS:
            return func(*args, **kwargs)
        kept = self.kept[self.next] if self.next < len(self.kept) else None
        self.next += 1
        if kept is None or kept.op is not func or kept.shapes != _shapes(args):
            raise torch.utils.checkpoint.CheckpointError(
                f"ckpt_ext keep='attention' ({self.where}): the replay ran the attention kernel {func} on inputs of "
                f"shapes {_shapes(args)}, but the forward kept "
                f"{'nothing there' if kept is None else f'{kept.op} on inputs of shapes {kept.shapes}'}. A "
                "checkpointed layer must run the same operators in its replay as in forward.")
        if kept.rng_advance:
            gen = torch.cuda.default_generators[args[0].device.index]
            gen.set_offset(gen.get_offset() + kept.rng_advance)
        return kept.outputs


_warned: set = set()
_lock = threading.Lock()
_recorders: List[list] = []  # recording_kept()'s lists


@contextlib.contextmanager
def recording_kept():
    """Collects weak references to the tensors keep='attention' keeps in the forwards run inside the block
    (the benchmarks' memory accounting counts them, as they live outside autograd's saved tensors)."""
    refs: list = []
    _recorders.append(refs)
    try:
        yield refs
    finally:
        _recorders.remove(refs)


def _warn_once(key, message: str):
    with _lock:
        if key in _warned:
            return
        _warned.add(key)
    warnings.warn(message, stacklevel=user_stacklevel())


def warn_not_kept(name: str, reason: str):
    """keep='attention''s one warning per reason a layer keeps no attention output (plain and fused layers):
    names the first such layer; explain() lists them all."""
    _warn_once(("not kept", reason),
               f"ckpt_ext keep='attention': {name} keeps no attention output, because {reason}. Its attention is "
               "recomputed in backward (that layer is replayed in full; gradients are unaffected, only the saving is "
               "lost). Every other layer for which the same holds is replayed the same way without another warning: "
               "ckpt_ext.explain(model) lists them after the step.")


def _math_path_reason(args, kwargs) -> str:
    """Why SDPA ran a path without a log-sum-exp, as far as can be told from the call's arguments."""
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    call = dict(zip(names, args))
    call.update(kwargs)
    q, mask, p = call.get("query"), call.get("attn_mask"), call.get("dropout_p", 0.0)
    if not isinstance(q, torch.Tensor):
        return "its arguments are not tensors"
    if p and q.device.type == "cpu" and torch.is_grad_enabled():
        return (f"attention dropout p={p} on CPU: the CPU flash kernel takes no dropout, so SDPA runs its math "
                "path, which keeps no log-sum-exp (set the attention dropout to 0 to keep attention)")
    detail = f"query {tuple(q.shape)} {q.dtype} on {q.device}"
    if isinstance(mask, torch.Tensor):
        detail += f", mask {tuple(mask.shape)} {mask.dtype}"
    if p:
        detail += f", dropout_p={p}"
    return (f"SDPA chose its math path, which keeps no log-sum-exp, for {detail} (an unsupported dtype, mask or "
            "head size, or torch.nn.attention.sdpa_kernel restricting the backends)")


class _Region:
    """keep='attention' state of one checkpointed call: the kernels' outputs kept by its forward, handed
    back (once) by its replay. Created per call by :class:`KeepAttention`."""

    __slots__ = ("spec", "kept", "calls", "seen")

    def __init__(self, spec: "KeepAttention"):
        self.spec = spec
        self.kept: List[Optional[List[_Kept]]] = []  # per SDPA call: the kernels' outputs, or None
        self.calls = 0  # replay: SDPA calls seen so far
        self.seen: set = set()  # forward: the layers (indices in spec.names) that called SDPA

    def _layer(self) -> int:
        return self.spec.current() if self.spec.current is not None else 0

    def forward(self, args, kwargs):
        capture = _Capture()
        with capture:
            out = _SDPA(*args, **kwargs)
        layer = self._layer()
        self.seen.add(layer)
        if capture.kept:
            self.kept.append(capture.kept)
            for refs in _recorders:
                refs.extend(weakref.ref(t) for k in capture.kept for t in _tensors(k.outputs))
            self.spec.tell(layer, sum(k.nbytes() for k in capture.kept), None)
        else:
            self.kept.append(None)
            self.spec.tell(layer, None, _math_path_reason(args, kwargs))
        return out

    def forward_done(self):
        """After the forward: layers that called no SDPA at all keep nothing either; say so."""
        for layer in range(len(self.spec.names)):
            if layer not in self.seen:
                self.spec.tell(layer, None, "it called no torch.nn.functional.scaled_dot_product_attention (eager "
                                            "attention, or attention written out by hand), so no attention kernel "
                                            "output and log-sum-exp exist to keep")

    def replay(self, args, kwargs):
        i = self.calls
        self.calls += 1
        kept = self.kept[i] if i < len(self.kept) else None
        if kept is None:  # nothing kept (math path), or handed back already (a second backward: retain_graph)
            return _SDPA(*args, **kwargs)
        self.kept[i] = None  # handed back once: freed as soon as the replay's own graph no longer needs it
        if not all(k.unchanged() for k in kept):
            _warn_once((self.spec.where, "modified"),
                       f"ckpt_ext keep='attention': {self.spec.names[self._layer()]}: the attention output kept in "
                       "forward was modified in place afterwards; it is recomputed instead.")
            return _SDPA(*args, **kwargs)
        with _HandBack(kept, self.spec.names[self._layer()]):
            return _SDPA(*args, **kwargs)


class _ForwardMode(TorchFunctionMode):
    def __init__(self, region: _Region):
        super().__init__()
        self.region = region

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is _SDPA:
            return self.region.forward(args, kwargs or {})
        return func(*args, **(kwargs or {}))

    def __exit__(self, exc_type, exc_val, exc_tb):
        super().__exit__(exc_type, exc_val, exc_tb)
        if exc_type is None:
            self.region.forward_done()


class _ReplayMode(TorchFunctionMode):
    def __init__(self, region: _Region):
        super().__init__()
        self.region = region

    def __enter__(self):
        self.region.calls = 0
        return super().__enter__()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is _SDPA:
            return self.region.replay(args, kwargs or {})
        return func(*args, **(kwargs or {}))


class AttentionProbe(TorchFunctionMode):
    """The budget planner's probe of one layer forward: for each SDPA call, the seconds it took and what
    keep="attention" would keep (the fused kernel's outputs' bytes), or why nothing (the math path).
    ``calls``: [(seconds, kept bytes or None, reason or None)]; ``cpu_seconds``: the calls' process CPU time."""

    def __init__(self, synchronize: Optional[Callable[[], None]] = None):
        super().__init__()
        self.calls: List[Tuple[float, Optional[List[int]], Optional[str]]] = []
        self.synchronize = synchronize or (lambda: None)
        self.cpu_seconds = 0.0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not _SDPA:
            return func(*args, **kwargs)
        capture = _Capture()
        self.synchronize()
        start, cpu = time.perf_counter(), time.process_time()
        with capture:
            out = _SDPA(*args, **kwargs)
        self.synchronize()
        elapsed = time.perf_counter() - start
        self.cpu_seconds += time.process_time() - cpu
        if capture.kept:
            sizes = [t.untyped_storage().nbytes() for k in capture.kept for t in _tensors(k.outputs)]
            self.calls.append((elapsed, sizes, None))
        else:
            self.calls.append((elapsed, None, _math_path_reason(args, kwargs)))
        capture.kept.clear()
        return out

    def result(self, alignment: int = 1) -> Tuple[Optional[int], float, Optional[str]]:
        """(kept bytes, attention seconds, why nothing) of the layer: bytes None when a call kept nothing or
        there was no call. Each kept tensor counts in whole multiples of `alignment` bytes (a pool slot's)."""
        if not self.calls:
            return None, 0.0, ("it called no torch.nn.functional.scaled_dot_product_attention (eager attention, or "
                               "attention written out by hand)")
        why = next((r for _, b, r in self.calls if b is None), None)
        seconds = sum(t for t, _, _ in self.calls)
        kept = None if why else sum(-(-n // alignment) * alignment for _, sizes, _ in self.calls for n in sizes)
        return kept, seconds, why


class KeepAttention:
    """A ``context_fn`` for ``ckpt_ext.checkpoint`` (and torch's non-reentrant checkpoint): the checkpointed
    function keeps its attention kernels' outputs and log-sum-exps, and its replay skips the attention
    forwards.

    ``names``: the layers the region runs, for messages (default: one, "the checkpointed function");
    ``current()``: the index of the layer running now (a group of several layers); ``report(index,
    kept_bytes, reason)``: told, at every forward, what each SDPA call kept (``kept_bytes`` None and a
    ``reason`` when nothing). Nothing kept warns once per reason (:func:`warn_not_kept`)."""

    __slots__ = ("where", "names", "current", "report")

    def __init__(self, names: Optional[List[str]] = None, current: Optional[Callable[[], int]] = None,
                 report: Optional[Callable] = None):
        self.names = list(names) if names else ["the checkpointed function"]
        self.where = self.names[0] if len(self.names) == 1 else f"{self.names[0]} .. {self.names[-1]}"
        self.current = current
        self.report = report

    def tell(self, layer: int, kept_bytes: Optional[int], reason: Optional[str]):
        if self.report is not None:
            self.report(layer, kept_bytes, reason)
        if reason is not None:
            warn_not_kept(self.names[layer], reason)

    def __call__(self):
        region = _Region(self)
        return _ForwardMode(region), _ReplayMode(region)


# ``ckpt_ext.checkpoint(fn, *args, context_fn=ckpt_ext.keep_attention)``: fn keeps its attention kernels' outputs
# and log-sum-exps and its replay skips the attention forwards (what enable_checkpointing's keep="attention" does).
keep_attention = KeepAttention()


# --------------------------------------------------------------------------------------------------
# torch.compile: torch's selective checkpointing, must-save for the fused kernels
# --------------------------------------------------------------------------------------------------
def _sac_policy(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy
    return CheckpointPolicy.MUST_SAVE if op in LSE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def compiled_context_fn() -> Callable:
    """What a keep='attention' region is traced with under torch.compile: torch's selective-checkpoint
    contexts whose policy must save the fused attention kernels' outputs (the partitioner keeps them and
    recomputes the rest)."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts
    return functools.partial(create_selective_checkpoint_contexts, _sac_policy)
