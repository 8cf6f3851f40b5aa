"""enable_checkpointing / disable_checkpointing: checkpoint the layer stack of a model in one call.

Works on Hugging Face models (BERT/RoBERTa ``encoder.layer``, GPT-2 ``h``, Llama ``layers``, ...) and on
any model whose repeated blocks sit in an ``nn.ModuleList`` or ``nn.Sequential``. The layers'
``forward`` is wrapped on the instance (hooks stay outside the checkpoint, as in Hugging Face), so
parameters, state_dict keys and optimizers are untouched.
"""
import functools
import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from . import _entry_points
from ._compiler import traced_under_compile
from ._discovery import _ATOMS, _add_module, _check_fsdp_units, _Found, _fsdp_unit_class
from .checkpoint import _checkpoint
from ._layout import BERT
from .fused import _C, FusedTransformerLayer, run_segment
from .keep import (KEEP_VALUES, KeepLevel, check_keep, compiled_level_fallback, fused_level, keeps_attention,
                   keeps_gemms, warn_once)
from .hf.versions import check_versions
from .hf.cache import drop_cache, remember_signature
from .hf.layers import attention_implementation
from .hf.trainer import (hf_checkpointing_host, ride_hf_checkpointing, rides_hf, rides_hf_keep, double_checkpointing_error,
                         install_take_over, layer_hf_checkpointed, refuse_hf_checkpointing_on, remove_take_over)
from .planner import fmt_bytes, parse_bytes, segment_costs
from .pool import is_pooled, pool_stats
from .stack_plan import _POOL_ALIGNMENT, StackPlanner

__all__ = ["enable_checkpointing", "disable_checkpointing", "explain"]

_ATTR = "_ckpt_ext_group"


def is_fused_layer(m: nn.Module) -> bool:
    return isinstance(m, FusedTransformerLayer)


