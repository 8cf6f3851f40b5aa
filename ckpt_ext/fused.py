"""Fused transformer layers for Hugging Face models: ``ckpt_ext.fuse(model)``.

``fuse`` replaces every ``BertLayer``, ``RobertaLayer``, ``GPT2Block``, ``LlamaDecoderLayer``,
``Qwen2DecoderLayer``, ``MistralDecoderLayer``, ``Qwen3DecoderLayer`` and ``GemmaDecoderLayer`` of a model
with a :class:`FusedTransformerLayer` whose forward is one call into C++ (csrc/layers/): ATen matmuls,
the attention kernel ``scaled_dot_product_attention`` chooses and the fused ckpt_ext ops, differentiated by C++
autograd. The fused
layer holds the *same* submodules, hence the same ``Parameter`` objects under the same ``state_dict``
keys, so optimizers, checkpoints and ``load_state_dict`` are unaffected.

Calls the fused path cannot serve run Hugging Face's own forward of the original layer (same
parameters), so results stay correct: a KV cache outside training (generation), attention weights
being collected (``output_attentions``), cross-attention inputs. In training (grad enabled)
a KV cache is dropped instead, as Hugging Face does under gradient checkpointing.

Dropout draws one seed per layer call from the default generator of the device (``torch.manual_seed``
makes runs reproducible) and derives a Philox mask per dropout site from it; with
``ckpt_ext.enable_checkpointing`` the layers of a group run as one C++ ``SegmentFunction`` that replays
them in backward with the same seeds. Attention dropout is SDPA's, drawn from the device generator set
to a state derived from the layer's seed for the call (csrc/layers/layer.h).

Under ``torch.autocast`` (CUDA bfloat16/float16, CPU bfloat16) the fused layers follow Hugging Face's
dtype policy: GEMMs and attention in the autocast dtype from the (float32) parameters, norms and the
residual stream in the parameters' dtype, gradients in the parameters' dtype.
"""
import sys
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from . import compiled
from ._compiler import check_not_capturing, in_compile_fallback, traced_under_compile
from ._extension import load
from ._layout import BERT, DECODERS, FAMILY_NAMES
from ._user_frame import user_stacklevel
from .keep import compiled_level_fallback, level_of, warn_not_kept
from .hf.cache import cache_parameters, find_cache
from .hf.versions import check_versions
from .hf.head import fuse_lm_head
from .hf.layers import (LORA_PROJECTIONS, WEIGHT_PATHS, Unsupported, collecting_attentions,
                        install_output_capturing, layer_classes, layer_spec, left_to_hf_classes,
                        picklable_capturing_hooks, positional_parameters, resolve_collector, returns_tuple)
from .hf.peft import base_of, check_layer_adapters, is_adapter_layer, lora_terms, peft_relink

_C = load()

__all__ = ["FusedTransformerLayer", "fuse", "run_segment"]

_SUPPORTED = ("BertLayer, RobertaLayer, GPT2Block, LlamaDecoderLayer, Qwen2DecoderLayer, MistralDecoderLayer, "
              "Qwen3DecoderLayer, GemmaDecoderLayer")

_warned: set = set()


def _warn_once(key, message: str):
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, stacklevel=user_stacklevel())


# The specs registered for the ckpt_ext::fused_segment operator, by id: the layers' own (FusedTransformerLayer
# ._register_spec) and, per (base id, LoRA key), the same spec with adapters (_lora_spec_id).
_registered_specs: Dict[int, Any] = {}
_lora_spec_ids: Dict[Tuple[int, tuple], Tuple[int, bool]] = {}


def _lora_spec_id(base_id: int, key: tuple) -> Tuple[int, bool]:
    """(id, uses dropout in training) of the registered spec `base_id` with the LoRA adapters of `key` (per
    adapter projection (scaling, dropout p)), registered once per process. Dynamo calls it while tracing and
    bakes its result into the graph (marked as torch.compiler.assume_constant_result marks a function,
    without importing Dynamo here): its arguments are constants of the traced code, guarded there."""
    found = _lora_spec_ids.get((base_id, key))
    if found is None:
        spec = _registered_specs[base_id].with_lora([k[0] for k in key], [k[1] for k in key])
        found = _lora_spec_ids[(base_id, key)] = (_C.register_spec(spec), _C.uses_dropout(spec, True))
    return found


