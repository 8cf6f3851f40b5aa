"""ckpt_ext.checkpoint: a drop-in for torch.utils.checkpoint.checkpoint backed by a C++ autograd
Function (csrc/autograd/checkpoint_function.cpp) and the BoundaryPool.

This module only does what must be Python: taking the call's arguments apart into tensors and the
rest, finding the parameters the callable uses, and running the callable. Everything else --
saving, pooling, RNG/autocast/device state, the replay and its gradients -- happens in C++.
"""
import functools
import sys
import types
import warnings
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils import _pytree as pytree

from ._compiler import check_not_capturing, eager_under_compile
from ._extension import load

_C = load()
_Tensor = torch.Tensor
_ATOMS = (int, float, bool, str, bytes, type(None), torch.dtype, torch.device)

__all__ = ["checkpoint", "checkpoint_sequential", "is_recomputing"]


def is_recomputing() -> bool:
    """True while ckpt_ext replays a checkpointed function during backward (on this thread)."""
    return bool(_C.is_recomputing())


# --------------------------------------------------------------------------------------------------
# Taking a call apart into its tensors and a template to rebuild it from (new) tensors.
# The template never holds the tensors themselves, so it keeps nothing alive.
# --------------------------------------------------------------------------------------------------
class _Plan:
    __slots__ = ("leaves", "positions", "spec")

    def __init__(self, leaves, positions, spec):
        self.leaves = leaves  # non-tensor leaves in place, None where a tensor goes
        self.positions = positions
        self.spec = spec  # None: leaves are the positional arguments themselves

    def rebuild(self, tensors):
        leaves = list(self.leaves)
        for i, t in zip(self.positions, tensors):
            leaves[i] = t
        if self.spec is None:
            return leaves
        return pytree.tree_unflatten(leaves, self.spec)


def _is_flat(values: Iterable[Any]) -> bool:
    return all(isinstance(v, _Tensor) or isinstance(v, _ATOMS) or not isinstance(v, (list, tuple, dict)) for v in values)


def _take_apart(obj, flat_ok: bool) -> Tuple[List[_Tensor], _Plan]:
    if flat_ok:
        leaves, spec = list(obj), None
    else:
        leaves, spec = pytree.tree_flatten(obj)
    positions = [i for i, v in enumerate(leaves) if isinstance(v, _Tensor)]
    tensors = [leaves[i] for i in positions]
    for i in positions:
        leaves[i] = None
    return tensors, _Plan(leaves, positions, spec)


def _split_call(args: tuple, kwargs: dict):
    if not kwargs and _is_flat(args):
        return _take_apart(args, True)
    return _take_apart((args, kwargs), False)


def _split_output(out):
    if isinstance(out, _Tensor):
        return [out], None
    if type(out) is tuple and _is_flat(out):
        return _take_apart(out, True)
    return _take_apart(out, False)


def _rebuild_output(plan: Optional[_Plan], tensors: List[_Tensor]):
    if plan is None:
        return tensors[0]
    if plan.spec is None:
        return tuple(plan.rebuild(tensors))
    return plan.rebuild(tensors)


# --------------------------------------------------------------------------------------------------
# Parameter discovery: tensors the function uses without taking them as arguments. They become
# inputs of the C++ node, so their gradients flow through the outer graph exactly once.
# --------------------------------------------------------------------------------------------------
class _Found:
    __slots__ = ("params", "batchnorms", "fsdp_units", "seen")

    def __init__(self):
        self.params: List[_Tensor] = []
        self.batchnorms: List[_BatchNorm] = []
        self.fsdp_units: List[nn.Module] = []  # modules sharded with fully_shard (see _check_fsdp_units)
        self.seen = set()


