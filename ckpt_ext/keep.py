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

The further levels (:data:`KEEP_VALUES`: "attention_inputs", "gemms", "gemms_attention"; :class:`KeepLevel`) keep
GEMM outputs the same way: the function mode also catches ``F.linear`` and ``torch.addmm``, and around each such call
a dispatch mode keeps (forward) or hands back (replay) the GEMM kernel's output (:data:`GEMM_OPS`), so the replay's
autograd node for it is the GEMM's own, on the replay's inputs: gradients stay bit-identical. docs/keep-attention.md
"Recompute levels".
"""
import contextlib
import functools
import threading
import time
import warnings
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from ._user_frame import user_stacklevel

__all__ = ["KEEP_VALUES", "LEVELS", "check_keep", "keep_attention", "keep_level", "KeepAttention", "KeepLevel",
           "AttentionProbe", "LevelProbe", "LSE_OPS", "GEMM_OPS", "compiled_context_fn", "warn_not_kept", "fused_level",
           "compiled_fused_level", "compiled_level_fallback", "level_of"]

# The documented values of keep=, with what each keeps besides the checkpointed segments' inputs, from least to
# most (docs/keep-attention.md "Recompute levels").
KEEP_VALUES = {
    "boundaries": "only its input (the segment boundary); the replay runs the whole layer",
    "attention": "its input and its attention kernel's output and log-sum-exp; the replay skips the attention "
                 "forward",
    "attention_inputs": "its input, its attention kernel's output and log-sum-exp and the outputs of the GEMMs it runs "
                        "before its attention (the query/key/value projections); the replay skips those projections "
                        "and the attention forward",
    "gemms": "its input and the outputs of all its GEMMs (torch.nn.functional.linear, torch.addmm: projections "
             "and MLP); the replay runs only the elementwise ops, norms and the attention",
    "gemms_attention": "its input, the outputs of all its GEMMs and its attention kernel's output and log-sum-exp; the "
                       "replay runs only the elementwise ops and norms",
}

# Per level above "boundaries": (keeps the attention kernels' outputs, which GEMM outputs it keeps: None, "before"
# the layer's first SDPA call, or "all").
LEVELS = {
    "boundaries": (False, None),
    "attention": (True, None),
    "attention_inputs": (True, "before"),
    "gemms": (False, "all"),
    "gemms_attention": (True, "all"),
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

# The GEMM kernels below torch.nn.functional.linear and torch.addmm (keep="gemms" keeps their outputs), and the
# torch functions the keep levels catch for them.
GEMM_OPS = frozenset(getattr(torch.ops.aten, name).default for name in ("mm", "addmm", "bmm", "baddbmm")
                     if hasattr(torch.ops.aten, name))
_GEMM_FUNCS = (F.linear, torch.addmm)


def check_keep(keep: Any) -> str:
    """Validates keep= (None means the default, "boundaries"); returns the value."""
    if keep is None:
        return "boundaries"
    if isinstance(keep, str) and keep in KEEP_VALUES:
        return keep
    allowed = "; ".join(f"{k!r}: each checkpointed layer keeps {v}" for k, v in KEEP_VALUES.items())
    raise ValueError(f"keep must be one of {', '.join(map(repr, KEEP_VALUES))} ('boundaries' is the default; None "
                     f"means it), got {keep!r} ({allowed})")


def level_of(attention: bool, gemms: Optional[str]) -> str:
    """The keep level that keeps attention (or not) and the GEMM outputs `gemms` (None, "before", "all"); "before"
    without attention is "attention_inputs" (there is no level keeping the projections alone)."""
    for name, (a, g) in LEVELS.items():
        if (a, g) == (attention or gemms == "before", gemms):
            return name
    raise ValueError(f"no keep level keeps attention={attention} and gemms={gemms!r}")


def keeps_attention(keep: str) -> bool:
    """Whether keep level `keep` keeps the attention kernels' outputs and log-sum-exps."""
    return LEVELS.get(keep, (False, None))[0]


def keeps_gemms(keep: str) -> Optional[str]:
    """Which GEMM outputs keep level `keep` keeps: None, "before" (those before the layer's attention) or "all"."""
    return LEVELS.get(keep, (False, None))[1]


def fused_level(keep: str) -> str:
    """The level a fused (C++) segment keeps for `keep`: every level (csrc/layers' KeptAttention and KeptGemms)."""
    return keep if keep in LEVELS else "boundaries"