_lora_spec_id._dynamo_marked_constant = True  # what torch.compiler.assume_constant_result sets (2.13, 2.15 read)


# --------------------------------------------------------------------------------------------------
# The fused layer
# --------------------------------------------------------------------------------------------------
class _Call:
    """One layer call, parsed: what the fused forward reads, plus why it cannot serve the call (if so)."""

    __slots__ = ("hidden", "mask", "cos", "sin", "fallback")

    def __init__(self, hidden, mask, cos, sin, fallback):
        self.hidden, self.mask, self.cos, self.sin, self.fallback = hidden, mask, cos, sin, fallback


def _traced_forward(self: "FusedTransformerLayer", *args, **kwargs):
    """FusedTransformerLayer.forward while Dynamo traces: the ckpt_ext::fused_segment operator of this layer
    alone (ckpt_ext/compiled.py), or Hugging Face's forward for the calls the fused path cannot serve."""
    call = self._parse(args, kwargs)
    if call.fallback is not None:
        return self._hf_forward(args, kwargs)
    self._check_compilable(call)
    if self.training and torch.is_grad_enabled() and not self.gradient_checkpointing:
        if _graph_breaks_allowed():
            # Not checkpointed: the eager fused layer, behind a graph break, keeps its activations as fuse alone
            # does; the operator below would replay the layer in backward (docs/compile.md).
            return self._as_returned(_fused_layer_not_traced(self, call.hidden, call.mask, call.cos, call.sin))
        _compiled_not_checkpointed(self.layer_class)
    return self._as_returned(compiled.fused_segment([self], call.hidden, call.mask, call.cos, call.sin, self.training))


def fused_layer_runs_eagerly_under_compile(layer: "FusedTransformerLayer", hidden, mask, cos, sin):
    """A fused layer that is not checkpointed, in training under torch.compile: the eager fused layer (its C++
    autograd keeps the layer's activations for backward, as ``fuse`` alone does), run with Dynamo disabled, so a
    graph break before and after it (docs/compile.md). Named for what Dynamo's graph-break report shows."""
    spec, weights = layer._call_args()
    return _C.fused_layer_forward(spec, hidden, mask, cos, sin, weights, layer.training)


_fused_layer_not_traced = torch._disable_dynamo(fused_layer_runs_eagerly_under_compile)


