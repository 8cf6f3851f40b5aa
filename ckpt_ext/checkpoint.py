"""ckpt_ext.checkpoint: a drop-in for torch's non-reentrant torch.utils.checkpoint.checkpoint.

The design is torch's own (csrc/checkpoint/checkpoint_frame.cpp, docs/design.md): the function runs
in forward with grad enabled, building the real autograd graph, under saved-tensor hooks whose pack
(C++) drops every tensor autograd would save and keeps a small holder instead. The first unpack in a
backward replays the function (C++: under the forward's (seed, offset) RNG, autocast and device state)
with hooks that fill the holders, stopping as soon as all are filled, and checks that the replay saved
what the forward saved. Gradients flow through the real graph.

This module does what must be Python: the call's options, the user's contexts (context_fn, debug), the
BatchNorm guard of a replay, and what the C++ frame asks of it off its common path (names for errors,
devices in nested arguments, the BatchNorm modules a closure uses).
"""
import functools
import inspect
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.utils.checkpoint as _torch_checkpoint
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils import _pytree as pytree

from . import _compiler
from ._compiler import check_not_capturing, traced_under_compile
from ._discovery import _check_fsdp_units, _collect, _discover, _Found, _fsdp_unit_class
from ._extension import load
from .keep import KeepLevel, check_keep, compiled_context_fn, keep_level

_C = load()
_run = _C.checkpoint_run
_Tensor = torch.Tensor
# torch's own functions, taken at import: code that replaces torch.utils.checkpoint.checkpoint by ckpt_ext's
# (a common way to adopt a drop-in) must not send ckpt_ext's calls to torch's back to ckpt_ext.
_torch_checkpoint_fn = _torch_checkpoint.checkpoint
_torch_checkpoint_sequential_fn = _torch_checkpoint.checkpoint_sequential
# torch >= 2.15: checkpoint(respect_saved_tensors_hooks=...) routes the tensors selective checkpointing
# caches through the user's saved-tensor hooks. Where torch lacks it the keyword is the function's, as there.
_RESPECT_HOOKS = "respect_saved_tensors_hooks" in inspect.signature(_torch_checkpoint_fn).parameters
_CachingMode = getattr(_torch_checkpoint, "_CachingTorchDispatchMode", None)

__all__ = ["checkpoint", "checkpoint_sequential", "is_recomputing"]


def is_recomputing() -> bool:
    """True while ckpt_ext replays a checkpointed function during backward (on this thread)."""
    return bool(_C.is_recomputing())


# --------------------------------------------------------------------------------------------------
# Naming and debug recording
# --------------------------------------------------------------------------------------------------
def _function_name(fn: Any) -> str:
    if isinstance(fn, functools.partial):
        return f"partial({_function_name(fn.func)})"
    if isinstance(fn, nn.Module):
        return type(fn).__name__
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__
    owner = getattr(fn, "__self__", None)
    if isinstance(owner, nn.Module) and "." not in name:
        name = f"{type(owner).__name__}.{name}"
    return name


class _OpRecorder(torch.utils._python_dispatch.TorchDispatchMode):
    """debug=True: records the ATen operators a run executes."""

    def __init__(self, log: List[str]):
        super().__init__()
        self.log = log

    def __enter__(self):
        self.log.clear()
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        shapes = [tuple(t.shape) for t in pytree.tree_leaves(out) if isinstance(t, _Tensor)]
        self.log.append(f"{func}{shapes}")
        return out