def _hidden_of(out: Any):
    """The tensor a layer stack passes on from a layer's output (the output, or its first element)."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out:
        return out[0]
    try:
        return out[0]
    except Exception:
        return None


def _same(x, y) -> bool:
    return x is y or (isinstance(x, _ATOMS) and type(x) is type(y) and x == y)


def _same_args(a: Tuple, ka: Dict, b: Tuple, kb: Dict) -> bool:
    return (len(a) == len(b) and ka.keys() == kb.keys() and all(_same(x, y) for x, y in zip(a, b))
            and all(_same(ka[k], kb[k]) for k in ka))


def _differing_args(a: Tuple, ka: Dict, b: Tuple, kb: Dict) -> str:
    """The arguments that differ between two calls, for messages: keywords by name (e.g. attention_mask, or
    position_embeddings -- Gemma 3's local and global rotary tables), positions after the hidden states by index."""
    names = [f"positional argument {i + 1}" for i, (x, y) in enumerate(zip(a, b)) if not _same(x, y)]
    if len(a) != len(b):
        names.append("the number of positional arguments")
    names += [k for k in sorted(set(ka) | set(kb)) if k not in ka or k not in kb or not _same(ka[k], kb[k])]
    return ", ".join(names)


def _weak(value):
    return weakref.ref(value) if isinstance(value, torch.Tensor) else value


def _strong(value):
    return value() if isinstance(value, weakref.ref) else value


class _Pending:
    """A checkpointed group's output, waiting for the group's later layers to hand it on, and the
    arguments the group ran with (to check that the later layers get the same ones).

    Tensors are held weakly: the stack's loop holds them while it runs, and when the step stops between
    two layers of a group (KeyboardInterrupt, an exception in a hook) a strong reference would keep the
    output, its graph and every pooled boundary before it alive until the next step."""

    __slots__ = ("output", "done", "args", "kwargs")

    def __init__(self, output, done: int, args: Tuple, kwargs: Dict):
        if isinstance(output, torch.Tensor):
            self.output = weakref.ref(output)
        elif type(output) is tuple and output and isinstance(output[0], torch.Tensor):
            self.output = (weakref.ref(output[0]),) + output[1:]
        else:
            self.output = output  # another structure: held as it is
        self.done = done
        self.args = tuple(_weak(a) for a in args[1:])  # args[0] is the hidden state, never compared
        self.kwargs = {k: _weak(v) for k, v in kwargs.items()}

    def _output(self):
        """The output, or None when it is gone."""
        if isinstance(self.output, weakref.ref):
            return self.output()
        if type(self.output) is tuple and self.output and isinstance(self.output[0], weakref.ref):
            hidden = self.output[0]()
            return None if hidden is None else (hidden,) + self.output[1:]
        return self.output

    def hidden(self):
        """The output's hidden state, or None when the output is gone."""
        out = self._output()
        return None if out is None else _hidden_of(out)

    def get(self):
        """(output, args after the hidden state, kwargs), or None when the output is gone."""
        out = self._output()
        if out is None:
            return None
        return out, tuple(_strong(a) for a in self.args), {k: _strong(v) for k, v in self.kwargs.items()}


class _Group:
    """Consecutive layers checkpointed as one call. The first layer's forward runs the whole group;
    the others hand the group's output on when the stack's loop reaches them. A `kept` group (chosen
    by the budget planner) runs its layers normally. `keep` is what the checkpointed group keeps besides
    its input ("boundaries": nothing; "attention": its attention kernels' outputs and log-sum-exps)."""

    def __init__(self, layers: List[nn.Module], index: int, planner: Optional[StackPlanner] = None,
                 kept: bool = False, keep: str = "boundaries", stack: str = "", boundary: Optional[bool] = None,
                 takes: bool = False, passes: bool = False):
        self.layers = layers
        self.index = index  # position of the first layer in its stack
        self.planner = planner
        self.kept = kept
        self.keep = "boundaries" if kept else keep
        # BERT's pre-norm boundary (fused layers): whether the group runs with it (without a planner always; a
        # planned group where the plan accounts for it: Plan.boundaries) and, planned, whether the plan has it take
        # the group before's pre-norm sum as its input (explain)
        self.boundary = planner is None if boundary is None else boundary
        self.takes = takes
        self.passes = passes  # planned: the group after takes this group's pre-norm sum as its input
        self.names = [_layer_name(stack, index + k, layer) for k, layer in enumerate(layers)]
        self.running = 0  # the layer of the group running now (keep="attention" names it in messages)
        # keep="attention" (and the levels keeping attention): per layer, what its attention kept in the last forward
        # ((bytes, None) or (None, why)); the levels keeping GEMM outputs: per layer, their bytes in the last forward
        self.attention: List[Optional[Tuple[Optional[int], Optional[str]]]] = [None] * len(layers)
        self.gemm_bytes: List[int] = [0] * len(layers)
        self.gemm_why: List[Optional[str]] = [None] * len(layers)  # fused layers: why one kept no GEMM output
        self.context_fn = self._context_fn()
        self.pending: Optional[_Pending] = None  # after a checkpointed group run, until its last layer
        self.traced: Optional[tuple] = None  # the same while Dynamo traces (_traced_layer_forward)
        # While Dynamo traces: the pre-norm boundary (output, pre-norm sum, producing layer) the group before handed
        # to this one, set and taken within the traced frame (_traced_layer_forward); `after`: the group after this
        # one in its stack (_attach_groups)
        self.handed: Optional[tuple] = None
        self.after: Optional["_Group"] = None
        self.siblings: List["_Group"] = []  # the multi-layer groups of the stack (see _check_order)

    # Pickled (torch.save of the model, a spawned process, copy.deepcopy): the configuration only. What belongs
    # to one step of this process -- the pending output (weak references to a graph), the traced hand-over, the
    # attention bytes seen, the keep-attention mode bound to this group -- starts afresh.
    _RUNTIME = ("running", "attention", "gemm_bytes", "gemm_why", "context_fn", "pending", "traced", "handed")

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k not in self._RUNTIME}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.__dict__.setdefault("boundary", self.planner is None)  # (pickled before the per-call boundary)
        self.__dict__.setdefault("takes", False)
        self.__dict__.setdefault("passes", False)
        self.running = 0
        self.attention = [None] * len(self.layers)
        self.gemm_bytes = [0] * len(self.layers)
        self.gemm_why = [None] * len(self.layers)
        self.context_fn = self._context_fn()
        self.pending = None
        self.traced = None
        self.handed = None
        self.__dict__.setdefault("after", None)
        for layer in self.layers:
            if not isinstance(layer, FusedTransformerLayer):  # (a fused layer reads its own when loaded)
                remember_signature(layer)

    def _context_fn(self) -> Optional[KeepLevel]:
        if self.keep == "boundaries":
            return None
        return KeepLevel(self.names, self._running, self._tell, self.keep, self._tell_gemm)

    def _tell_gemm(self, layer: int, kept_bytes: int, first: bool):
        self.gemm_bytes[layer] = kept_bytes + (0 if first else self.gemm_bytes[layer])

    def checkpointed(self, layer_args: Tuple, layer_kwargs: Dict):
        """Runs the group checkpointed: fused layers (ckpt_ext.fuse) as one C++ SegmentFunction, other
        layers through ckpt_ext.checkpoint. FSDP units are checked here, once, for both."""
        found = self._uses() if _fsdp_unit_class() is not None else None  # no per-call walk without FSDP
        if found is not None and found.fsdp_units:
            self._check_fsdp(found.fsdp_units)
        out = self.fused_segment(self.layers, layer_args, layer_kwargs)
        if out is not NotImplemented:
            return out
        # The layer's arguments as the checkpoint's own (not one tuple): its tensor arguments are saved as
        # autograd saves a tensor, so outer saved-tensor hooks (save_on_cpu) see the group's input, as they
        # do under torch's checkpoint of a layer, and the input is checked unchanged after the forward.
        if found is not None:
            return _checkpoint(self.call, layer_args, layer_kwargs, found=found, outside=self.layers[0],
                               context_fn=self.context_fn)
        # The replay searches the layers for BatchNorm statistics to put back (C++, at replay).
        return _checkpoint(self.call, layer_args, layer_kwargs, modules=self.layers, outside=self.layers[0],
                           context_fn=self.context_fn)

    def fused_segment(self, layers: List[nn.Module], layer_args: Tuple, layer_kwargs: Dict,
                      traced_boundary: Optional[dict] = None):
        """run_segment (fused layers as one C++ SegmentFunction) with this group's keep=. Keeping attention, the
        pool slots the segment takes besides its output are its layers' kept attention outputs and LSEs:
        explain() reports them."""
        # Every level runs in C++ (fused_level): the attention's output and LSE in pool slots, the GEMM outputs held
        # by the segment's node.
        keep, gemms = keeps_attention(self.keep), keeps_gemms(self.keep)
        if (keep or gemms is not None) and torch.compiler.is_compiling() and layers and is_fused_layer(layers[0]):
            # The ckpt_ext::fused_segment operator keeps only its input: every level runs as "boundaries" there
            # (warned once while Dynamo traces, unless the planner chose the level in eager steps: less memory than
            # planned; explain() says so; the same gradients).
            if self.planner is None or self.planner.keep != "auto":
                compiled_level_fallback(self.keep)
            keep, gemms = False, None
        hidden = layer_args[0] if layer_args and isinstance(layer_args[0], torch.Tensor) else None
        # BERT's pre-norm boundary moves a boundary from a segment's input to its output (one more at the end of a
        # chain): planned groups run with it where the plan accounts for it (Plan.boundaries; held bytes as predicted)
        boundary = self.boundary
        if (not keep and gemms is None) or layers is not self.layers or torch.compiler.is_compiling() or \
                hidden is None or not is_fused_layer(layers[0]):
            return run_segment(layers, layer_args, layer_kwargs, keep_attention=keep, gemms=gemms,
                               pre_norm_boundary=boundary, traced_boundary=traced_boundary)
        before = pool_stats(hidden.device)["in_use_bytes"]
        why: List[Optional[str]] = [None] * len(layers)
        gemm_bytes: List[Tuple[int, Optional[str]]] = [(0, None)] * len(layers)
        out = run_segment(layers, layer_args, layer_kwargs, keep_attention=keep, names=self.names,
                          report=why.__setitem__, gemms=gemms,
                          report_gemms=lambda k, n, reason: gemm_bytes.__setitem__(k, (n, reason)),
                          pre_norm_boundary=boundary)
        if out is not NotImplemented and gemms is not None:
            self.gemm_bytes = [n for n, _ in gemm_bytes]
            self.gemm_why = [reason for _, reason in gemm_bytes]
        if not keep:
            return out
        if out is not NotImplemented:
            kept = pool_stats(hidden.device)["in_use_bytes"] - before
            h = _hidden_of(out)
            if isinstance(h, torch.Tensor) and is_pooled(h):
                kept -= -(-h.untyped_storage().nbytes() // _POOL_ALIGNMENT) * _POOL_ALIGNMENT
            keeping = sum(w is None for w in why)
            for k in range(len(layers)):
                self.attention[k] = (None, why[k]) if why[k] else (max(0, kept) // keeping, None)
        return out

    def _running(self) -> int:
        return self.running

    def _tell(self, layer: int, kept_bytes: Optional[int], reason: Optional[str]):
        self.attention[layer] = (kept_bytes, reason)

    def keeps(self, k: int) -> str:
        """What layer k of the group keeps from forward to backward (explain). Fused layers' kept bytes are the
        group's pool slots besides its output, shared out evenly."""
        if self.kept:
            return "everything it saves (not checkpointed)"
        bert = self.boundary and is_fused_layer(self.layers[k]) and \
            getattr(self.layers[k], "family", None) == BERT and _C.pre_norm_boundaries()
        # a planned group taking the group before's pre-norm sum keeps no input of its own
        takes = bert and self.takes and self.planner is not None
        boundary = ""
        if bert and k == len(self.layers) - 1:
            boundary = ("its last norm's input and row statistics (BERT's pre-norm boundary, unless a LoRA adapter is "
                        "on its output linear: the replay skips the output linear and norm; " +
                        ("the next fused group keeps that, not its input)" if self.planner is None else
                         "the next group keeps that, not its input)" if self.passes else
                         "no group after it takes that as its input)"))
        if self.keep == "boundaries":
            if takes and k == 0:
                head = ("no input of its own (its input is recomputed in its replay from the pre-norm sum the group "
                        "before keeps, with one add_layer_norm)")
                return f"{head}, and {boundary}" if boundary else head
            if boundary:
                boundary = boundary.replace("statistics (", "statistics instead of its output (", 1)
                # a group of one layer that takes no sum keeps its input too (the first of a chain)
                return f"its input and {boundary}" if k == 0 and self.planner is not None else boundary
            if takes:
                return "no input of its own (its group's input is recomputed from the group before's pre-norm sum)"
            return "only its group's input" if len(self.layers) > 1 else "only its input"
        head = "its group's input" if len(self.layers) > 1 else "its input"
        if takes:
            head = "no input of its own (recomputed from the group before's pre-norm sum)"
        if boundary:
            head = f"{head}, {boundary}"
        level = fused_level(self.keep) if is_fused_layer(self.layers[k]) else self.keep
        if level != self.keep:
            prefix = (f"(keep={self.keep!r} falls back to {level!r}: fused layers keep no GEMM outputs, only their "
                      "attention's) ")
        else:
            prefix = "" if level == "attention" else f"(keep={self.keep!r}) "
        if keeps_gemms(level) is not None and is_fused_layer(self.layers[k]) and self.gemm_why[k]:
            prefix += f"(no GEMM output kept, because {self.gemm_why[k]}) "
        if level == "boundaries":
            return f"{prefix}only {head}"
        if level != "attention":
            gemms = ("the outputs of the GEMMs before its attention (the query/key/value projections)"
                     if level == "attention_inputs" else "the outputs of all its GEMMs")
            if self.gemm_bytes[k]:
                gemms += f" ({fmt_bytes(self.gemm_bytes[k])} in the last step)"
            if level == "gemms":
                return f"{prefix}{head} and {gemms}; the replay runs only elementwise ops, norms and the attention"
            head = f"{head}, {gemms}"
        seen = self.attention[k]
        if seen is None:
            return (f"{prefix}{head} and its attention kernel's output and log-sum-exp (checked at the first "
                    "training step)")
        kept_bytes, reason = seen
        if reason is not None:
            return f"{prefix}{head}{' only:' if level == 'attention' else ';'} its attention keeps nothing, because {reason}"
        return (f"{prefix}{head} and its attention kernel's output and log-sum-exp ({fmt_bytes(kept_bytes)} in the "
                "last step); the replay skips the attention forward" + ("" if level == "attention" else
                                                                       " and those GEMMs"))

    def _uses(self) -> _Found:
        """What the group's layers use: their BatchNorm modules and FSDP units (see _discovery)."""
        found = _Found()
        for layer in self.layers:
            _add_module(layer, found)
        return found

    def _check_fsdp(self, units: List[nn.Module]):
        """The first layer's FSDP hooks wrap the group's call (the layer's forward is what is wrapped);
        a later layer that is an FSDP unit of its own has not gathered its parameters at that point."""
        ids = {id(u) for u in units}
        later = [i for i, layer in enumerate(self.layers[1:], 1) if id(layer) in ids]
        if later:
            i = self.index + later[0]
            raise RuntimeError(
                f"ckpt_ext.enable_checkpointing: layers {self.index}-{self.index + len(self.layers) - 1} are one "
                f"checkpointed group, but layer {i} ({type(self.layers[later[0]]).__name__}) is an FSDP unit of its "
                "own (torch.distributed.fsdp.fully_shard). A group runs all its layers inside the first layer's "
                "call, before FSDP gathers the parameters of the others. With layers sharded one by one use "
                "every=1 (each layer checkpointed inside its own unit), or fully_shard the model alone to group "
                "layers.")
        _check_fsdp_units(f"{type(self.layers[0]).__name__} (enable_checkpointing)", units, outside=self.layers[0])

    def call(self, *layer_args, **layer_kwargs):
        """run() with the layer's own arguments (what the checkpoint calls and replays)."""
        return self.run(layer_args, layer_kwargs)

    def run(self, layer_args: Tuple, layer_kwargs: Dict):
        """Runs every layer of the group (unwrapped), feeding each output's hidden state to the next."""
        first, rest = self.layers[0], self.layers[1:]
        # keep="attention" names the running layer in its messages (eager only: Dynamo refuses the mutation)
        track = self.context_fn is not None and not torch.compiler.is_compiling()
        if track:
            self.running = 0
        out = type(first).forward(first, *layer_args, **layer_kwargs)
        for k, layer in enumerate(rest, 1):
            if track:
                self.running = k
            try:
                out = type(layer).forward(layer, _hidden_of(out), *layer_args[1:], **layer_kwargs)
            except Exception as e:
                if self.planner is None and hasattr(e, "add_note"):
                    e.add_note(
                        f"ckpt_ext.enable_checkpointing(every={len(self.layers)}): layers {self.index}-"
                        f"{self.index + len(self.layers) - 1} run as one group, each on the output of the one "
                        f"before; layer {self.index + k} ({type(layer).__name__}) failed on it. A model that "
                        "transforms the hidden state between its layers (a projection) cannot have them grouped: "
                        "use every=1, or budget= (the planner groups only layers called on the output of the one "
                        "before).")
                raise
        return out




def _layer_name(stack: str, i: int, layer: nn.Module) -> str:
    return f"{stack}.{i} ({type(layer).__name__})" if stack else f"layer {i} ({type(layer).__name__})"


def _alone(self: nn.Module, group: "_Group", args: Tuple, kwargs: Dict):
    """A later layer of a group called on its own (not after its group's first layer): checkpointed alone,
    keeping what its group keeps."""
    out = group.fused_segment([self], args, kwargs)
    if out is not NotImplemented:
        return out
    context_fn = None
    if group.keep != "boundaries":
        context_fn = KeepLevel([group.names[group.layers.index(self)]], keep=group.keep)
    return _checkpoint(functools.partial(type(self).forward, self), args, kwargs, outside=self,
                       context_fn=context_fn)


def _attach_planned(planner: StackPlanner, segments: List[Tuple[int, int, Union[bool, str]]]):
    """Installs a planner's groups: a checkpointed segment is one group (keeping attention when the plan says
    so), a kept layer a group of its own."""
    groups = []
    plan = planner.plan
    # BERT's pre-norm boundary where the plan accounts for it (the measuring step's groups run without)
    boundaries = plan.boundaries if plan is not None and plan.segments == list(segments) else frozenset()
    takes = {s for (s, *_), p in zip(segments, segment_costs(plan.costs, segments, boundaries, plan.chained)) if p[4]} \
        if boundaries else set()
    for s, e, how in segments:
        if how:
            keep = "boundaries" if how is True else how  # "attention", "attention_inputs", "gemms", ...
            groups.append(_Group(planner.layers[s:e], s, planner, keep=keep, stack=planner.name,
                                 boundary=s in boundaries, takes=s in takes, passes=e in takes))
        else:
            groups.extend(_Group([planner.layers[i]], i, planner, kept=True, stack=planner.name)
                          for i in range(s, e))
    _attach_groups(groups)


def _attach_groups(groups: List[_Group]):
    """Installs the groups of one stack."""
    siblings = [g for g in groups if len(g.layers) > 1]
    for group, after in zip(groups, groups[1:] + [None]):
        group.siblings = siblings
        group.after = after
        for layer in group.layers:
            _attach(layer, group)


def _check_order(group: _Group, args: Tuple):
    """A group's first layer runs all its layers; the stack must then call the others in order. Raises
    when this call receives the output of a group whose later layers were not called yet: the model
    skips, repeats or reorders layers, and the group ran layers the model did not ask for."""
    hidden = args[0] if args else None
    if hidden is None:
        return
    for g in group.siblings:
        if g.pending is not None and hidden is g.pending.hidden():
            skipped = g.index + g.pending.done
            g.pending = None
            raise RuntimeError(
                f"ckpt_ext.enable_checkpointing(every={len(g.layers)}): layer {group.index} "
                f"({type(group.layers[0]).__name__}) received the output of the group of layers {g.index}-"
                f"{g.index + len(g.layers) - 1} before layer {skipped} was called. That group runs all its layers "
                "when its first layer is called, so this model, which skips, repeats or reorders its layers, "
                "would get layers it did not call. Use every=1.")


def _attach(layer: nn.Module, group: _Group):
    remember_signature(layer)
    object.__setattr__(layer, _ATTR, group)
    # A partial, not a bound method: it pickles by value (a bound method pickles as getattr(layer,
    # '_layer_forward'), which a loaded layer does not have), and Dynamo traces it the same way.
    object.__setattr__(layer, "forward", functools.partial(_layer_forward, layer))


def _layer_forward(self: nn.Module, *args, **kwargs):
    if not (self.training and torch.is_grad_enabled()):
        # Nothing is checkpointed: the layer's own forward (which torch.compile traces).
        getattr(self, _ATTR).pending = None
        return type(self).forward(self, *args, **kwargs)
    return _training_layer_forward(self, args, kwargs)


def _traced_layer_forward(self: nn.Module, args: Tuple, kwargs: Dict):
    """_training_layer_forward while Dynamo traces: the same groups, each checkpointed call traced as torch's
    checkpoint (ckpt_ext/_compiler.py) or, for fused layers, as the ckpt_ext::fused_segment operator. A
    group's output is handed to its later layers through `group.traced`, set and cleared within the traced
    loop (so it never outlives the compiled frame). A budget's plan is made in eager training steps (its
    probe measures real runs): until one is installed, every layer is checkpointed alone."""
    group: _Group = getattr(self, _ATTR)
    if layer_hf_checkpointed(self):
        raise double_checkpointing_error(self, group.index + group.layers.index(self))
    if group.kept:
        return type(self).forward(self, *args, **kwargs)
    args, kwargs = drop_cache(self, args, kwargs)
    if group.layers[0] is self:
        # BERT's pre-norm boundary between the groups' operators, as the eager segments hand it on (C++
        # offer_boundary / adopt_boundary): taken here from the group before, handed to the group after when that one
        # is checkpointed; never left on a group after the traced frame (the last group of a stack hands nothing on)
        hand = {"take": group.handed} if group.handed is not None else {}
        group.handed = None
        out = group.fused_segment(group.layers, args, kwargs, traced_boundary=hand)
        if "give" in hand and group.after is not None and not group.after.kept:
            group.after.handed = hand["give"]
        if out is NotImplemented:
            out = _checkpoint(group.run, (args, kwargs), {}, modules=group.layers, outside=self,
                              context_fn=group.context_fn)
        group.traced = (out, 1, args[1:], kwargs) if len(group.layers) > 1 else None
        return out
    if group.traced is None:  # called on its own: checkpointed alone
        return _alone(self, group, args, kwargs)
    out, done, g_args, g_kwargs = group.traced
    group.traced = None
    if group.layers[done] is not self or not args or args[0] is not _hidden_of(out):
        raise _changed_between_layers(group, done, self)
    if not _same_args(args[1:], kwargs, g_args, g_kwargs):
        raise _different_arguments(group, done, self, _differing_args(args[1:], kwargs, g_args, g_kwargs))
    if done + 1 < len(group.layers):
        group.traced = (out, done + 1, g_args, g_kwargs)
    return out


def _changed_between_layers(group: _Group, done: int, layer: nn.Module) -> RuntimeError:
    return RuntimeError(
        f"ckpt_ext.enable_checkpointing(every={len(group.layers)}): layer {group.index + done} "
        f"({type(layer).__name__}) did not receive the output of the layer before it unchanged; this model "
        "transforms hidden states between layers, so layers cannot be grouped. Use every=1.")


def _different_arguments(group: _Group, done: int, layer: nn.Module, which: str = "") -> RuntimeError:
    return RuntimeError(
        f"ckpt_ext.enable_checkpointing(every={len(group.layers)}): layer {group.index + done} "
        f"({type(layer).__name__}) receives different arguments than layer {group.index}"
        + (f" ({which})" if which else "") + ", but a group runs all its layers with the first layer's arguments "
        "(a model whose layers get their own masks or rotary tables, as Gemma 3's sliding and full layers, cannot "
        "group them). Use every=1.")


@traced_under_compile(_traced_layer_forward)
def _training_layer_forward(self: nn.Module, args: Tuple, kwargs: Dict):
    group: _Group = getattr(self, _ATTR)
    if layer_hf_checkpointed(self):
        raise double_checkpointing_error(self, group.index + group.layers.index(self))
    planner = group.planner
    measuring = False
    if planner is not None:
        if self is planner.layers[0]:
            planner.begin_step(args)  # a new step: install the plan, or plan again for a larger input
            group = getattr(self, _ATTR)
        measuring = planner.plan is None  # (the last layer's probe makes the plan)
        if measuring:
            planner.probe(self, *drop_cache(self, args, kwargs))
    if group.siblings and group.layers[0] is self:
        _check_order(group, args)
    if group.kept:
        return type(self).forward(self, *args, **kwargs)
    if group.layers[0] is self:
        group.handed = None  # (a compiled frame's hand-over, where the next group then ran eagerly)
        args, kwargs = drop_cache(self, args, kwargs)
        out = group.checkpointed(args, kwargs)
        if measuring:
            # measuring: which layer takes which one's output, and how long its backward takes
            planner.passed_on(self, _hidden_of(out), args[0] if args else None)
        if len(group.layers) > 1:
            group.pending = _Pending(out, 1, args, kwargs)
        return out
    # A later layer of the group: the group already ran it.
    if group.pending is None:  # called on its own (e.g. by the user): run it, checkpointed alone
        args, kwargs = drop_cache(self, args, kwargs)
        return _alone(self, group, args, kwargs)
    # The group's output is gone when the stack transformed it before this layer (`layer(x) * 2`).
    pending = group.pending.get()
    out, g_args, g_kwargs = pending if pending is not None else (None, (), {})
    done = group.pending.done
    expected = group.layers[done]
    args, kwargs = drop_cache(self, args, kwargs)
    if pending is None or expected is not self or not args or args[0] is not _hidden_of(out):
        group.pending = None
        raise _changed_between_layers(group, done, self)
    if not _same_args(args[1:], kwargs, g_args, g_kwargs):
        group.pending = None
        raise _different_arguments(group, done, self, _differing_args(args[1:], kwargs, g_args, g_kwargs))
    if done + 1 < len(group.layers):
        group.pending.done = done + 1
    else:
        group.pending = None
    return out


def _param_count(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def _is_uniform_stack(m: nn.Module) -> bool:
    if not isinstance(m, (nn.ModuleList, nn.Sequential)):
        return False
    children = list(m.children())
    return len(children) >= 2 and len({type(c) for c in children}) == 1 and _param_count(m) > 0


def _find_stacks(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    candidates = [(name, m) for name, m in model.named_modules() if _is_uniform_stack(m)]
    if not candidates:
        return []
    sizes = {name: _param_count(m) for name, m in candidates}
    largest = max(sizes.values())
    chosen: List[Tuple[str, nn.Module]] = []
    # The largest stack, plus other stacks of comparable size (encoder and decoder), none inside another.
    for name, m in sorted(candidates, key=lambda c: -sizes[c[0]]):
        if sizes[name] * 4 < largest:
            continue
        if any(name.startswith(c + ".") or c == "" for c, _ in chosen):
            continue
        chosen.append((name, m))
    return chosen


def enable_checkpointing(model: nn.Module, every: Optional[int] = None, layers: Optional[Sequence[nn.Module]] = None,
                         budget: Union[int, str, None] = None, keep: Optional[str] = None) -> nn.Module:
    """Checkpoints the model's layer stack with ckpt_ext: groups of ``every`` (default 1) consecutive
    layers run as one checkpointed call in training (layer keyword arguments -- attention masks,
    position ids, rotary embeddings -- are passed through). ``layers`` names the stack explicitly (an
    ``nn.ModuleList``/``nn.Sequential`` or a list of modules).

    ``budget`` ("20GiB", "512MiB" or bytes) replaces ``every``: the planner chooses which layers to
    checkpoint and how to group them so that the activation bytes held from forward to backward (saved
    tensors and pooled boundaries, not parameters, gradients or optimizer state) plus the largest replay
    fit the budget with the least recompute, choosing per group among keeping its layers whole,
    checkpointing them at a keep level (keeping their attention, attention and its inputs, GEMM outputs, both: the
    values of keep= below, where the layers can) and boundary-only recompute; ``keep="boundaries"`` never keeps
    more than the boundary, ``keep=<level>`` checkpoints every checkpointed group at that level. It measures each layer during the first training step (bytes saved,
    forward time, attention time and kept bytes) and plans for that step's input size (and again, during its
    step, for an input larger in a dimension); a budget below the least achievable raises ValueError stating
    the minimum. ``ckpt_ext.explain(model)`` describes the plan: each layer's choice, the predicted peak
    and the predicted overhead.

    ``keep`` is what a checkpointed layer keeps from forward to backward besides its input (the segment
    boundary): ``"boundaries"`` (the default without budget=; None means it there) keeps nothing else and
    the replay runs the whole layer; ``"attention"`` also keeps its attention kernel's output and log-sum-exp (and, with
    dropout on CUDA, the Philox seed/offset the kernel used), and the replay runs the layer without the
    attention forward, the attention backward using the kept output and log-sum-exp (gradients
    bit-identical to no checkpointing). It needs attention through
    ``torch.nn.functional.scaled_dot_product_attention`` landing in a fused kernel (CPU: flash; CUDA:
    flash, efficient or cuDNN): a Hugging Face model configured for another attention implementation is
    refused (ValueError), and a call that runs SDPA's math path (attention dropout on CPU, an unsupported
    mask or dtype) keeps nothing, is recomputed in full and warns once, naming the layer and the reason.
    ``"attention_inputs"`` also keeps the outputs of the GEMMs the layer runs before its attention (the q/k/v
    projections; the replay skips them too), ``"gemms"`` keeps every GEMM output (``nn.Linear``/``F.linear``,
    ``torch.addmm``; the replay runs only elementwise ops, norms and the attention) and ``"gemms_attention"`` both
    (docs/keep-attention.md "Recompute levels"; fused layers keep attention only and fall back, saying so in
    explain()). Other values raise ValueError naming the allowed ones. ``ckpt_ext.explain(model)`` says what each
    layer keeps.

    A Hugging Face model in which no such stack is found (layers of several classes)
    is checkpointed through Hugging Face's own ``_set_gradient_checkpointing`` with ckpt_ext's checkpoint
    (every=1 only). Hugging Face's checkpointing switch of ``model``, turned on later (Trainer's
    ``gradient_checkpointing=True``), is handed over to ckpt_ext. Returns the model."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"enable_checkpointing expects an nn.Module, got {type(model).__name__}")
    options = {"every": every, "budget": budget, "layers": layers, "keep": keep}
    every, budget_bytes, keep = _check_options(every, budget, keep)
    check_versions()
    refuse_hf_checkpointing_on(model)
    if layers is not None:
        if isinstance(layers, (nn.ModuleList, nn.Sequential)):
            stacks = [("layers", layers)]
        elif isinstance(layers, (list, tuple)) and layers and all(isinstance(m, nn.Module) for m in layers):
            stacks = [("layers", list(layers))]
        else:
            raise TypeError("layers must be an nn.ModuleList, an nn.Sequential or a non-empty list of modules")
        owned = {id(m) for m in model.modules()}
        if not all(id(m) in owned for m in stacks[0][1]):
            raise ValueError("layers must be modules of the model given")
    else:
        stacks = _find_stacks(model)
        host = hf_checkpointing_host(model) if not stacks else None
        if host is not None and every == 1 and budget_bytes is None:
            # A Hugging Face model whose layers ckpt_ext does not see as one stack (layers of several
            # classes): Hugging Face's own mechanism places the checkpoints (its GradientCheckpointingLayers,
            # caches dropped by its rules, FSDP2 hooks outside), with ckpt_ext's checkpoint doing the work.
            if keeps_attention(keep):
                _check_attention(model, [], keep)
            disable_checkpointing(model)
            ride_hf_checkpointing(host, keep)
            install_take_over(model, options)
            return model
        if not stacks:
            raise ValueError(
                f"enable_checkpointing found no layer stack in {type(model).__name__}: it looks for an "
                "nn.ModuleList or nn.Sequential of two or more blocks of one class. Pass the stack "
                "explicitly, e.g. enable_checkpointing(model, layers=model.encoder.layer).")
    for name, stack in stacks:
        mods = list(stack)
        if len({id(m) for m in mods}) != len(mods):
            raise ValueError(f"a layer appears twice in {name or 'the layer stack'}; ckpt_ext cannot group it")
        if every > len(mods):
            raise ValueError(f"every={every} is larger than the {len(mods)} layers of {name or 'the model'}")
        if keeps_attention(keep):
            _check_attention(model, mods, keep)
    if _checkpointed_as(model, stacks, every, budget_bytes, keep):
        # The same call again (a notebook cell run twice, defensive code): kept as it is, a budget's plan included.
        install_take_over(model, options)
        return model
    disable_checkpointing(model)
    for name, stack in stacks:
        mods = list(stack)
        if budget_bytes is not None:
            StackPlanner(name, mods, budget_bytes, _attach_planned, keep).install_probe_groups()
            continue
        _attach_groups([_Group(mods[start:start + every], start, keep=keep, stack=name)
                        for start in range(0, len(mods), every)])
    # Hugging Face's switch (Trainer's gradient_checkpointing=True) turned on later means ckpt_ext: a
    # hand-over, never a second checkpoint around the same layers.
    install_take_over(model, options)
    return model


def _checkpointed_as(model: nn.Module, stacks: List[Tuple[str, Any]], every: int, budget_bytes: Optional[int],
                     keep: str) -> bool:
    """Whether ``model`` is checkpointed exactly as enable_checkpointing with these (validated) arguments would
    checkpoint it: the same stacks in the same groups keeping the same, or the same budget's planner, and no
    other module checkpointed."""
    wanted = set()
    for _, stack in stacks:
        mods = list(stack)
        wanted.update(id(m) for m in mods)
        groups = [m.__dict__.get(_ATTR) for m in mods]
        if any(g is None for g in groups):
            return False
        if budget_bytes is not None:
            p = groups[0].planner
            if p is None or p.budget != budget_bytes or p.keep != keep or len(p.layers) != len(mods) or \
                    any(a is not b for a, b in zip(p.layers, mods)) or any(g.planner is not p for g in groups):
                return False
            continue
        if any(g.planner is not None or g.keep != keep for g in groups):
            return False
        for start in range(0, len(mods), every):
            expected = mods[start:start + every]
            g = groups[start]
            if len(g.layers) != len(expected) or any(a is not b for a, b in zip(g.layers, expected)):
                return False
    return {id(m) for m in model.modules() if _ATTR in m.__dict__} == wanted and \
        not any(rides_hf(m) for m in model.modules())


def _check_attention(model: nn.Module, layers: List[nn.Module], keep: str = "attention"):
    """keep="attention" needs attention through SDPA: refuses Hugging Face models configured for another
    attention implementation (known now; other models are checked at the first training step, layer by layer;
    fused layers call SDPA's kernels themselves and refuse in their segment, naming the layer)."""
    fused = [m for m in layers if isinstance(m, FusedTransformerLayer)]
    if fused and len(fused) == len(layers):
        return  # fused layers run SDPA themselves, whatever the Hugging Face config says
    impl = attention_implementation(model, layers)
    if impl is not None and impl != "sdpa":
        cls = type(layers[0]).__name__ if layers else type(model).__name__
        raise ValueError(
            f"ckpt_ext.enable_checkpointing(keep={keep!r}): the attention of {cls} runs Hugging Face's "
            f"{impl!r} implementation (config._attn_implementation), which "
            f"{'computes softmax(QK^T)V itself and keeps no log-sum-exp' if impl == 'eager' else 'ckpt_ext does not see'}; "
            f"keep={keep!r} needs torch.nn.functional.scaled_dot_product_attention. Load the model with "
            "attn_implementation='sdpa' (or call model.set_attn_implementation('sdpa')), or use keep='boundaries'.")


def _check_options(every, budget, keep=None) -> Tuple[int, Optional[int], str]:
    """Validates enable_checkpointing's every/budget/keep; returns (every, budget in bytes or None, keep)."""
    if budget is not None and every is not None:
        raise ValueError("give either every= (fixed groups) or budget= (planned groups), not both")
    budget_bytes = parse_bytes(budget) if budget is not None else None
    # budget= alone: the planner chooses per group among keeping the layers whole, checkpointing them keeping
    # their attention, and boundary-only recompute ("auto"); keep= given restricts what a checkpointed group keeps.
    keep = "auto" if budget_bytes is not None and keep is None else check_keep(keep)
    every = 1 if every is None else every
    if isinstance(every, bool) or not isinstance(every, int):
        raise TypeError(f"every must be a positive int, got {every!r}")
    if every < 1:
        raise ValueError(f"every must be at least 1, got {every}")
    return every, budget_bytes, keep


def is_enabled(model: nn.Module) -> bool:
    """Whether enable_checkpointing is in effect on a module of ``model``."""
    return any(_ATTR in m.__dict__ or rides_hf(m) for m in model.modules())


class Explanation(str):
    """explain()'s text: a str whose repr is the text itself, so a REPL shows it once, readably (the
    string is returned, not printed: ``print(ckpt_ext.explain(model))`` in a script)."""

    def __repr__(self) -> str:
        return str(self)


def explain(model: nn.Module) -> Explanation:
    """Says how ckpt_ext checkpoints the model: the groups, and for a budget the plan with its predicted
    bytes held and recompute. Returns the text (a str that a REPL displays as it is); it prints
    nothing."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"explain expects an nn.Module, got {type(model).__name__}")
    groups, planners = [], []
    for m in model.modules():
        g = m.__dict__.get(_ATTR)
        if g is None:
            continue
        if g.planner is not None:
            if all(g.planner is not p for p in planners):
                planners.append(g.planner)
        elif g.layers[0] is m:
            groups.append(g)
    ridden = [m for m in model.modules() if rides_hf(m)]
    if ridden and not groups and not planners:
        level = rides_hf_keep(ridden[0])
        keeps = ("its input and its attention kernel's output and log-sum-exp (keep='attention'; a layer whose "
                 "attention keeps nothing is warned of at the first training step)" if level == "attention" else
                 f"{KEEP_VALUES[level]} (keep={level!r})" if level != "boundaries" else "only its input")
        return Explanation(f"ckpt_ext checkpoints {len(ridden)} layers through Hugging Face's own checkpointing "
                           "(ckpt_ext found no uniform layer stack; Hugging Face places the checkpoints, ckpt_ext's "
                           f"checkpoint runs them): each layer keeps {keeps} from forward to backward.")
    if not groups and not planners:
        text = "ckpt_ext checkpointing is not enabled on this model (see ckpt_ext.enable_checkpointing)."
    elif planners:
        parts = []
        for p in planners:
            head = f"{p.name or 'layers'}: {len(p.layers)} layers"
            if p.plan is None:  # (a plan's description states the budget)
                known = sum(c is not None for c in p.costs)
                parts.append(f"{head}, budget {fmt_bytes(p.budget)}; plan pending: it is made during the first "
                             f"training step ({known}/{len(p.layers)} layers measured so far)")
            else:
                state = "in use" if p.installed else "made; in use from the next training step"
                others = [s for s in p.plans if s != p.shape]
                more = (f" (also planned for {', '.join(map(str, others))}; a larger input is planned for when "
                        "it comes)") if others else " (a larger input is planned for when it comes)"
                parts.append(f"{head}; plan {state}, for input shape {p.shape}{more}\n{p.plan.describe()}")
                parts += _planned_layers(model, p)
        text = "\n".join(parts)
    else:
        sizes = sorted({len(g.layers) for g in groups})
        text = (f"ckpt_ext checkpoints {sum(len(g.layers) for g in groups)} layers in {len(groups)} groups of "
                f"{'/'.join(map(str, sizes))} layer(s)")
        bert = any(g.boundary and g.layers and is_fused_layer(g.layers[-1]) and
                   getattr(g.layers[-1], "family", None) == BERT for g in groups) and _C.pre_norm_boundaries()
        if all(g.keep == "boundaries" for g in groups) and not bert:
            text += "; every group keeps only its input from forward to backward."
        elif all(g.keep == "boundaries" for g in groups):
            text += ("; every group keeps one boundary from forward to backward: a fused BERT group its last norm's "
                     "input and row statistics (the pre-norm boundary: its replay skips the output linear and norm), "
                     "and then not its own input when the group before it is such a group.")
        else:
            lines = [f"  {name}: keeps {g.keeps(k)}" for g in groups for k, name in enumerate(g.names)]
            text += f", keep={groups[0].keep!r}. From forward to backward:\n" + "\n".join(lines + _not_kept_summary(groups))
    return Explanation(text)


def _not_kept_summary(groups: List["_Group"]) -> List[str]:
    """keep='attention': one line per reason for the layers whose attention kept nothing in the last step (they
    are replayed in full)."""
    layers: Dict[str, List[str]] = {}
    for g in groups:
        for k, seen in enumerate(g.attention):
            if keeps_attention(g.keep) and seen is not None and seen[1] is not None:
                layers.setdefault(seen[1], []).append(g.names[k])
    lines = [f"  replayed in full (attention not kept) in the last step: {', '.join(names)}, because {why}"
             for why, names in layers.items()]
    compiled = sorted({g.keep for g in groups if (keeps_attention(g.keep) or keeps_gemms(g.keep) is not None) and
                       is_fused_layer(g.layers[0])})
    if compiled:
        lines.append(f"  under torch.compile a fused segment (the ckpt_ext::fused_segment operator) keeps only its "
                     f"input: keep={'/'.join(map(repr, compiled))} runs as keep='boundaries' there (warned once)")
    return lines


def _planned_layers(model: nn.Module, p: StackPlanner) -> List[str]:
    """explain() of a plan: what each layer keeps (after a step, what it kept), and why layers cannot keep their
    attention (measured)."""
    lines = []
    if p.installed:
        lines.append("  each layer, from forward to backward:")
        seen, groups = set(), []
        for layer in p.layers:
            g = layer.__dict__.get(_ATTR)
            if g is None or g.planner is not p or id(g) in seen:
                continue
            seen.add(id(g))
            groups.append(g)
            lines += [f"    {name}: keeps {g.keeps(k)}" for k, name in enumerate(g.names)]
        lines += _not_kept_summary(groups)
    if p.keep == "auto":
        reasons = {}
        for i, why in enumerate(p.why):
            if why is not None:
                reasons.setdefault(why, []).append(i)
        for why, idx in reasons.items():
            lines.append(f"  layers {', '.join(map(str, idx))} cannot keep their attention (so the planner never "
                         f"chose it for them), because {why}")
    return lines


def disable_checkpointing(model: nn.Module) -> nn.Module:
    """Undoes enable_checkpointing; returns the model."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"disable_checkpointing expects an nn.Module, got {type(model).__name__}")
    _detach_groups(model)
    remove_take_over(model)
    return model


def _detach_groups(model: nn.Module):
    for m in model.modules():
        if rides_hf(m):
            m.gradient_checkpointing = False
        if _ATTR in m.__dict__:
            del m.__dict__[_ATTR]
            m.__dict__.pop("forward", None)


_entry_points.register(enable_checkpointing=enable_checkpointing, is_enabled=is_enabled,
                      check_options=_check_options, detach_groups=_detach_groups)