def compiled_fused_level(keep: str) -> str:
    """The level a fused segment keeps for `keep` under torch.compile, where it is the ``ckpt_ext::fused_segment``
    operator, which keeps only its input: every level (attention, its inputs, GEMM outputs) runs as "boundaries"
    there, warned once (:func:`compiled_level_fallback`; explain() says so)."""
    return "boundaries"


def compiled_level_fallback(keep: str) -> str:
    """Under torch.compile a checkpointed group of fused layers at keep level `keep` runs as the level the
    ``ckpt_ext::fused_segment`` operator keeps (:func:`compiled_fused_level`: "boundaries"): the same gradients, more
    recompute and less memory than the level. Warns once per level. Dynamo calls it while tracing (a constant result,
    no graph break), so the warning comes at compile time."""
    level = compiled_fused_level(keep)
    warn_once(("compiled fused level", keep),
              f"ckpt_ext keep={keep!r}: under torch.compile a checkpointed group of fused layers is the "
              f"ckpt_ext::fused_segment operator, which keeps only its input, so these groups run as keep={level!r} "
              "there (attention and any GEMM outputs are recomputed in backward: more recompute and less memory than "
              "the level; the same gradients). Run the step eagerly to keep them. ckpt_ext.explain(model) says so too.")
    return level


