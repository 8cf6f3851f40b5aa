"""What a checkpointed callable uses: modules, parameters, BatchNorm layers, FSDP units."""
import functools
import sys
import types
from typing import Any, Callable, List, Optional, Sequence

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

_Tensor = torch.Tensor
_ATOMS = (int, float, bool, str, bytes, type(None), torch.dtype, torch.device)


# --------------------------------------------------------------------------------------------------
# Discovery: the modules a callable uses (walking modules, bound methods, functools.partial objects,
# closures and globals). Gradients no longer need it (the real autograd graph carries them); it finds
# FSDP units run inside a checkpoint (an error) and serves enable_checkpointing.
# --------------------------------------------------------------------------------------------------
class _Found:
    __slots__ = ("batchnorms", "fsdp_units", "seen")

    def __init__(self):
        self.batchnorms: List[_BatchNorm] = []
        self.fsdp_units: List[nn.Module] = []  # modules sharded with fully_shard (see _check_fsdp_units)
        self.seen = set()


def _fsdp_unit_class():
    """torch.distributed.fsdp.FSDPModule, or None while no module can be one: FSDP never imported (Dynamo
    imports it), or fully_shard never called (it makes every unit an instance of a new FSDPModule
    subclass). Checked per checkpointed call, so it must stay cheap."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    unit = getattr(fsdp, "FSDPModule", None) if fsdp is not None else None
    if unit is None or torch.compiler.is_compiling():  # Dynamo (torch 2.11) cannot trace __subclasses__
        return unit
    return unit if type.__subclasses__(unit) else None


def _add_module(mod: nn.Module, found: _Found):
    fsdp_unit = _fsdp_unit_class()
    for m in mod.modules():
        if id(m) in found.seen:
            continue
        found.seen.add(id(m))
        if fsdp_unit is not None and isinstance(m, fsdp_unit):
            found.fsdp_units.append(m)
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