def _graph_breaks_allowed() -> bool:
    """Whether the frame Dynamo traces may break its graph: False under ``fullgraph=True``, torch.export and
    ``torch._dynamo.error_on_graph_break(True)`` (Dynamo's own flags, read from its tracer: private, so any failure to
    read them answers False, the operator path that never breaks a graph). Dynamo calls it while tracing (a
    constant result)."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator
        tx = InstructionTranslator.current_tx()
        if tx is None or getattr(tx, "one_graph", True):
            return False
        if getattr(tx, "error_on_graph_break", False):
            return False
        from torch._dynamo import eval_frame
        getter = getattr(eval_frame, "_get_error_on_graph_break", None)
        return not (getter is not None and getter())
    except Exception:  # another torch's Dynamo: never break a graph we cannot tell may break
        return False


_graph_breaks_allowed._dynamo_marked_constant = True  # what torch.compiler.assume_constant_result sets


def _compiled_not_checkpointed(layer_class: str) -> bool:
    """Warns once that a fused layer traced by Dynamo outside a checkpointed group, where the graph may not break
    (fullgraph=True, torch.export), is a one-layer checkpoint there (docs/compile.md). Dynamo calls it while tracing
    (a constant result, no graph break)."""
    _warn_once(("compiled, not checkpointed", layer_class),
               f"ckpt_ext: under torch.compile(fullgraph=True) (or torch.export) a fused {layer_class} that is not "
               "checkpointed runs as the ckpt_ext::fused_segment operator, which keeps only the layer's input and "
               "replays the layer in backward: the step and memory of fuse + checkpointing, not of fuse alone. "
               "Without fullgraph=True each such layer runs eagerly between two graphs (its activations kept, "
               "the speed of eager fuse). Or use ckpt_ext.enable_checkpointing(model) with the compiled fused model "
               "(the same cost, said), or compile without ckpt_ext.fuse (docs/compile.md).")
    return True


_compiled_not_checkpointed._dynamo_marked_constant = True  # what torch.compiler.assume_constant_result sets


class FusedTransformerLayer(nn.Module):
    """A Hugging Face BERT/RoBERTa, GPT-2, Llama, Qwen2, Mistral, Qwen3 or Gemma layer whose forward runs in C++.

    Holds the original layer's submodules (so its ``Parameter`` objects and ``state_dict`` keys), accepts
    the original forward's arguments and returns what it returns (the hidden states). Build it with
    :func:`fuse`, or ``FusedTransformerLayer(layer)`` for one layer (raises ``ValueError`` if the layer's
    configuration is not supported).

    Checkpointing: ``ckpt_ext.enable_checkpointing(model, every=k)`` runs groups of ``k`` fused layers as
    one C++ ``SegmentFunction``. Hugging Face's ``model.gradient_checkpointing_enable()`` sets this
    layer's ``gradient_checkpointing`` flag too; the layer is then checkpointed alone, with the same
    ``SegmentFunction`` (Hugging Face's checkpoint function is not used).
    """

    gradient_checkpointing = False  # set by Hugging Face's gradient_checkpointing_enable()

    def __init__(self, layer: nn.Module):
        super().__init__()
        if not isinstance(layer, nn.Module):
            raise TypeError(f"FusedTransformerLayer expects a Hugging Face layer module ({_SUPPORTED}), got "
                            f"{type(layer).__name__}")
        family = layer_classes().get(type(layer))
        if family is None:
            why = left_to_hf_classes().get(type(layer))
            if why is not None:
                raise ValueError(f"FusedTransformerLayer: {type(layer).__name__} cannot be fused: {why}")
            raise ValueError(f"FusedTransformerLayer: {type(layer).__name__} is not a supported layer "
                             f"({_SUPPORTED})")
        try:
            spec = layer_spec(layer, family)
        except Unsupported as e:
            raise ValueError(f"FusedTransformerLayer: this {type(layer).__name__} cannot be fused: {e}") from None
        for name, child in layer.named_children():
            self.add_module(name, child)
        self.train(layer.training)
        self.family = family
        self.spec = spec
        self.layer_class = type(layer).__name__
        check_layer_adapters(self, LORA_PROJECTIONS[family], f"FusedTransformerLayer({self.layer_class})")
        self._lora_specs: Dict[tuple, Any] = {}
        self._resolve()
        self._positional = positional_parameters(type(layer))
        self._cache_names = cache_parameters(type(layer))[1]
        self._returns_tuple = returns_tuple(layer, family)
        # The layer's plain attributes that its model reads from each layer (transformers 5.0's Qwen2/Qwen3 pick
        # the layer's mask by `decoder_layer.attention_type`; `layer_idx`, `is_sliding`, ...): carried over, not
        # looked up by name, so that what a release reads from its layers is there.
        for attr, value in vars(layer).items():
            if (not attr.startswith("_") and isinstance(value, (str, int, float, bool, type(None)))
                    and not hasattr(self, attr)):
                object.__setattr__(self, attr, value)
        # Hugging Face's own forward for the calls the fused path cannot serve. Not registered as a
        # submodule: it shares this module's children, and its parameters are already ours.
        object.__setattr__(self, "_hf_layer", layer)
        self._register_spec()
        resolve_collector()

    def _register_spec(self):
        # The spec's id in the ckpt_ext::fused_segment operators (torch.compile's path): a plain int, which
        # Dynamo bakes into the graph. Ids are per process: registered again when unpickled or copied.
        self.spec_id = _C.register_spec(self.spec)
        _registered_specs[self.spec_id] = self.spec
        self.has_dropout = _C.uses_dropout(self.spec, True)

    def __setstate__(self, state):
        # Unpickled (torch.load, a spawned process) or copied: the spec ids and the signature table are per process.
        super().__setstate__(state)
        self._register_spec()
        cache_parameters(type(self._hf_layer))
        resolve_collector()

    def _resolve(self):
        """Finds the weight-holding modules (through peft LoRA layers, to their base layers) and the
        projections that may carry adapters."""
        self._weight_slots = [self._slot(path) for path in WEIGHT_PATHS[self.family]]
        self._projections = [self.get_submodule(path) for path in LORA_PROJECTIONS[self.family]]
        self._has_lora = any(is_adapter_layer(m) for m in self._projections)
        # Every (parent, name, child) link on the way to the weight-holding modules: if one of them is
        # replaced after fuse() (an adapter, a quantised linear), the fused forward would silently use
        # the old weights, so such calls are re-resolved (peft LoRA) or run Hugging Face's forward.
        links = {}
        for path in WEIGHT_PATHS[self.family]:
            parent = self
            for name in path.split(".")[:-1]:
                child = parent._modules[name]
                links[(id(parent), name)] = (parent, name, child)
                parent = child
                if is_adapter_layer(child):
                    parent = child._modules["base_layer"]
                    links[(id(child), "base_layer")] = (child, "base_layer", parent)
        self._links = list(links.values())

    def _slot(self, path: str) -> Tuple[nn.Module, str]:
        module_path, _, name = path.rpartition(".")
        module = base_of(self.get_submodule(module_path))
        if name not in module._parameters:
            raise ValueError(f"FusedTransformerLayer: {self.layer_class} has no parameter slot {path!r}")
        return module, name

    def fused_weights(self) -> List[Optional[torch.Tensor]]:
        """The parameters in the order the C++ layer takes them (None for absent biases)."""
        weights = [m._parameters[n] for m, n in self._weight_slots]
        dtensor = sys.modules.get("torch.distributed.tensor")  # no DTensor exists before it is imported
        if dtensor is not None:
            for path, w in zip(WEIGHT_PATHS[self.family], weights):
                if isinstance(w, dtensor.DTensor):
                    raise RuntimeError(
                        f"fused {self.layer_class}: weight {path} is a DTensor (a sharded parameter). The fused "
                        "layer computes with whole tensors: shard the fused layer as one FSDP unit "
                        "(fully_shard(layer) or fully_shard(model)), not its submodules, and call it through its "
                        "module call so FSDP gathers its parameters first. Tensor-parallel layers cannot be fused.")
        return weights

    def _adapter_terms(self) -> Tuple[Optional[tuple], List[Optional[torch.Tensor]]]:
        """(key, adapter weights) of this call: the key holds per adapter projection its (scaling, dropout p),
        the weights its LoRA A and B (None, None where no adapter term is added), read from the peft layers
        per call as peft's forward would; (None, []) when the call adds no adapter term."""
        if not self._has_lora:
            return None, []
        terms = [lora_terms(m, f"fused {self.layer_class}, {path}")
                 for path, m in zip(LORA_PROJECTIONS[self.family], self._projections)]
        if all(t is None for t in terms):
            return None, []
        extra: List[Optional[torch.Tensor]] = []
        for t in terms:
            extra += [None, None] if t is None else [t[0], t[1]]
        return tuple((t[2], t[3]) if t is not None else (0.0, 0.0) for t in terms), extra

    def _call_args(self) -> Tuple[Any, List[Optional[torch.Tensor]]]:
        """(spec, weights) of this call: the parameters, then each projection's LoRA A and B (None where
        no adapter term is added; _adapter_terms)."""
        weights = self.fused_weights()
        key, extra = self._adapter_terms()
        if key is None:
            return self.spec, weights
        spec = self._lora_specs.get(key)
        if spec is None:
            spec = self._lora_specs[key] = self.spec.with_lora([k[0] for k in key], [k[1] for k in key])
        return spec, weights + extra

    def _op_args(self) -> Tuple[int, bool, List[Optional[torch.Tensor]]]:
        """_call_args for the ckpt_ext::fused_segment operator (torch.compile's path): (the spec's registered
        id, whether it draws dropout in training, weights). Traced by Dynamo: the adapters' state is read
        in traced code (so guarded), the LoRA spec's id is a constant of the graph (_lora_spec_id)."""
        weights = self.fused_weights()
        key, extra = self._adapter_terms()
        if key is None:
            return self.spec_id, self.has_dropout, weights
        spec_id, has_dropout = _lora_spec_id(self.spec_id, key)
        return spec_id, has_dropout, weights + extra

    def extra_repr(self) -> str:
        return f"{self.layer_class} -> C++ {FAMILY_NAMES[self.family]}: {self.spec!r}"

    def _parse(self, args: tuple, kwargs: dict) -> _Call:
        names = self._positional
        if len(args) > len(names):
            raise TypeError(f"{self.layer_class}.forward takes at most {len(names)} positional arguments, "
                            f"got {len(args)}")
        values = dict(zip(names, args))
        for k in names[len(args):]:
            values[k] = kwargs.get(k)
        for k in names[:len(args)]:
            if k in kwargs:
                raise TypeError(f"{self.layer_class}.forward got multiple values for argument {k!r}")
        hidden = values["hidden_states"]
        if not isinstance(hidden, torch.Tensor):
            raise TypeError(f"{self.layer_class}.forward: hidden_states must be a Tensor [batch, seq, hidden], got "
                            f"{type(hidden).__name__}")
        if hidden.device.type not in ("cpu", "cuda"):
            raise ValueError(f"fused {self.layer_class}: hidden_states are on {hidden.device}; the fused layers run "
                             "on CPU and CUDA only")
        fallback = None
        cache = find_cache(values, kwargs, self._cache_names)
        if cache is not None:
            if self.training and torch.is_grad_enabled():
                _warn_once(("cache", self.layer_class),
                           f"ckpt_ext: fused {self.layer_class} layers do not write a KV cache in training; "
                           "the cache passed is ignored (as Hugging Face does under gradient checkpointing). "
                           "Pass use_cache=False to silence this warning.")
            else:
                fallback = "a KV cache is in use"
        if values.get("encoder_hidden_states") is not None and self.family != BERT:
            fallback = "cross-attention inputs were passed"
        if kwargs.get("output_attentions") or collecting_attentions():
            fallback = "attention weights were requested"
        changed = [(parent._modules.get(name), child) for parent, name, child in self._links
                   if parent._modules.get(name) is not child]
        if changed:
            check_layer_adapters(self, LORA_PROJECTIONS[self.family],
                                 f"fused {self.layer_class}: adapters added after ckpt_ext.fuse()", RuntimeError)
        if changed and all(peft_relink(old, new) for new, old in changed):
            # peft wrapped (or unwrapped) a projection after fuse(): same Parameters, adapter read per call.
            self._resolve()
            changed = []
        if changed:
            _warn_once(("replaced", id(self)),
                       f"ckpt_ext: a submodule of a fused {self.layer_class} was replaced after fuse() (an adapter or "
                       "quantised layer?); that layer now runs Hugging Face's forward. Apply such changes before "
                       "ckpt_ext.fuse(model).")
            fallback = "a submodule was replaced"
        cos = sin = None
        if self.family in DECODERS and fallback is None:
            emb = values.get("position_embeddings")
            if emb is None:
                raise ValueError(f"fused {self.layer_class}: position_embeddings=(cos, sin) is required (its model "
                                 "passes it to every layer)")
            cos, sin = emb
        return _Call(hidden, values.get("attention_mask"), cos, sin, fallback)

    def _check_compilable(self, call: _Call):
        """What the operator path (torch.compile) refuses. Checked while Dynamo traces (_traced_forward) and
        in an eager run inside a compiled region (in_compile_fallback: torch 2.15 runs a frame eagerly after
        an exception in traced code), so that the refusal reaches the user, not the eager fused path."""
        if torch.is_grad_enabled() and \
                any(t is not None and t.requires_grad for t in (call.mask, call.cos, call.sin)):
            raise NotImplementedError(
                f"ckpt_ext: a fused {self.layer_class} under torch.compile does not differentiate its attention mask "
                "or rotary tables, and they require grad here; compile the model without ckpt_ext.fuse for this "
                "case.")

    def _as_returned(self, hidden: torch.Tensor):
        """The hidden states as the Hugging Face layer returns them: a tensor, or a 1-tuple on releases whose
        layers return tuples (transformers 5.0's GPT2Block)."""
        return (hidden,) if self._returns_tuple else hidden

    def _hf_forward(self, args, kwargs):
        hf = self._hf_layer
        hf.training = self.training
        hf._modules.update(self._modules)  # children replaced on this module since fuse()
        return hf.forward(*args, **kwargs)

    @traced_under_compile(_traced_forward)  # one C++ call; under torch.compile an operator (compiled.py)
    def forward(self, *args, **kwargs):
        if compiled.USE_OPS_EAGERLY:
            return _traced_forward(self, *args, **kwargs)
        call = self._parse(args, kwargs)
        if call.fallback is not None:
            return self._hf_forward(args, kwargs)
        if in_compile_fallback():
            self._check_compilable(call)
        if self.gradient_checkpointing and self.training and torch.is_grad_enabled() and \
                not any(t is not None and t.requires_grad for t in (call.mask, call.cos, call.sin)):
            _check_segment_not_capturing()
            spec, weights = self._call_args()
            return self._as_returned(_C.segment_apply([spec], call.hidden, call.mask, call.cos, call.sin, [weights], True))
        spec, weights = self._call_args()
        if _C.uses_dropout(spec, self.training):
            check_not_capturing(
                f"a fused {self.layer_class} with dropout in training",
                "its dropout seed is drawn from the generator on the host, so every replay of the graph would "
                "reuse one mask. Capture it with dropout off (model.eval(), or dropout probabilities 0), or "
                "run it outside the captured region.")
        return self._as_returned(_C.fused_layer_forward(spec, call.hidden, call.mask, call.cos, call.sin, weights,
                                                        self.training))


def _check_segment_not_capturing():
    check_not_capturing(
        "checkpointed fused layers (a SegmentFunction)",
        "the node draws dropout seeds on the host and keeps its output in the BoundaryPool, outside the graph's "
        "memory pool. Capture the model without ckpt_ext checkpointing (ckpt_ext.disable_checkpointing(model)), or "
        "keep the checkpointed part outside the captured region (under torch.no_grad() nothing is checkpointed).")


def run_segment(layers: Sequence[nn.Module], args: tuple, kwargs: dict, keep_attention: bool = False,
                names: Optional[Sequence[str]] = None, report: Optional[Callable[[int, Optional[str]], None]] = None,
                gemms: Optional[str] = None,
                report_gemms: Optional[Callable[[int, int, Optional[str]], None]] = None,
                pre_norm_boundary: bool = True, traced_boundary: Optional[dict] = None):
    """Runs consecutive fused layers as one C++ SegmentFunction (checkpointed: one autograd node that
    replays them in backward), calling them with the first layer's arguments as Hugging Face's stack
    does. Returns ``NotImplemented`` when the layers or the call do not allow it (not all fused layers of
    one family and mode, a call the fused path cannot serve, mask or rotary tables requiring grad); the
    caller then checkpoints the layers' ordinary forwards instead.

    ``keep_attention``: each layer's attention kernel output and log-sum-exp (on CUDA with dropout, also
    the kernel's Philox seed/offset) are kept in the BoundaryPool from forward to backward, and the replay
    runs the layers without the attention forward (bit-identical gradients). A layer whose attention runs no
    kernel with a log-sum-exp (SDPA's math path, attention dropout in training on CPU, a CUDA flash head dim
    SDPA pads) keeps nothing and is replayed in full: one warning per reason (keep.warn_not_kept, naming the
    layer by ``names[i]``), and ``report(i, reason)`` is told for every layer (reason None: kept).
    Under torch.compile the operator keeps only the segment's input: warned once (keep.compiled_level_fallback).

    ``gemms`` (the recompute levels, keep.LEVELS): "before" keeps each layer's q/k/v projection output, "all" every
    GEMM output of each layer (the last layer's last linear excepted where its replay skips it), held by the node
    from forward to backward; the replay hands them back (bit-identical gradients). ``report_gemms(i, bytes,
    reason)`` is told, per layer, the bytes kept (reason: why none, LoRA adapters). Under torch.compile the
    operator keeps only the segment's input: the caller falls back (stack.py).

    ``pre_norm_boundary`` (BERT/RoBERTa, eager): the segment keeps its last layer's pre-norm sum and row statistics
    instead of replaying its output linear and norm, and the next such segment keeps that sum instead of its input
    (csrc/layers/layer.h, PreNormBoundary; ``_C.pre_norm_boundaries()`` the process-wide switch, which this argument
    is ANDed with and never changes). False: this call keeps its input and replays in full, and takes no boundary
    from the segment before (the budget planner's groups where its plan has no boundary: stack.py).

    ``traced_boundary`` (stack.py, while Dynamo traces): the same boundary between the operators
    (``ckpt_ext::fused_segment_boundary``): its "take" entry, (output, pre-norm sum, layer) of the segment before,
    is taken when the call's hidden states are that output; the segment's own, when it keeps one, is put in its
    "give" entry."""
    first = layers[0] if layers else None
    if not isinstance(first, FusedTransformerLayer):
        return NotImplemented
    for layer in layers:
        if not isinstance(layer, FusedTransformerLayer) or layer.family != first.family or \
                layer.training != first.training:
            return NotImplemented
    call = first._parse(args, kwargs)
    if call.fallback is not None:
        return NotImplemented
    if any(t is not None and t.requires_grad for t in (call.mask, call.cos, call.sin)):
        return NotImplemented
    if gemms is not None and gemms not in _GEMM_LEVELS:
        raise ValueError(f"run_segment: gemms must be None, 'before' or 'all', got {gemms!r}")
    if compiled.use_ops():
        if keep_attention or gemms is not None:  # the operator keeps only its input
            compiled_level_fallback(level_of(bool(keep_attention), gemms))
        if traced_boundary is None or not pre_norm_boundary or not compiled.pre_norm_boundaries_enabled():
            return first._as_returned(compiled.fused_segment(layers, call.hidden, call.mask, call.cos, call.sin,
                                                             first.training))
        given = traced_boundary.get("take")
        taken = None
        if given is not None and given[0] is call.hidden and given[1].shape == call.hidden.shape and \
                given[1].dtype == call.hidden.dtype:
            taken = given[1:]
        keep = compiled.has_pre_norm_boundary(layers[-1])
        out = compiled.fused_segment(layers, call.hidden, call.mask, call.cos, call.sin, first.training,
                                     keep_boundary=keep, taken=taken)
        if keep or taken is not None:
            out, pre_norm = out
            if pre_norm is not None:
                traced_boundary["give"] = (out, pre_norm, layers[-1])
        return first._as_returned(out)
    _check_segment_not_capturing()
    specs, weights = zip(*(layer._call_args() for layer in layers))
    boundary = bool(pre_norm_boundary)
    if not keep_attention and gemms is None:
        return first._as_returned(_C.segment_apply(list(specs), call.hidden, call.mask, call.cos, call.sin,
                                                    list(weights), first.training, pre_norm_boundary=boundary))
    if gemms is not None:
        out, not_kept, gemm_bytes, gemm_why = _C.segment_apply_levels(
            list(specs), call.hidden, call.mask, call.cos, call.sin, list(weights), first.training, keep_attention,
            _GEMM_LEVELS[gemms], pre_norm_boundary=boundary)
        if report_gemms is not None:
            for i, (n, why) in enumerate(zip(gemm_bytes, gemm_why)):
                report_gemms(i, n, why or None)
        if not keep_attention:
            return first._as_returned(out)
    else:
        out, not_kept = _C.segment_apply_keeping_attention(list(specs), call.hidden, call.mask, call.cos, call.sin,
                                                            list(weights), first.training, pre_norm_boundary=boundary)
    for i, why in enumerate(not_kept):
        if report is not None:
            report(i, why or None)
        if why:
            name = names[i] if names is not None else \
                f"fused {layers[i].layer_class} (layer {i} of this checkpointed group of {len(layers)})"
            warn_not_kept(name, why)
    return first._as_returned(out)


_GEMM_LEVELS = {"before": 1, "all": 2}  # run_segment's gemms= -> _C.segment_apply_levels' gemm_level


def _copy_hooks(src: nn.Module, dst: nn.Module):
    """Module hooks of the replaced layer (e.g. Hugging Face's output-capturing hooks) move to the fused one."""
    for attr in ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
                 "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks"):
        s, d = getattr(src, attr, None), getattr(dst, attr, None)
        if s and d is not None:
            d.update(s)