compiled_level_fallback._dynamo_marked_constant = True  # what torch.compiler.assume_constant_result sets


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
    """Forward, around one SDPA (or GEMM) call: runs the fused (GEMM) kernel and keeps its outputs."""

    def __init__(self, ops=LSE_OPS):
        super().__init__()
        self.kept: List[_Kept] = []
        self.ops = ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in self.ops:
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

    def __init__(self, kept: List[_Kept], where: str, ops=LSE_OPS, keep: str = "attention"):
        super().__init__()
        self.kept = kept
        self.next = 0
        self.where = where
        self.ops = ops
        self.keep = keep

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in self.ops:
            return func(*args, **kwargs)
        kept = self.kept[self.next] if self.next < len(self.kept) else None
        self.next += 1
        if kept is None or kept.op is not func or kept.shapes != _shapes(args):
            raise torch.utils.checkpoint.CheckpointError(
                f"ckpt_ext keep={self.keep!r} ({self.where}): the replay ran the kernel {func} on inputs of "
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


def warn_once(key, message: str):
    """One warning per `key` in this process (keep's and the fused levels' notices)."""
    _warn_once(key, message)


def warn_not_kept(name: str, reason: str, keep: str = "attention"):
    """keep='attention''s (and the other levels keeping attention) one warning per reason a layer keeps no attention
    output (plain and fused layers): names the first such layer; explain() lists them all."""
    _warn_once(("not kept", reason),
               f"ckpt_ext keep={keep!r}: {name} keeps no attention output, because {reason}. Its attention is "
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
    """The state of one checkpointed call at a keep level: the kernels' outputs its forward kept, one entry per
    caught call (SDPA and/or GEMM, in the order they ran; None where nothing was kept), handed back (once) by its
    replay, which makes the same calls in the same order. Created per call by :class:`KeepLevel`."""

    __slots__ = ("spec", "kept", "calls", "seen", "told")

    def __init__(self, spec: "KeepLevel"):
        self.spec = spec
        self.kept: List[Optional[List[_Kept]]] = []  # per caught call: the kernels' outputs, or None
        self.calls = 0  # replay: caught calls seen so far
        self.seen: set = set()  # forward: the layers (indices in spec.names) that called SDPA
        self.told: set = set()  # forward: the layers whose kept GEMM bytes were reported

    def _layer(self) -> int:
        return self.spec.current() if self.spec.current is not None else 0

    def _record(self, kept: List[_Kept]):
        self.kept.append(kept)
        for refs in _recorders:
            refs.extend(weakref.ref(t) for k in kept for t in _tensors(k.outputs))

    def forward(self, args, kwargs):
        capture = _Capture()
        with capture:
            out = _SDPA(*args, **kwargs)
        layer = self._layer()
        self.seen.add(layer)
        if capture.kept:
            self._record(capture.kept)
            self.spec.tell(layer, sum(k.nbytes() for k in capture.kept), None)
        else:
            self.kept.append(None)
            self.spec.tell(layer, None, _math_path_reason(args, kwargs))
        return out

    def forward_gemm(self, func, args, kwargs):
        layer = self._layer()
        if self.spec.gemms == "before" and layer in self.seen:  # after the layer's attention: not kept
            self.kept.append(None)
            return func(*args, **kwargs)
        capture = _Capture(GEMM_OPS)
        with capture:
            out = func(*args, **kwargs)
        if capture.kept:
            self._record(capture.kept)
            self.spec.tell_gemm(layer, sum(k.nbytes() for k in capture.kept), layer not in self.told)
            self.told.add(layer)
        else:
            self.kept.append(None)
        return out

    def forward_done(self):
        """After the forward: layers that called no SDPA at all keep no attention either; say so."""
        if not self.spec.attention:
            return
        for layer in range(len(self.spec.names)):
            if layer not in self.seen:
                self.spec.tell(layer, None, "it called no torch.nn.functional.scaled_dot_product_attention (eager "
                                            "attention, or attention written out by hand), so no attention kernel "
                                            "output and log-sum-exp exist to keep")

    def replay(self, func, args, kwargs, ops=LSE_OPS):
        i = self.calls
        self.calls += 1
        kept = self.kept[i] if i < len(self.kept) else None
        if kept is None:  # nothing kept (math path), or handed back already (a second backward: retain_graph)
            return func(*args, **kwargs)
        self.kept[i] = None  # handed back once: freed as soon as the replay's own graph no longer needs it
        if not all(k.unchanged() for k in kept):
            _warn_once((self.spec.where, "modified", ops is LSE_OPS),
                       f"ckpt_ext keep={self.spec.keep!r}: {self.spec.names[self._layer()]}: the "
                       f"{'attention' if ops is LSE_OPS else 'GEMM'} output kept in forward was modified in place "
                       "afterwards; it is recomputed instead.")
            return func(*args, **kwargs)
        with _HandBack(kept, self.spec.names[self._layer()], ops, self.spec.keep):
            return func(*args, **kwargs)


class _ForwardMode(TorchFunctionMode):
    def __init__(self, region: _Region):
        super().__init__()
        self.region = region
        self.attention = region.spec.attention
        self.gemms = region.spec.gemms is not None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is _SDPA and self.attention:
            return self.region.forward(args, kwargs or {})
        if self.gemms and func in _GEMM_FUNCS:
            return self.region.forward_gemm(func, args, kwargs or {})
        return func(*args, **(kwargs or {}))

    def __exit__(self, exc_type, exc_val, exc_tb):
        super().__exit__(exc_type, exc_val, exc_tb)
        if exc_type is None:
            self.region.forward_done()


class _ReplayMode(TorchFunctionMode):
    def __init__(self, region: _Region):
        super().__init__()
        self.region = region
        self.attention = region.spec.attention
        self.gemms = region.spec.gemms is not None

    def __enter__(self):
        self.region.calls = 0
        return super().__enter__()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is _SDPA and self.attention:
            return self.region.replay(func, args, kwargs or {})
        if self.gemms and func in _GEMM_FUNCS:
            return self.region.replay(func, args, kwargs or {}, GEMM_OPS)
        return func(*args, **(kwargs or {}))


# The budget planner's probe timer: time.perf_counter, unless a benchmark has set another clock with
# ckpt_ext.stack_plan.probe_clock (benchmarks/bench_work.py: the work model's predicted GPU seconds).
_PROBE_CLOCK: Optional[Callable[[], float]] = None


def probe_time() -> float:
    """Seconds, as the budget planner's probe reads them (time.perf_counter unless stack_plan.probe_clock set
    another clock)."""
    return time.perf_counter() if _PROBE_CLOCK is None else _PROBE_CLOCK()


class LevelProbe(TorchFunctionMode):
    """The budget planner's probe of one layer forward: for each SDPA call and (with ``gemms``) each GEMM call
    (torch.nn.functional.linear, torch.addmm), the seconds it took and the storages of what a keep level would keep
    (the fused kernel's outputs; the GEMM's output), or why nothing (SDPA's math path). ``calls``: [(kind ("sdpa" or
    "gemm"), before the layer's first SDPA call, seconds, process CPU seconds, storages or None, reason or None)].
    The storages are held until :meth:`clear`, so that the saved tensors the layer's forward packs can be matched
    against them by address."""

    def __init__(self, synchronize: Optional[Callable[[], None]] = None, gemms: bool = True):
        super().__init__()
        self.calls: List[Tuple[str, bool, float, float, Optional[List[torch.UntypedStorage]], Optional[str]]] = []
        self.synchronize = synchronize or (lambda: None)
        self.gemms = gemms
        self.attended = False

    def _timed(self, func, args, kwargs, ops):
        capture = _Capture(ops)
        self.synchronize()
        start, cpu = probe_time(), time.process_time()
        with capture:
            out = func(*args, **kwargs)
        self.synchronize()
        elapsed, cpu = probe_time() - start, time.process_time() - cpu
        storages = [t.untyped_storage() for k in capture.kept for t in _tensors(k.outputs)]
        capture.kept.clear()
        return out, elapsed, cpu, storages

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _SDPA:
            out, elapsed, cpu, storages = self._timed(func, args, kwargs, LSE_OPS)
            why = None if storages else _math_path_reason(args, kwargs)
            self.calls.append(("sdpa", not self.attended, elapsed, cpu, storages or None, why))
            self.attended = True
            return out
        if self.gemms and func in _GEMM_FUNCS:
            out, elapsed, cpu, storages = self._timed(func, args, kwargs, GEMM_OPS)
            self.calls.append(("gemm", not self.attended, elapsed, cpu, storages or None, None))
            return out
        return func(*args, **kwargs)

    @property
    def cpu_seconds(self) -> float:
        """The SDPA calls' process CPU seconds."""
        return sum(c for kind, _, _, c, _, _ in self.calls if kind == "sdpa")

    def result(self, alignment: int = 1) -> Tuple[Optional[int], float, Optional[str]]:
        """(kept bytes, attention seconds, why nothing) of keep="attention": bytes None when a call kept nothing or
        there was no call. Each kept tensor counts in whole multiples of `alignment` bytes (a pool slot's)."""
        sdpa = [c for c in self.calls if c[0] == "sdpa"]
        if not sdpa:
            return None, 0.0, ("it called no torch.nn.functional.scaled_dot_product_attention (eager attention, or "
                               "attention written out by hand)")
        why = next((r for *_, r in sdpa if r is not None), None)
        seconds = sum(c[2] for c in sdpa)
        kept = None if why else sum(-(-st.nbytes() // alignment) * alignment for c in sdpa for st in c[4])
        return kept, seconds, why

    def levels(self, saved: Dict[int, int], alignment: int = 1) -> Dict[str, Tuple[int, int, float, float, bool]]:
        """Per keep level above "boundaries": (kept bytes, bytes of the layer's saved tensors that are among them --
        the replay does not count them again --, seconds and CPU seconds its replay skips, whether the level is
        kept whole: False when the layer's attention keeps nothing, the level then keeping only its GEMMs).
        `saved`: {storage address: bytes} of what the layer's forward saved for backward."""
        out = {}
        for level, (att, gem) in LEVELS.items():
            if level == "boundaries" or (gem is not None and not self.gemms):
                continue
            kept: Dict[int, int] = {}
            seconds = cpu = 0.0
            whole = True
            for kind, before, elapsed, c, storages, _ in self.calls:
                if kind == "sdpa" and not att:
                    continue
                if kind == "gemm" and (gem is None or (gem == "before" and not before)):
                    continue
                if storages is None:
                    whole = False
                    continue
                seconds, cpu = seconds + elapsed, cpu + c
                for st in storages:
                    kept[st.data_ptr()] = -(-st.nbytes() // alignment) * alignment
            if att and not any(kind == "sdpa" for kind, *_ in self.calls):
                whole = False
            overlap = sum(saved[p] for p in kept if p in saved)
            out[level] = (sum(kept.values()), overlap, seconds, cpu, whole)
        return out

    def clear(self):
        self.calls.clear()


# The probe of keep="attention" alone (no GEMM caught).
def AttentionProbe(synchronize: Optional[Callable[[], None]] = None) -> LevelProbe:
    return LevelProbe(synchronize, gemms=False)


class KeepLevel:
    """A ``context_fn`` for ``ckpt_ext.checkpoint`` (and torch's non-reentrant checkpoint): the checkpointed
    function keeps what keep level ``keep`` says (KEEP_VALUES: its attention kernels' outputs and log-sum-exps,
    GEMM outputs) and its replay hands them back instead of computing them.

    ``names``: the layers the region runs, for messages (default: one, "the checkpointed function");
    ``current()``: the index of the layer running now (a group of several layers); ``report(index,
    kept_bytes, reason)``: told, at every forward, what each SDPA call kept (``kept_bytes`` None and a
    ``reason`` when nothing); ``report_gemm(index, kept_bytes, first)``: what each GEMM call kept (first: the
    layer's first in this forward). Attention kept
    nothing warns once per reason (:func:`warn_not_kept`)."""

    __slots__ = ("where", "names", "current", "report", "report_gemm", "keep", "attention", "gemms")

    def __init__(self, names: Optional[List[str]] = None, current: Optional[Callable[[], int]] = None,
                 report: Optional[Callable] = None, keep: str = "attention", report_gemm: Optional[Callable] = None):
        if keep not in LEVELS or keep == "boundaries":
            raise ValueError(f"KeepLevel: keep must be one of {', '.join(repr(k) for k in LEVELS if k != 'boundaries')}"
                             f", got {keep!r}")
        self.names = list(names) if names else ["the checkpointed function"]
        self.where = self.names[0] if len(self.names) == 1 else f"{self.names[0]} .. {self.names[-1]}"
        self.current = current
        self.report = report
        self.report_gemm = report_gemm
        self.keep = keep
        self.attention, self.gemms = LEVELS[keep]

    def tell(self, layer: int, kept_bytes: Optional[int], reason: Optional[str]):
        if self.report is not None:
            self.report(layer, kept_bytes, reason)
        if reason is not None:
            warn_not_kept(self.names[layer], reason, self.keep)

    def tell_gemm(self, layer: int, kept_bytes: int, first: bool = False):
        if self.report_gemm is not None:
            self.report_gemm(layer, kept_bytes, first)

    def __call__(self):
        region = _Region(self)
        return _ForwardMode(region), _ReplayMode(region)


class KeepAttention(KeepLevel):
    """:class:`KeepLevel` at keep="attention": the checkpointed function keeps its attention kernels' outputs and
    log-sum-exps, and its replay skips the attention forwards."""

    __slots__ = ()

    def __init__(self, names: Optional[List[str]] = None, current: Optional[Callable[[], int]] = None,
                 report: Optional[Callable] = None):
        super().__init__(names, current, report, "attention")


# ``ckpt_ext.checkpoint(fn, *args, context_fn=ckpt_ext.keep_attention)``: fn keeps its attention kernels' outputs
# and log-sum-exps and its replay skips the attention forwards (what enable_checkpointing's keep="attention" does).
keep_attention = KeepAttention()


def keep_level(keep: str) -> Optional[KeepLevel]:
    """The context_fn of keep level `keep` (None for "boundaries"): ``ckpt_ext.checkpoint(fn, *args,
    context_fn=ckpt_ext.keep.keep_level("gemms"))``."""
    keep = check_keep(keep)
    if keep == "boundaries":
        return None
    return keep_attention if keep == "attention" else KeepLevel(keep=keep)


# --------------------------------------------------------------------------------------------------
# torch.compile: torch's selective checkpointing, must-save for the fused kernels
# --------------------------------------------------------------------------------------------------
def _sac_policy(ops, ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy
    return CheckpointPolicy.MUST_SAVE if op in ops else CheckpointPolicy.PREFER_RECOMPUTE


def compiled_ops(keep: str = "attention") -> frozenset:
    """The kernels whose outputs a region of keep level `keep` must save under torch.compile: the fused attention
    kernels where it keeps attention, the GEMMs where it keeps all of them. keep="attention_inputs" is traced as
    keep="attention" (a selective-checkpoint policy sees single operators, not which GEMMs feed the attention):
    its projections are recomputed, less memory than planned."""
    attention, gemms = LEVELS[keep]
    return frozenset((LSE_OPS if attention else frozenset()) | (GEMM_OPS if gemms == "all" else frozenset()))


def compiled_context_fn(keep: str = "attention") -> Callable:
    """What a region of keep level `keep` (keep="attention" by default) is traced with under torch.compile: torch's
    selective-checkpoint contexts whose policy must save the kernels of :func:`compiled_ops` (the partitioner keeps
    them and recomputes the rest)."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts
    return functools.partial(create_selective_checkpoint_contexts, functools.partial(_sac_policy, compiled_ops(keep)))