def _fsdp_unit_class():
    """torch.distributed.fsdp.FSDPModule, or None while FSDP was never imported (then no module is one)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return getattr(fsdp, "FSDPModule", None) if fsdp is not None else None


def _add_module(mod: nn.Module, found: _Found):
    fsdp_unit = _fsdp_unit_class()
    for m in mod.modules():
        if id(m) in found.seen:
            continue
        found.seen.add(id(m))
        if fsdp_unit is not None and isinstance(m, fsdp_unit):
            found.fsdp_units.append(m)
        for p in m._parameters.values():
            if p is not None and p.requires_grad and id(p) not in found.seen:
                found.seen.add(id(p))
                found.params.append(p)
        if isinstance(m, _BatchNorm) and m.training and m.track_running_stats:
            found.batchnorms.append(m)


def _code_globals(code: types.CodeType, names: set):
    names.update(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            _code_globals(c, names)


def _collect(obj: Any, found: _Found, depth: int):
    if isinstance(obj, _ATOMS) or isinstance(obj, (types.ModuleType, type)):
        return
    if isinstance(obj, nn.Module):
        if id(obj) not in found.seen:
            _add_module(obj, found)
        return
    if isinstance(obj, _Tensor):
        if obj.requires_grad and id(obj) not in found.seen:
            found.seen.add(id(obj))
            found.params.append(obj)
        return
    if depth > 4 or id(obj) in found.seen:
        return
    found.seen.add(id(obj))
    if isinstance(obj, types.MethodType):
        _collect(obj.__self__, found, depth + 1)
        _collect(obj.__func__, found, depth + 1)
    elif isinstance(obj, functools.partial):
        _collect(obj.func, found, depth + 1)
        for a in obj.args:
            _collect(a, found, depth + 1)
        for a in obj.keywords.values():
            _collect(a, found, depth + 1)
    elif isinstance(obj, types.FunctionType):
        for cell in obj.__closure__ or ():
            try:
                _collect(cell.cell_contents, found, depth + 1)
            except ValueError:  # empty cell
                pass
        for d in obj.__defaults__ or ():
            _collect(d, found, depth + 1)
        names: set = set()
        _code_globals(obj.__code__, names)
        g = obj.__globals__
        for n in names:
            v = g.get(n)
            if v is not None and not isinstance(v, (types.ModuleType, type, types.BuiltinFunctionType)):
                _collect(v, found, depth + 1)
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for v in obj:
            _collect(v, found, depth + 1)
    elif isinstance(obj, dict):
        for v in obj.values():
            _collect(v, found, depth + 1)
    elif callable(obj) and hasattr(obj, "__dict__"):  # a callable object: look at what it holds
        for v in vars(obj).values():
            _collect(v, found, depth + 1)


def _discover(function: Callable, plan_leaves: Sequence[Any], input_ids: set) -> _Found:
    found = _Found()
    found.seen.update(input_ids)
    _collect(function, found, 0)
    for leaf in plan_leaves:  # modules or callables passed as arguments
        if leaf is not None and not isinstance(leaf, _ATOMS):
            _collect(leaf, found, 1)
    return found


# --------------------------------------------------------------------------------------------------
# FSDP2. fully_shard makes a module a unit whose parameters are DTensor shards outside its forward: its
# forward pre-hook gathers them, and on the call's inputs and outputs it registers the autograd hooks
# that gather them again before their backward and reduce-scatter their gradients after it. Those hooks
# must wrap the checkpoint's node. Run inside it they would run without grad in forward (registering
# nothing) and again inside the replay's own backward, where the gathered parameters' gradients are
# captured by the node rather than accumulated for FSDP, so FSDP would reduce nothing.
# --------------------------------------------------------------------------------------------------
def _fsdp_units_in(modules: Iterable[nn.Module]) -> List[nn.Module]:
    """The FSDP units among `modules` and their submodules, in order."""
    fsdp_unit = _fsdp_unit_class()
    if fsdp_unit is None:
        return []
    units: List[nn.Module] = []
    seen = set()
    for mod in modules:
        for m in mod.modules():
            if id(m) not in seen:
                seen.add(id(m))
                if isinstance(m, fsdp_unit):
                    units.append(m)
    return units


def _check_fsdp_units(name: str, units: Sequence[nn.Module], outside: Optional[nn.Module] = None):
    """Raises when a checkpointed function would run an FSDP unit inside the checkpoint. `outside`: the
    unit whose hooks already wrap this call (checkpoint(unit, ...), enable_checkpointing's layers)."""
    inside = [u for u in units if u is not outside]
    if not inside:
        return
    what = ", ".join(sorted({type(u).__name__ for u in inside}))
    raise RuntimeError(
        f"ckpt_ext.checkpoint: `{name}` runs {len(inside)} module(s) sharded with "
        f"torch.distributed.fsdp.fully_shard ({what}) inside the checkpoint. FSDP gathers their parameters "
        "and reduces their gradients in hooks that must wrap the checkpointed computation, not run inside "
        "it. Checkpoint inside the FSDP units instead: pass the sharded module itself "
        "(ckpt_ext.checkpoint(unit, x): its hooks then run outside), use ckpt_ext.enable_checkpointing(model) "
        "with fully_shard on the layers, or fully_shard a module that contains the checkpointed call.")


_MISSING = object()


def _checkpoint_fsdp_unit(unit: nn.Module, args: tuple, kwargs: dict, options: Dict[str, Any]):
    """checkpoint(unit, ...) on an FSDP unit: the unit is called as usual, so that its hooks run around
    the call, and only its forward is checkpointed (as enable_checkpointing does for every layer); its
    parameters are discovered after the pre-hook gathered them."""
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
# The runner: what the C++ node calls to run the user's function.
# --------------------------------------------------------------------------------------------------
class _OpRecorder(torch.utils._python_dispatch.TorchDispatchMode):
    """debug=True: records the ATen operators a run executes."""

    def __init__(self, log: List[str]):
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        shapes = [tuple(t.shape) for t in pytree.tree_leaves(out) if isinstance(t, _Tensor)]
        self.log.append(f"{func}{shapes}")
        return out


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


def _distinct(tensors: List[_Tensor]) -> Tuple[List[_Tensor], Optional[List[int]]]:
    """A tensor returned several times leaves the node once (one pool slot, `out[0] is out[1]` holds, and
    autograd sums its gradient terms as it does without checkpointing); `index` maps positions back."""
    if len({id(t) for t in tensors}) == len(tensors):
        return tensors, None
    first: Dict[int, int] = {}
    distinct: List[_Tensor] = []
    index = []
    for t in tensors:
        if id(t) not in first:
            first[id(t)] = len(distinct)
            distinct.append(t)
        index.append(first[id(t)])
    return distinct, index


class _Runner:
    __slots__ = ("fn", "plan", "out_plan", "out_index", "batchnorms", "bn_saved", "debug", "logs")

    def __init__(self, fn, plan: _Plan, batchnorms, debug: bool):
        self.fn = fn
        self.plan = plan
        self.out_plan = None
        self.out_index = None  # output position -> distinct output, when a tensor is returned several times
        self.batchnorms = batchnorms
        self.bn_saved = None
        self.debug = debug
        self.logs = ([], []) if debug else None

    def _call(self, tensors, log_index: int):
        rebuilt = self.plan.rebuild(tensors)
        if self.plan.spec is None:
            args, kwargs = rebuilt, {}
        else:
            args, kwargs = rebuilt
        if self.debug:
            log = self.logs[log_index]
            log.clear()
            with _OpRecorder(log):
                return self.fn(*args, **kwargs)
        return self.fn(*args, **kwargs)

    def forward(self, tensors):
        out = self._call(tensors, 0)
        out_tensors, self.out_plan = _split_output(out)
        out_tensors, self.out_index = _distinct(out_tensors)
        return out_tensors

    def replay(self, tensors):
        if self.batchnorms:
            # The forward already updated the running statistics; the replay must not do it again.
            self.bn_saved = [
                [b.clone() if b is not None else None for b in (m.running_mean, m.running_var, m.num_batches_tracked)]
                for m in self.batchnorms
            ]
        try:
            out = self._call(tensors, 1)
        except BaseException as e:  # KeyboardInterrupt too: the note is what tells where it landed
            # The traceback shows the function's own frames under loss.backward(); say why they ran there.
            # The exception itself passes through C++ unchanged (pybind11 carries the Python object).
            if hasattr(e, "add_note"):  # Python 3.11+
                e.add_note(f"(raised while ckpt_ext replayed the checkpointed function `{_function_name(self.fn)}` "
                           "during backward: a checkpointed function runs again in backward, with "
                           "ckpt_ext.is_recomputing() True)")
            raise
        return _distinct(_split_output(out)[0])[0]

    def replay_done(self):
        if not self.bn_saved:
            return
        with torch.no_grad():
            for m, saved in zip(self.batchnorms, self.bn_saved):
                for buf, old in zip((m.running_mean, m.running_var, m.num_batches_tracked), saved):
                    if buf is not None:
                        buf.copy_(old)
        self.bn_saved = None

    def describe(self) -> str:
        if not self.debug:
            return ""
        fwd, rep = self.logs
        first = next((i for i, (a, b) in enumerate(zip(fwd, rep)) if a != b), min(len(fwd), len(rep)))
        lines = [f"debug: forward ran {len(fwd)} operator(s), the replay {len(rep)}; first difference at #{first}:"]
        for i in range(max(0, first - 2), min(max(len(fwd), len(rep)), first + 3)):
            a = fwd[i] if i < len(fwd) else "-"
            b = rep[i] if i < len(rep) else "-"
            lines.append(f"  #{i}: forward {a}   |   replay {b}")
        return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------------
_DETERMINISM = {"default": True, "none": False}


def _check_options(use_reentrant, determinism_check, debug, preserve_rng_state):
    if use_reentrant is not None and not isinstance(use_reentrant, bool):
        raise TypeError(f"use_reentrant must be None, True or False, got {use_reentrant!r}")
    if determinism_check not in _DETERMINISM:
        raise ValueError(f"determinism_check must be one of {sorted(_DETERMINISM)}, got {determinism_check!r}")
    if not isinstance(debug, bool):
        raise TypeError(f"debug must be True or False, got {debug!r}")
    if not isinstance(preserve_rng_state, bool):
        raise TypeError(f"preserve_rng_state must be True or False, got {preserve_rng_state!r}")


_WARNED_NOT_CHECKPOINTED: set = set()


def _warn_not_checkpointed(function):
    name = _function_name(function)
    if name in _WARNED_NOT_CHECKPOINTED:
        return
    _WARNED_NOT_CHECKPOINTED.add(name)
    warnings.warn(
        f"ckpt_ext.checkpoint: `{name}` was NOT checkpointed (it ran normally, keeping its activations): none of "
        "its tensor arguments requires grad and no parameters were found on it, yet its output requires grad, so "
        "it uses parameters ckpt_ext could not discover. Pass a module, bound method, functools.partial or closure "
        "that holds them, or pass them as arguments.", stacklevel=3)


def _checkpoint(function, args: tuple, kwargs: dict, *, found: Optional[_Found] = None,
                outside: Optional[nn.Module] = None, preserve_rng_state: bool = True,
                determinism_check: str = "default", debug: bool = False):
    """checkpoint() without argument checks. `found`: the parameters and BatchNorm modules the function
    uses, when the caller knows them (otherwise they are discovered). `outside`: the FSDP unit whose
    hooks wrap this call, if any."""
    if not torch.is_grad_enabled():  # no_grad and inference_mode: nothing to save (and torch.compile traces it)
        return function(*args, **kwargs)
    return _checkpoint_with_grad(function, args, kwargs, found, outside, preserve_rng_state, determinism_check, debug)


@eager_under_compile
def _checkpoint_with_grad(function, args: tuple, kwargs: dict, found: Optional[_Found], outside: Optional[nn.Module],
                          preserve_rng_state: bool, determinism_check: str, debug: bool):
    """_checkpoint with grad enabled: the call into the C++ node (one graph break under torch.compile)."""
    tensors, plan = _split_call(args, kwargs)
    if found is None:
        found = _discover(function, plan.leaves, {id(t) for t in tensors})
    if found.fsdp_units:
        _check_fsdp_units(_function_name(function), found.fsdp_units, outside)
    params, batchnorms = found.params, found.batchnorms
    if not any(t.requires_grad for t in tensors) and not any(p.requires_grad for p in params):
        out = function(*args, **kwargs)
        if any(isinstance(t, _Tensor) and t.requires_grad for t in pytree.tree_leaves(out)):
            _warn_not_checkpointed(function)
        return out
    check_not_capturing(
        f"checkpointing `{_function_name(function)}` (checkpoint, checkpoint_sequential, enable_checkpointing)",
        "the node saves and restores generator state on the host and keeps its output in the BoundaryPool, "
        "outside the graph's memory pool. Capture the model without ckpt_ext checkpointing "
        "(ckpt_ext.disable_checkpointing(model)), or keep the checkpointed part outside the captured region "
        "(under torch.no_grad() nothing is checkpointed, and capture works).")
    runner = _Runner(function, plan, batchnorms, debug)
    outs = _C.checkpoint_apply(runner, _function_name(function), tensors, list(params), preserve_rng_state,
                               _DETERMINISM[determinism_check], debug, bool(batchnorms))
    if runner.out_index is not None:
        outs = [outs[i] for i in runner.out_index]
    return _rebuild_output(runner.out_plan, outs)


def checkpoint(function: Callable, *args, use_reentrant: Optional[bool] = None, context_fn=None,
               determinism_check: str = "default", debug: bool = False, early_stop: bool = True,
               preserve_rng_state: bool = True, **kwargs):
    """Drop-in for ``torch.utils.checkpoint.checkpoint``.

    Runs ``function(*args, **kwargs)`` without keeping its intermediate tensors; its tensor outputs
    are stored in the device's BoundaryPool and its tensor inputs are saved without copying. In
    backward the function is replayed (same RNG, autocast and device state) to compute gradients for
    its inputs and for the parameters it uses (found on modules, bound methods, ``functools.partial``
    objects and closures).

    ``use_reentrant`` is accepted for compatibility and changes nothing: ckpt_ext always behaves like
    torch's non-reentrant mode (``torch.autograd.grad``, ``backward(inputs=...)``, inputs without
    ``requires_grad``, nested checkpoints all work). ``early_stop`` is accepted and has no effect (the
    replay always runs the whole function). ``context_fn`` (selective checkpointing) is not supported.
    """
    if not callable(function):
        raise TypeError(f"ckpt_ext.checkpoint: function must be callable, got {type(function).__name__}")
    if context_fn is not None and getattr(context_fn, "__name__", "") != "noop_context_fn":
        raise NotImplementedError(
            "ckpt_ext.checkpoint does not support context_fn (selective activation checkpointing); "
            "use torch.utils.checkpoint.checkpoint for that call."
        )
    _check_options(use_reentrant, determinism_check, debug, preserve_rng_state)
    if not isinstance(early_stop, bool):
        raise TypeError(f"early_stop must be True or False, got {early_stop!r}")
    options = dict(preserve_rng_state=preserve_rng_state, determinism_check=determinism_check, debug=debug)
    fsdp_unit = _fsdp_unit_class()
    if fsdp_unit is not None and isinstance(function, fsdp_unit):
        return _checkpoint_fsdp_unit(function, args, kwargs, options)
    return _checkpoint(function, args, kwargs, **options)


def _run_range(functions: Sequence[Callable], start: int, end: int):
    def forward(x):
        for j in range(start, end + 1):
            x = functions[j](x)
        return x

    return forward


def checkpoint_sequential(functions, segments: int, input, use_reentrant: Optional[bool] = None, **kwargs):
    """Drop-in for ``torch.utils.checkpoint.checkpoint_sequential``: splits ``functions`` (an
    ``nn.Sequential`` or a list of callables) into ``segments`` consecutive groups, checkpoints all
    but the last group and runs the last one normally."""
    preserve = kwargs.pop("preserve_rng_state", True)
    determinism_check = kwargs.pop("determinism_check", "default")
    debug = kwargs.pop("debug", False)
    if kwargs:
        raise ValueError(f"checkpoint_sequential: unexpected keyword arguments: {', '.join(kwargs)}")
    _check_options(use_reentrant, determinism_check, debug, preserve)
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
        input = _checkpoint_segments(functions, segment_size, end, input, preserve, determinism_check, debug)
    else:  # nothing to save (and torch.compile traces it)
        input = _run_range(functions, 0, end)(input)
    return _run_range(functions, end + 1, len(functions) - 1)(input)


@eager_under_compile
def _checkpoint_segments(functions, segment_size: int, end: int, input, preserve: bool, determinism_check: str,
                         debug: bool):
    """The checkpointed segments of checkpoint_sequential, ending with function `end`."""
    for start in range(0, end + 1, segment_size):
        run = _run_range(functions, start, start + segment_size - 1)
        found = _Found()
        for f in functions[start:start + segment_size]:
            _collect(f, found, 0)
        input = _checkpoint(run, (input,), {}, found=found, preserve_rng_state=preserve,
                            determinism_check=determinism_check, debug=debug)
    return input