def _describe(fwd: List[str], rep: List[str]) -> str:
    first = next((i for i, (a, b) in enumerate(zip(fwd, rep)) if a != b), min(len(fwd), len(rep)))
    lines = [f"debug: forward ran {len(fwd)} operator(s), the replay {len(rep)}; first difference at #{first}:"]
    for i in range(max(0, first - 2), min(max(len(fwd), len(rep)), first + 3)):
        a = fwd[i] if i < len(fwd) else "-"
        b = rep[i] if i < len(rep) else "-"
        lines.append(f"  #{i}: forward {a}   |   replay {b}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# The replay: what the C++ frame calls on the first unpack of a backward.
# --------------------------------------------------------------------------------------------------
def _batchnorms_of(fn, args) -> List[_BatchNorm]:
    """The training BatchNorm modules with running statistics that `fn`, not a module, uses (see _discovery);
    the C++ frame walks a module's own submodules itself."""
    return _discover(fn, args, set()).batchnorms


class _BatchNormGuard:
    """The forward already updated BatchNorm running statistics; the replay must not do it again (torch's
    checkpoint does). The modules are found when the replay starts (not in forward: no per-call cost) and
    their statistics put back when it ends, however it ends."""

    __slots__ = ("modules", "saved")

    def __init__(self, modules: List[_BatchNorm]):
        self.modules = modules

    def __enter__(self):
        self.saved = [[b.clone() if b is not None else None
                       for b in (m.running_mean, m.running_var, m.num_batches_tracked)] for m in self.modules]
        return self

    def __exit__(self, *exc):
        with torch.no_grad():
            for m, old in zip(self.modules, self.saved):
                for buf, value in zip((m.running_mean, m.running_var, m.num_batches_tracked), old):
                    if buf is not None:
                        buf.copy_(value)
        self.saved = None
        return False


def _replay_guarded(fn, args: tuple, kwargs: Optional[dict], context, batchnorms: List[_BatchNorm]):
    """The replay (called by the C++ frame) when it has a recompute context or BatchNorm statistics to put
    back; without either the frame calls the function itself."""
    kwargs = kwargs or {}
    if batchnorms:
        with _BatchNormGuard(batchnorms):
            return _in_context(context, fn, *args, **kwargs)
    return _in_context(context, fn, *args, **kwargs)


def _replay_note(fn, e: BaseException):
    """Called by the frame with an error the replay raised (KeyboardInterrupt too: the note tells where it
    landed). The traceback shows the function's own frames under loss.backward(); say why."""
    if hasattr(e, "add_note"):  # Python 3.11+
        e.add_note(f"(raised while ckpt_ext replayed the checkpointed function `{_function_name(fn)}` "
                   "during backward: a checkpointed function runs again in backward, with "
                   "ckpt_ext.is_recomputing() True)")


# --------------------------------------------------------------------------------------------------
# FSDP2: see ckpt_ext/_discovery.py. checkpoint(unit, ...) keeps the unit's hooks outside.
# --------------------------------------------------------------------------------------------------
_MISSING = object()


def _checkpoint_fsdp_unit(unit: nn.Module, args: tuple, kwargs: dict, options: Dict[str, Any]):
    """checkpoint(unit, ...) on an FSDP unit: the unit is called as usual, so that its hooks run around
    the call, and only its forward is checkpointed (as enable_checkpointing does for every layer)."""
    inner = unit.forward
    previous = unit.__dict__.get("forward", _MISSING)
    unit.__dict__["forward"] = lambda *a, **k: _checkpoint(inner, a, k, outside=unit, **options)
    try:
        return unit(*args, **kwargs)
    finally:
        if previous is _MISSING:
            del unit.__dict__["forward"]
        else:
            unit.__dict__["forward"] = previous


# --------------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------------
_DETERMINISM = {"default": True, "none": False}


def _check_options(use_reentrant, determinism_check, debug, preserve_rng_state, early_stop=True, context_fn=None):
    if use_reentrant is not None and not isinstance(use_reentrant, bool):
        raise TypeError(f"use_reentrant must be None, True or False, got {use_reentrant!r}")
    if determinism_check not in _DETERMINISM:
        raise ValueError(f"determinism_check must be one of {sorted(_DETERMINISM)}, got {determinism_check!r}")
    if not isinstance(debug, bool):
        raise TypeError(f"debug must be True or False, got {debug!r}")
    if not isinstance(preserve_rng_state, bool):
        raise TypeError(f"preserve_rng_state must be True or False, got {preserve_rng_state!r}")
    if not isinstance(early_stop, bool):
        raise TypeError(f"early_stop must be True or False, got {early_stop!r}")
    if not _is_noop_context_fn(context_fn) and not callable(context_fn):
        raise TypeError(f"context_fn must be callable, got {type(context_fn).__name__}")


def _devices(args: tuple, kwargs: Optional[dict]) -> List[torch.device]:
    """The devices of the call's tensors anywhere in its arguments whose generators are snapshotted: all but
    CPU (always) and meta (none), as torch's get_device_states. The C++ frame walks plain lists, tuples and
    dicts itself and calls this where another pytree node may hold tensors."""
    return [t.device for t in pytree.tree_leaves((args, kwargs or {}))
            if isinstance(t, _Tensor) and not t.is_cpu and not t.is_meta]


def _checkpoint(function, args: tuple, kwargs: dict, *, found: Optional[_Found] = None,
                modules: Optional[Sequence[nn.Module]] = None, outside: Optional[nn.Module] = None,
                preserve_rng_state: bool = True, determinism_check: str = "default", debug: bool = False,
                early_stop: bool = True, context_fn: Optional[Callable] = None):
    """checkpoint() without argument checks. `found`: what the function uses (its BatchNorm modules), when
    the caller knows it, having checked its FSDP units. `modules`: the modules the function runs, when the
    caller knows them (their BatchNorms are searched at replay; no FSDP unit may be among them unless
    checked). `outside`: the FSDP unit whose hooks wrap this call."""
    if not torch.is_grad_enabled():
        return _checkpoint_without_grad(function, args, kwargs, context_fn)
    if found is not None:
        modules = found.batchnorms
    return _checkpoint_with_grad(function, args, kwargs, found is not None, modules, outside, preserve_rng_state,
                                 determinism_check, debug, early_stop, context_fn)


def _checkpoint_without_grad(function, args: tuple, kwargs: dict, context_fn: Optional[Callable]):
    """no_grad and inference_mode: nothing to save (and torch.compile traces it)."""
    if context_fn is not None:
        context_fn()  # called, its contexts not entered, as torch does
    return function(*args, **kwargs)


def _check_inputs_unchanged(function, args: tuple, versions: List[int]):
    """Called by the C++ frame when a tensor argument's version changed during the forward: says which."""
    for i, (a, v) in enumerate(zip((a for a in args if isinstance(a, _Tensor)), versions)):
        if a._version != v:
            raise RuntimeError(
                f"ckpt_ext.checkpoint: `{_function_name(function)}` modified its tensor argument {i} in place. A "
                "checkpointed function is run again in backward on its saved inputs, so it must not modify them; "
                "clone the argument first.")


def _traced_checkpoint(function, args: tuple, kwargs: dict, fsdp_checked: bool,
                       modules: Optional[Sequence[nn.Module]], outside: Optional[nn.Module],
                       preserve_rng_state: bool, determinism_check: str, debug: bool, early_stop: bool,
                       context_fn: Optional[Callable]):
    """_checkpoint_with_grad while Dynamo traces: torch's non-reentrant checkpoint, which Dynamo turns into
    its activation-checkpoint higher-order op (ckpt_ext/_compiler.py). The semantics are the eager engine's:
    the same gradients, the forward's random numbers in the recompute (the partitioner functionalises
    their RNG), context_fn's selective-checkpointing policy honoured by the partitioner, BatchNorm
    statistics updated once (the recompute is functional). early_stop has no meaning in compiled code;
    FSDP units inside the function are torch's to handle, as with torch's checkpoint."""
    if isinstance(context_fn, KeepLevel):  # keep=...: torch's selective checkpointing, the same ops kept
        context_fn = compiled_context_fn(context_fn.keep)
    options = {} if context_fn is None else {"context_fn": context_fn}  # (Dynamo rejects noop_context_fn)
    if kwargs:  # the function's own keywords, kept apart from torch's checkpoint options
        function = functools.partial(function, **kwargs)
    return _torch_checkpoint_fn(function, *args, use_reentrant=False, determinism_check=determinism_check,
                                debug=debug, preserve_rng_state=preserve_rng_state, **options)


@traced_under_compile(_traced_checkpoint)
def _checkpoint_with_grad(function, args: tuple, kwargs: dict, fsdp_checked: bool,
                          modules: Optional[Sequence[nn.Module]], outside: Optional[nn.Module],
                          preserve_rng_state: bool, determinism_check: str, debug: bool, early_stop: bool,
                          context_fn: Optional[Callable]):
    """_checkpoint with grad enabled (traced as torch's checkpoint under torch.compile)."""
    if not fsdp_checked and _fsdp_unit_class() is not None:  # FSDP imported: refuse units run inside (_discovery)
        units = _discover(function, args, set()).fsdp_units
        if units:
            _check_fsdp_units(_function_name(function), units, outside)
    if _compiler._stream_capturing():
        check_not_capturing(
            f"checkpointing `{_function_name(function)}` (checkpoint, checkpoint_sequential, enable_checkpointing)",
            "the frame saves and restores generator state on the host. Capture the model without ckpt_ext "
            "checkpointing (ckpt_ext.disable_checkpointing(model)), or keep the checkpointed part outside the "
            "captured region (under torch.no_grad() nothing is checkpointed, and capture works).")
    if _torch_checkpoint._checkpoint_debug_enabled is not None:
        debug = _torch_checkpoint._checkpoint_debug_enabled
    if _torch_checkpoint._enable_checkpoint_early_stop is not None:
        early_stop = _torch_checkpoint._enable_checkpoint_early_stop
    forward_context = recompute_context = describe = None
    if debug:
        if context_fn is not None:
            raise ValueError("debug=True is incompatible with non-default context_fn")
        logs: tuple = ([], [])
        forward_context, recompute_context = _OpRecorder(logs[0]), _OpRecorder(logs[1])
        describe = functools.partial(_describe, *logs)
    elif context_fn is not None:
        forward_context, recompute_context = context_fn()
    call = function if forward_context is None else functools.partial(_in_context, forward_context, function)
    # One C++ call: the inputs saved as autograd saves tensors, the frame (RNG/autocast snapshot), the
    # saved-tensor hooks around the function, the inputs checked unchanged after it.
    return _run(function, call, args if type(args) is tuple else tuple(args), kwargs or None, recompute_context,
                modules, describe, preserve_rng_state,
                _DETERMINISM[determinism_check], early_stop)


def _in_context(context, function, *args, **kwargs):
    if context is None:
        return function(*args, **kwargs)
    with context:
        return function(*args, **kwargs)


def _is_noop_context_fn(context_fn) -> bool:
    return context_fn is None or context_fn is _torch_checkpoint.noop_context_fn


def _respecting_hooks(context_fn: Callable, respect: bool):
    """context_fn() with respect_saved_tensors_hooks set on selective checkpointing's caching mode, as
    torch sets it (other contexts cache nothing: the option changes nothing for them)."""
    forward_context, recompute_context = context_fn()
    if isinstance(forward_context, _CachingMode):
        forward_context.respect_saved_tensors_hooks = respect
    return forward_context, recompute_context


def _respect_option(context_fn, respect):
    """torch >= 2.15's respect_saved_tensors_hooks: context_fn, set to apply it."""
    if respect is not None and not isinstance(respect, bool):
        raise TypeError(f"respect_saved_tensors_hooks must be None, True or False, got {respect!r}")
    if respect is None or _is_noop_context_fn(context_fn):
        return context_fn  # None: torch's default (its caching mode warns when user hooks are around)
    return functools.partial(_respecting_hooks, context_fn, respect)


def _identity(x):
    return x


_torch_warns: Dict[str, bool] = {}


def _torch_warns_without_use_reentrant(name: str) -> bool:
    """Whether the installed torch's `checkpoint` / `checkpoint_sequential` (`name`) warns, or refuses, when
    called without use_reentrant: ckpt_ext warns exactly then. Asked once per function, on first need, with a
    call on a tensor that needs no grad (torch 2.13 warns, then runs its reentrant variant)."""
    warns = _torch_warns.get(name)
    if warns is None:
        refused = False
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                with torch.no_grad():
                    if name == "checkpoint":
                        _torch_checkpoint_fn(_identity, torch.zeros(()))
                    else:
                        _torch_checkpoint_sequential_fn([_identity], 1, torch.zeros(()))
            except Exception as e:  # a torch that refuses the call: it says so with "use_reentrant"
                refused = "use_reentrant" in str(e)
        warns = _torch_warns[name] = refused or any("use_reentrant" in str(w.message) for w in caught)
    return warns


def _warn_use_reentrant_omitted(name: str, stacklevel: int):
    """torch.utils.checkpoint's `name` warns when use_reentrant is omitted, and then runs the reentrant variant;
    ckpt_ext runs the non-reentrant one whatever is passed, so the same call changes meaning between the two.
    The warning contains torch's sentence, so that code matching on torch's warning matches this one."""
    if not torch.compiler.is_compiling() and _torch_warns_without_use_reentrant(name):
        warnings.warn(
            f"ckpt_ext.{name}: the use_reentrant parameter should be passed explicitly. torch.utils.checkpoint."
            f"{name} called without it warns too, and runs the reentrant variant (use_reentrant=True) on this "
            "torch; ckpt_ext always runs the non-reentrant one. Pass use_reentrant=False, which is what ckpt_ext "
            "does, to silence this warning.", UserWarning, stacklevel=stacklevel + 1)


def checkpoint(function: Optional[Callable] = None, *args, use_reentrant: Optional[bool] = None, context_fn=None,
               determinism_check: str = "default", debug: bool = False, early_stop: bool = True,
               preserve_rng_state: bool = True, **kwargs):
    """Drop-in for ``torch.utils.checkpoint.checkpoint`` in its non-reentrant mode.

    Runs ``function(*args, **kwargs)`` with grad enabled but without keeping the tensors its operators
    save for backward; the first backward that needs one replays the function (same RNG, autocast and
    device state) and stops as soon as every saved tensor is recomputed. ``context_fn`` (selective
    checkpointing: ``torch.utils.checkpoint.create_selective_checkpoint_contexts``), ``early_stop``,
    ``set_checkpoint_early_stop``, ``determinism_check`` and ``debug`` behave as in torch; a replay that
    saves different tensors raises ``torch.utils.checkpoint.CheckpointError``. On torch >= 2.15,
    ``respect_saved_tensors_hooks`` (None, True or False) also behaves as there: whether the tensors a
    selective ``context_fn`` caches go through the surrounding saved-tensor hooks; on older torches, as
    there, it is passed to ``function``.

    Called with options only, ``checkpoint(use_reentrant=False)`` returns a decorator, as torch 2.15's
    does: ``@ckpt_ext.checkpoint(use_reentrant=False)`` on a function or method checkpoints every call.

    ``use_reentrant`` is accepted for compatibility and changes nothing: ckpt_ext always behaves like
    torch's non-reentrant mode. Omitted, it draws the warning torch gives where torch gives one (torch 2.13:
    "the use_reentrant parameter should be passed explicitly"), since torch then runs its reentrant mode.
    See docs/known-differences.md, "Differences from torch.utils.checkpoint".
    """
    respect = kwargs.pop("respect_saved_tensors_hooks", None) if _RESPECT_HOOKS and kwargs else None
    if function is None and not args:
        if kwargs:
            raise ValueError("ckpt_ext.checkpoint: unexpected keyword arguments for the decorator form "
                             f"checkpoint(**options): {', '.join(kwargs)}")
        _check_options(use_reentrant, determinism_check, debug, preserve_rng_state, early_stop, context_fn)
        return functools.partial(_Checkpointed, options=(use_reentrant, context_fn, determinism_check, debug,
                                                         early_stop, preserve_rng_state, respect))
    return _checkpoint_call(function, args, kwargs, use_reentrant, context_fn, determinism_check, debug, early_stop,
                            preserve_rng_state, respect, stacklevel=3)


def _checkpoint_call(function, args: tuple, kwargs: dict, use_reentrant, context_fn, determinism_check: str,
                     debug: bool, early_stop: bool, preserve_rng_state: bool, respect: Optional[bool],
                     stacklevel: int = 2):
    """checkpoint(function, *args, **kwargs) with its options apart from the function's keywords. `stacklevel`:
    the user's frame, for the warning about an omitted use_reentrant."""
    if not callable(function):
        raise TypeError(f"ckpt_ext.checkpoint: function must be callable, got {type(function).__name__}")
    _check_options(use_reentrant, determinism_check, debug, preserve_rng_state, early_stop, context_fn)
    if use_reentrant is None:
        _warn_use_reentrant_omitted("checkpoint", stacklevel)
    if respect is not None:
        context_fn = _respect_option(context_fn, respect)
    if context_fn is _torch_checkpoint.noop_context_fn:
        context_fn = None
    fsdp_unit = _fsdp_unit_class()
    if fsdp_unit is not None and isinstance(function, fsdp_unit):
        options = dict(preserve_rng_state=preserve_rng_state, determinism_check=determinism_check, debug=debug,
                       early_stop=early_stop, context_fn=context_fn)
        return _checkpoint_fsdp_unit(function, args, kwargs, options)
    if not torch.is_grad_enabled():
        return _checkpoint_without_grad(function, args, kwargs, context_fn)
    return _checkpoint_with_grad(function, args, kwargs, False, None, None, preserve_rng_state, determinism_check,
                                 debug, early_stop, context_fn)


class _Checkpointed:
    """What ``@checkpoint(**options)`` makes of a function: the function, checkpointed on every call. As a
    method decorator it binds to the instance it is read from (torch 2.15's _CheckpointedFunction)."""

    def __init__(self, function: Callable, *, options: tuple):
        if not callable(function):
            raise TypeError(f"ckpt_ext.checkpoint(...) decorates a callable, got {type(function).__name__}")
        self.function = function
        self.options = options
        functools.update_wrapper(self, function, updated=())

    def __call__(self, *args, **kwargs):
        return _checkpoint_call(self.function, args, kwargs, *self.options, stacklevel=3)

    def __get__(self, instance, owner=None):
        bind = getattr(self.function, "__get__", None)
        if instance is None or bind is None:
            return self
        return type(self)(bind(instance, owner), options=self.options)


def _run_range(functions: Sequence[Callable], start: int, end: int):
    # Closes over its own slice only: a replay's discovery (BatchNorm statistics) then walks this
    # segment's modules, not the whole sequence's.
    segment = list(functions[start:end + 1])

    def forward(x):
        for f in segment:
            x = f(x)
        return x

    return forward


def checkpoint_sequential(functions, segments: int, input, use_reentrant: Optional[bool] = None, **kwargs):
    """Drop-in for ``torch.utils.checkpoint.checkpoint_sequential``: splits ``functions`` (an
    ``nn.Sequential`` or a list of callables) into ``segments`` consecutive groups, checkpoints all
    but the last group and runs the last one normally. ``keep="attention"`` (ckpt_ext's own option, as in
    enable_checkpointing; any value of ckpt_ext.keep.KEEP_VALUES) keeps the checkpointed groups' attention kernel
    outputs and log-sum-exps."""
    keep = check_keep(kwargs.pop("keep", None))
    options = dict(preserve_rng_state=kwargs.pop("preserve_rng_state", True),
                   determinism_check=kwargs.pop("determinism_check", "default"), debug=kwargs.pop("debug", False))
    if kwargs:
        raise ValueError(f"checkpoint_sequential: unexpected keyword arguments: {', '.join(kwargs)}")
    _check_options(use_reentrant, options["determinism_check"], options["debug"], options["preserve_rng_state"])
    if keep != "boundaries":
        options["context_fn"] = keep_level(keep)
    if use_reentrant is None:
        _warn_use_reentrant_omitted("checkpoint_sequential", 2)
    if isinstance(functions, nn.Sequential):
        functions = list(functions.children())
    elif isinstance(functions, (list, tuple, nn.ModuleList)):
        functions = list(functions)
    else:
        raise TypeError(f"checkpoint_sequential: functions must be an nn.Sequential or a list of callables, "
                        f"got {type(functions).__name__}")
    for i, f in enumerate(functions):
        if not callable(f):
            raise TypeError(f"checkpoint_sequential: functions[{i}] is not callable (got {type(f).__name__})")
    if isinstance(segments, bool) or not isinstance(segments, int):
        raise TypeError(f"checkpoint_sequential: segments must be an int, got {type(segments).__name__}")
    if not 1 <= segments <= len(functions):
        raise ValueError(f"checkpoint_sequential: segments must be between 1 and the number of functions "
                         f"({len(functions)}), got {segments}")
    segment_size = len(functions) // segments
    end = segment_size * (segments - 1) - 1
    if torch.is_grad_enabled():
        input = _checkpoint_segments(functions, segment_size, end, input, options)
    else:  # nothing to save (and torch.compile traces it)
        input = _run_range(functions, 0, end)(input)
    return _run_range(functions, end + 1, len(functions) - 1)(input)


def _traced_segments(functions, segment_size: int, end: int, input, options: Dict[str, Any]):
    """_checkpoint_segments while Dynamo traces: each segment as torch's checkpoint (_traced_checkpoint)."""
    for start in range(0, end + 1, segment_size):
        input = _checkpoint(_run_range(functions, start, start + segment_size - 1), (input,), {}, **options)
    return input


@traced_under_compile(_traced_segments)
def _checkpoint_segments(functions, segment_size: int, end: int, input, options: Dict[str, Any]):
    """The checkpointed segments of checkpoint_sequential, ending with function `end`."""
    for start in range(0, end + 1, segment_size):
        run = _run_range(functions, start, start + segment_size - 1)
        found = None
        if _fsdp_unit_class() is not None:
            found = _Found()
            for f in functions[start:start + segment_size]:
                _collect(f, found, 0)
            _check_fsdp_units(_function_name(run), found.fsdp_units)
        input = _checkpoint(run, (input,), {}, found=found, **options)
    return input