def fuse(model: nn.Module) -> nn.Module:
    """Replaces every supported Hugging Face layer of ``model`` (``BertLayer``, ``RobertaLayer``,
    ``GPT2Block``, ``LlamaDecoderLayer``, ``Qwen2DecoderLayer``, ``MistralDecoderLayer``, ``Qwen3DecoderLayer``,
    ``GemmaDecoderLayer``) in place with a :class:`FusedTransformerLayer`; returns the model. Gemma 2 and 3
    layers are left to Hugging Face with a warning (docs/models.md says why).

    A layer whose configuration the fused layer cannot reproduce (another activation, cross-attention
    or ``is_decoder``, ``output_attentions`` set in the config, an attention implementation other than
    eager/sdpa, ...) is left as it is, with a warning saying why. Raises ``ValueError`` when the model
    has no supported layer, or none that can be fused. Rotary scaling variants (Llama ``rope_scaling``)
    need no support of their own: the fused layer applies the (cos, sin) tables the model computes.

    On a causal LM (``*ForCausalLM``, ``GPT2LMHeadModel``: an ``nn.Linear`` head and transformers'
    ``ForCausalLMLoss``) the head and the loss become one chunked operation in training with labels, which
    never holds the whole batch's logits; the output's ``logits`` is then None (docs/head.md).

    Apply module replacements (a quantised linear) before ``fuse``: a layer whose submodules are replaced
    afterwards runs Hugging Face's forward (with a warning). peft LoRA adapters on the attention and MLP
    projections are computed by the fused layer (read per call: added after ``fuse``, merged, disabled or
    switched adapters are followed); other adapters (DoRA, lora_bias, several active adapters, other
    modules, other tuner types) raise ``ValueError`` here, or ``RuntimeError`` at the call when added later.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"fuse expects an nn.Module, got {type(model).__name__}")
    check_versions()
    classes, left = layer_classes(), left_to_hf_classes()
    if isinstance(model, FusedTransformerLayer) or type(model) in classes:
        raise ValueError("fuse expects a model containing layers; for a single layer use FusedTransformerLayer(layer)")
    targets = [(name, m) for name, m in model.named_modules() if type(m) in classes]
    for name, m in targets:
        check_layer_adapters(m, LORA_PROJECTIONS[classes[type(m)]], f"ckpt_ext.fuse: layer {name}")
    unfused = {type(m): left[type(m)] for m in model.modules() if type(m) in left}
    for cls, why in unfused.items():
        warnings.warn(f"ckpt_ext.fuse: {cls.__name__} layers left to Hugging Face: {why}", stacklevel=2)
    if not targets:
        if any(isinstance(m, FusedTransformerLayer) for m in model.modules()):
            # fuse() applied again (a notebook cell run twice, code that fuses defensively): nothing to do.
            _warn_once(("fused again", id(model)),
                       f"ckpt_ext.fuse: the layers of this {type(model).__name__} are already fused; left as they are")
            return model
        raise ValueError(
            f"fuse found no supported layer in {type(model).__name__}"
            + "".join(f" ({cls.__name__}: {why})" for cls, why in unfused.items())
            + f": it replaces transformers' {_SUPPORTED}")
    install_output_capturing(model, FusedTransformerLayer)
    fused = 0
    for name, layer in targets:
        try:
            new = FusedTransformerLayer(layer)
        except ValueError as e:
            warnings.warn(f"ckpt_ext.fuse: {name} left unfused: {e}", stacklevel=2)
            continue
        _copy_hooks(layer, new)
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        parent._modules[attr] = new
        fused += 1
    if fused == 0:
        raise ValueError(f"fuse: none of the {len(targets)} supported layer(s) of {type(model).__name__} could be "
                         "fused (see the warnings)")
    # A causal LM's head and loss: one chunked operation in training with labels (ckpt_ext/hf/head.py).
    fuse_lm_head(model, warn=type(model).__name__.endswith(("ForCausalLM", "LMHeadModel")))
    # transformers' hooks installed above (closures) as picklable objects: the model still pickles.
    picklable_capturing_hooks(list(model.modules()) + [m._hf_layer for m in model.modules()
                                                       if isinstance(m, FusedTransformerLayer)])
    return model
