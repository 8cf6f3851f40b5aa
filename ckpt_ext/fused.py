"""Fused transformer layers for Hugging Face models: ``ckpt_ext.fuse(model)``.

``fuse`` replaces every ``BertLayer``, ``RobertaLayer``, ``GPT2Block`` and ``LlamaDecoderLayer`` of a model
with a :class:`FusedTransformerLayer` whose forward is one call into C++ (csrc/layers/): ATen matmuls,
``scaled_dot_product_attention`` and the fused ckpt_ext ops, differentiated by C++ autograd. The fused
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

from ._compiler import check_not_capturing, eager_under_compile
from ._extension import load
from ._user_frame import user_stacklevel
from .hf.peft import base_of, check_layer_adapters, is_adapter_layer, lora_terms, peft_relink

_C = load()

__all__ = ["FusedTransformerLayer", "fuse", "run_segment"]

# The layer layout has one home, C++ (csrc/layers/{bert,gpt2,llama}.cpp): family ids and weight slots.
_FAMILIES: Dict[str, Tuple[int, List[str]]] = dict(_C.layer_families())
BERT, GPT2, LLAMA = (_FAMILIES[name][0] for name in ("bert", "gpt2", "llama"))
_FAMILY_NAMES = {family_id: name for name, (family_id, _) in _FAMILIES.items()}

# Where each C++ weight slot lives in the Hugging Face layer (parameter paths), written in C++'s slot
# order; _slot_paths checks names and order against C++'s list.
_HF_PARAMETERS: Dict[str, Dict[str, str]] = {
    "bert": {
        "q_weight": "attention.self.query.weight", "q_bias": "attention.self.query.bias",
        "k_weight": "attention.self.key.weight", "k_bias": "attention.self.key.bias",
        "v_weight": "attention.self.value.weight", "v_bias": "attention.self.value.bias",
        "attn_out_weight": "attention.output.dense.weight", "attn_out_bias": "attention.output.dense.bias",
        "ln1_weight": "attention.output.LayerNorm.weight", "ln1_bias": "attention.output.LayerNorm.bias",
        "inter_weight": "intermediate.dense.weight", "inter_bias": "intermediate.dense.bias",
        "out_weight": "output.dense.weight", "out_bias": "output.dense.bias",
        "ln2_weight": "output.LayerNorm.weight", "ln2_bias": "output.LayerNorm.bias",
    },
    "gpt2": {
        "ln1_weight": "ln_1.weight", "ln1_bias": "ln_1.bias",
        "attn_weight": "attn.c_attn.weight", "attn_bias": "attn.c_attn.bias",
        "attn_proj_weight": "attn.c_proj.weight", "attn_proj_bias": "attn.c_proj.bias",
        "ln2_weight": "ln_2.weight", "ln2_bias": "ln_2.bias",
        "fc_weight": "mlp.c_fc.weight", "fc_bias": "mlp.c_fc.bias",
        "mlp_proj_weight": "mlp.c_proj.weight", "mlp_proj_bias": "mlp.c_proj.bias",
    },
    "llama": {
        "ln1_weight": "input_layernorm.weight",
        "q_weight": "self_attn.q_proj.weight", "q_bias": "self_attn.q_proj.bias",
        "k_weight": "self_attn.k_proj.weight", "k_bias": "self_attn.k_proj.bias",
        "v_weight": "self_attn.v_proj.weight", "v_bias": "self_attn.v_proj.bias",
        "o_weight": "self_attn.o_proj.weight", "o_bias": "self_attn.o_proj.bias",
        "ln2_weight": "post_attention_layernorm.weight",
        "gate_weight": "mlp.gate_proj.weight", "gate_bias": "mlp.gate_proj.bias",
        "up_weight": "mlp.up_proj.weight", "up_bias": "mlp.up_proj.bias",
        "down_weight": "mlp.down_proj.weight", "down_bias": "mlp.down_proj.bias",
    },
}


def _slot_paths(families: Dict[str, Tuple[int, List[str]]],
                hf_parameters: Dict[str, Dict[str, str]]) -> Dict[int, List[str]]:
    """{family id: Hugging Face parameter path of each C++ weight slot, in slot order}. Raises when the
    Python mapping does not name exactly C++'s slots in C++'s order (a missing, extra or swapped slot)."""
    paths = {}
    for name, (family_id, slots) in families.items():
        mapped = list(hf_parameters.get(name, {}))
        if mapped != list(slots):
            raise RuntimeError(f"ckpt_ext: the Hugging Face parameter map of the fused {name} layer names the slots "
                               f"{mapped}, but C++ (csrc/layers/{name}.cpp) defines {list(slots)}; they must agree "
                               "in names and order")
        paths[family_id] = [hf_parameters[name][slot] for slot in slots]
    return paths


_WEIGHTS = _slot_paths(_FAMILIES, _HF_PARAMETERS)
# LoRA: the module path (in the Hugging Face layer) of each projection that may carry an adapter, in C++'s
# adapter order (_C.layer_adapters(): adapter j's A, B follow the weight slots).
_LORA_PROJECTIONS: Dict[int, List[str]] = {
    fid: [_WEIGHTS[fid][slots.index(w)].rpartition(".")[0] for w in dict(_C.layer_adapters())[name]]
    for name, (fid, slots) in _FAMILIES.items()}

# Positional parameters of the Hugging Face layers' forward (transformers 5.x), after self.
_POSITIONAL = {
    BERT: ("hidden_states", "attention_mask", "encoder_hidden_states", "encoder_attention_mask", "past_key_values"),
    GPT2: ("hidden_states", "past_key_values", "attention_mask", "encoder_hidden_states", "encoder_attention_mask",
           "use_cache"),
    LLAMA: ("hidden_states", "attention_mask", "position_ids", "past_key_values", "use_cache", "position_embeddings"),
}

_GELU_EXACT = {"GELUActivation"}
_GELU_TANH = {"NewGELUActivation", "GELUTanh", "PytorchGELUTanh", "FastGELUActivation"}
_SILU = {"SiLU", "SiLUActivation"}
_ATTN_IMPLEMENTATIONS = (None, "eager", "sdpa")

_warned: set = set()


def _warn_once(key, message: str):
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, stacklevel=user_stacklevel())


# --------------------------------------------------------------------------------------------------
# Recognising the Hugging Face layers and reading their configuration
# --------------------------------------------------------------------------------------------------
def _layer_classes() -> Dict[type, int]:
    classes = {}
    try:
        from transformers.models.bert.modeling_bert import BertLayer
        classes[BertLayer] = BERT
    except ImportError:
        pass
    try:
        from transformers.models.roberta.modeling_roberta import RobertaLayer
        classes[RobertaLayer] = BERT
    except ImportError:
        pass
    try:
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block
        classes[GPT2Block] = GPT2
    except ImportError:
        pass
    try:
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer
        classes[LlamaDecoderLayer] = LLAMA
    except ImportError:
        pass
    return classes


class _Unsupported(Exception):
    """A layer whose configuration the fused layer cannot reproduce (the message says why)."""


def _attn_impl(config) -> Optional[str]:
    return getattr(config, "_attn_implementation", None)


def _check_common(layer: nn.Module, config):
    impl = _attn_impl(config)
    if impl not in _ATTN_IMPLEMENTATIONS:
        raise _Unsupported(f"attention implementation {impl!r} passes masks the fused layer does not read "
                           "(supported: 'eager', 'sdpa')")
    if config is not None and getattr(config, "output_attentions", False):
        raise _Unsupported("config.output_attentions=True: the fused layer computes no attention weights")
    if any(p.is_meta for p in layer.parameters()):
        raise _Unsupported("its parameters are on the meta device")
    if layer._parameters or layer._buffers:
        raise _Unsupported("it has parameters or buffers of its own the fused layer would not use")


def _same(values: Sequence[float], what: str) -> float:
    if len(set(values)) != 1:
        raise _Unsupported(f"its {what} differ ({', '.join(map(str, values))}); the fused layer uses one value")
    return float(values[0])


def _gelu_tanh(act: nn.Module, where: str) -> bool:
    name = type(act).__name__
    if name in _GELU_EXACT:
        return False
    if name in _GELU_TANH:
        return True
    raise _Unsupported(f"activation {name} in {where} (supported: exact and tanh GELU)")


def _layer_norm_eps(ln: nn.Module, where: str) -> float:
    if not isinstance(ln, nn.LayerNorm) or not ln.elementwise_affine or ln.weight is None:
        raise _Unsupported(f"{where} is not an affine nn.LayerNorm")
    if tuple(ln.normalized_shape) != (ln.weight.shape[0],):
        raise _Unsupported(f"{where} normalises more than the last dimension")
    return ln.eps


def _bert_spec(layer) -> "_C.LayerSpec":
    config = getattr(layer.attention.self, "config", None)
    _check_common(layer, config)
    if getattr(layer, "is_decoder", False) or getattr(layer, "add_cross_attention", False):
        raise _Unsupported("is_decoder/cross-attention (causal self-attention with a KV cache, cross-attention) "
                           "is not implemented by the fused BERT layer")
    if getattr(layer.attention, "is_cross_attention", False):
        raise _Unsupported("its attention is cross-attention")
    sa = layer.attention.self
    for name in ("query", "key", "value"):
        lin = base_of(getattr(sa, name))  # through a peft LoRA layer
        if not isinstance(lin, nn.Linear) or lin.bias is None:
            raise _Unsupported(f"attention.self.{name} is not an nn.Linear with bias")
    hidden = sa.query.in_features
    heads, head_dim = sa.num_attention_heads, sa.attention_head_size
    if heads * head_dim != hidden or sa.query.out_features != hidden:
        raise _Unsupported(f"all_head_size {heads * head_dim} differs from hidden size {hidden}")
    eps = _same([_layer_norm_eps(layer.attention.output.LayerNorm, "attention.output.LayerNorm"),
                 _layer_norm_eps(layer.output.LayerNorm, "output.LayerNorm")], "LayerNorm epsilons")
    hidden_p = _same([layer.attention.output.dropout.p, layer.output.dropout.p], "hidden dropout probabilities")
    gelu_tanh = _gelu_tanh(layer.intermediate.intermediate_act_fn, "intermediate")
    return _C.LayerSpec(family=BERT, hidden=hidden, num_heads=heads, num_kv_heads=heads, head_dim=head_dim,
                        scaling=float(sa.scaling), attn_p=float(sa.dropout.p), hidden_p=hidden_p, eps=eps,
                        gelu_tanh=gelu_tanh)


def _gpt2_spec(layer) -> "_C.LayerSpec":
    attn = layer.attn
    config = getattr(attn, "config", None)
    _check_common(layer, config)
    if hasattr(layer, "crossattention") or getattr(attn, "is_cross_attention", False):
        raise _Unsupported("cross-attention (add_cross_attention=True) is not implemented by the fused GPT-2 layer")
    if getattr(attn, "reorder_and_upcast_attn", False) and _attn_impl(config) == "eager":
        raise _Unsupported("reorder_and_upcast_attn=True (float32 attention scores) is not implemented")
    hidden, heads, head_dim = attn.embed_dim, attn.num_heads, attn.head_dim
    eps = _same([_layer_norm_eps(layer.ln_1, "ln_1"), _layer_norm_eps(layer.ln_2, "ln_2")], "LayerNorm epsilons")
    resid_p = _same([attn.resid_dropout.p, layer.mlp.dropout.p], "residual dropout probabilities")
    gelu_tanh = _gelu_tanh(layer.mlp.act, "mlp")
    return _C.LayerSpec(family=GPT2, hidden=hidden, num_heads=heads, num_kv_heads=heads, head_dim=head_dim,
                        scaling=float(attn.scaling), attn_p=float(attn.attn_dropout.p), hidden_p=resid_p, eps=eps,
                        gelu_tanh=gelu_tanh)


def _llama_spec(layer) -> "_C.LayerSpec":
    attn, mlp = layer.self_attn, layer.mlp
    config = getattr(attn, "config", None)
    _check_common(layer, config)
    if type(mlp.act_fn).__name__ not in _SILU:
        raise _Unsupported(f"activation {type(mlp.act_fn).__name__} (the fused Llama MLP is SwiGLU: silu)")
    biases = [getattr(attn, n).bias is not None for n in ("q_proj", "k_proj", "v_proj")]
    if len(set(biases)) != 1:
        raise _Unsupported("q/k/v projections with and without bias mixed")
    head_dim = attn.head_dim
    heads = attn.q_proj.out_features // head_dim
    kv_heads = attn.k_proj.out_features // head_dim
    if heads * head_dim != attn.q_proj.out_features or kv_heads * head_dim != attn.k_proj.out_features:
        raise _Unsupported("projection sizes are not multiples of head_dim")
    eps = _same([layer.input_layernorm.variance_epsilon, layer.post_attention_layernorm.variance_epsilon],
                "RMSNorm epsilons")
    return _C.LayerSpec(family=LLAMA, hidden=attn.q_proj.in_features, num_heads=heads, num_kv_heads=kv_heads,
                        head_dim=head_dim, scaling=float(attn.scaling), attn_p=float(attn.attention_dropout),
                        hidden_p=0.0, eps=float(eps), gelu_tanh=False)


_SPEC_BUILDERS: Dict[int, Callable[[nn.Module], Any]] = {BERT: _bert_spec, GPT2: _gpt2_spec, LLAMA: _llama_spec}


# --------------------------------------------------------------------------------------------------
# The fused layer
# --------------------------------------------------------------------------------------------------
_collector = []  # transformers' output-capturing context variable, looked up once


def _collecting_attentions() -> bool:
    """True while a Hugging Face model collects attention weights through its output-capturing hooks."""
    if not _collector:
        try:
            from transformers.utils.output_capturing import _active_collector
        except ImportError:
            _active_collector = None
        _collector.append(_active_collector)
    if _collector[0] is None:
        return False
    collected = _collector[0].get()
    return bool(collected) and any("attentions" in k for k in collected)


class _Call:
    """One layer call, parsed: what the fused forward reads, plus why it cannot serve the call (if so)."""

    __slots__ = ("hidden", "mask", "cos", "sin", "fallback")

    def __init__(self, hidden, mask, cos, sin, fallback):
        self.hidden, self.mask, self.cos, self.sin, self.fallback = hidden, mask, cos, sin, fallback


class FusedTransformerLayer(nn.Module):
    """A Hugging Face BERT/RoBERTa, GPT-2 or Llama layer whose forward runs in C++.

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
            raise TypeError(f"FusedTransformerLayer expects a Hugging Face layer module (BertLayer, RobertaLayer, "
                            f"GPT2Block, LlamaDecoderLayer), got {type(layer).__name__}")
        family = _layer_classes().get(type(layer))
        if family is None:
            raise ValueError(f"FusedTransformerLayer: {type(layer).__name__} is not a supported layer "
                             "(BertLayer, RobertaLayer, GPT2Block, LlamaDecoderLayer)")
        try:
            spec = _SPEC_BUILDERS[family](layer)
        except _Unsupported as e:
            raise ValueError(f"FusedTransformerLayer: this {type(layer).__name__} cannot be fused: {e}") from None
        for name, child in layer.named_children():
            self.add_module(name, child)
        self.train(layer.training)
        self.family = family
        self.spec = spec
        self.layer_class = type(layer).__name__
        check_layer_adapters(self, _LORA_PROJECTIONS[family], f"FusedTransformerLayer({self.layer_class})")
        self._lora_specs: Dict[tuple, Any] = {}
        self._resolve()
        self._positional = _POSITIONAL[family]
        # Hugging Face's own forward for the calls the fused path cannot serve. Not registered as a
        # submodule: it shares this module's children, and its parameters are already ours.
        object.__setattr__(self, "_hf_layer", layer)

    def _resolve(self):
        """Finds the weight-holding modules (through peft LoRA layers, to their base layers) and the
        projections that may carry adapters."""
        self._weight_slots = [self._slot(path) for path in _WEIGHTS[self.family]]
        self._projections = [self.get_submodule(path) for path in _LORA_PROJECTIONS[self.family]]
        self._has_lora = any(is_adapter_layer(m) for m in self._projections)
        # Every (parent, name, child) link on the way to the weight-holding modules: if one of them is
        # replaced after fuse() (an adapter, a quantised linear), the fused forward would silently use
        # the old weights, so such calls are re-resolved (peft LoRA) or run Hugging Face's forward.
        links = {}
        for path in _WEIGHTS[self.family]:
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
            for path, w in zip(_WEIGHTS[self.family], weights):
                if isinstance(w, dtensor.DTensor):
                    raise RuntimeError(
                        f"fused {self.layer_class}: weight {path} is a DTensor (a sharded parameter). The fused "
                        "layer computes with whole tensors: shard the fused layer as one FSDP unit "
                        "(fully_shard(layer) or fully_shard(model)), not its submodules, and call it through its "
                        "module call so FSDP gathers its parameters first. Tensor-parallel layers cannot be fused.")
        return weights

    def _call_args(self) -> Tuple[Any, List[Optional[torch.Tensor]]]:
        """(spec, weights) of this call: the parameters, then each projection's LoRA A and B (None where
        no adapter term is added), read from the peft layers per call as peft's forward would."""
        weights = self.fused_weights()
        if not self._has_lora:
            return self.spec, weights
        terms = [lora_terms(m, f"fused {self.layer_class}, {path}")
                 for path, m in zip(_LORA_PROJECTIONS[self.family], self._projections)]
        if all(t is None for t in terms):
            return self.spec, weights
        for t in terms:
            weights += [None, None] if t is None else [t[0], t[1]]
        key = tuple((t[2], t[3]) if t is not None else (0.0, 0.0) for t in terms)
        spec = self._lora_specs.get(key)
        if spec is None:
            spec = self._lora_specs[key] = self.spec.with_lora([k[0] for k in key], [k[1] for k in key])
        return spec, weights

    def extra_repr(self) -> str:
        return f"{self.layer_class} -> C++ {_FAMILY_NAMES[self.family]}: {self.spec!r}"

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
        cache = values.get("past_key_values")
        if cache is None:
            cache = kwargs.get("layer_past")
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
        if kwargs.get("output_attentions") or _collecting_attentions():
            fallback = "attention weights were requested"
        changed = [(parent._modules.get(name), child) for parent, name, child in self._links
                   if parent._modules.get(name) is not child]
        if changed and all(peft_relink(old, new) for new, old in changed):
            # peft wrapped (or unwrapped) a projection after fuse(): same Parameters, adapter read per call.
            check_layer_adapters(self, _LORA_PROJECTIONS[self.family],
                                 f"fused {self.layer_class}: adapters added after ckpt_ext.fuse()", RuntimeError)
            self._resolve()
            changed = []
        if changed:
            check_layer_adapters(self, _LORA_PROJECTIONS[self.family],
                                 f"fused {self.layer_class}: adapters added after ckpt_ext.fuse()", RuntimeError)
            _warn_once(("replaced", id(self)),
                       f"ckpt_ext: a submodule of a fused {self.layer_class} was replaced after fuse() (an adapter or "
                       "quantised layer?); that layer now runs Hugging Face's forward. Apply such changes before "
                       "ckpt_ext.fuse(model).")
            fallback = "a submodule was replaced"
        cos = sin = None
        if self.family == LLAMA and fallback is None:
            emb = values.get("position_embeddings")
            if emb is None:
                raise ValueError(f"fused {self.layer_class}: position_embeddings=(cos, sin) is required (LlamaModel "
                                 "passes it to every layer)")
            cos, sin = emb
        return _Call(hidden, values.get("attention_mask"), cos, sin, fallback)

    def _hf_forward(self, args, kwargs):
        hf = self._hf_layer
        hf.training = self.training
        hf._modules.update(self._modules)  # children replaced on this module since fuse()
        return hf.forward(*args, **kwargs)

    @eager_under_compile  # one C++ call: torch.compile graph-breaks around the layer
    def forward(self, *args, **kwargs):
        call = self._parse(args, kwargs)
        if call.fallback is not None:
            return self._hf_forward(args, kwargs)
        if self.gradient_checkpointing and self.training and torch.is_grad_enabled() and \
                not any(t is not None and t.requires_grad for t in (call.mask, call.cos, call.sin)):
            _check_segment_not_capturing()
            spec, weights = self._call_args()
            return _C.segment_apply([spec], call.hidden, call.mask, call.cos, call.sin, [weights], True)
        spec, weights = self._call_args()
        if _C.uses_dropout(spec, self.training):
            check_not_capturing(
                f"a fused {self.layer_class} with dropout in training",
                "its dropout seed is drawn from the generator on the host, so every replay of the graph would "
                "reuse one mask. Capture it with dropout off (model.eval(), or dropout probabilities 0), or "
                "run it outside the captured region.")
        return _C.fused_layer_forward(spec, call.hidden, call.mask, call.cos, call.sin, weights, self.training)


def _check_segment_not_capturing():
    check_not_capturing(
        "checkpointed fused layers (a SegmentFunction)",
        "the node draws dropout seeds on the host and keeps its output in the BoundaryPool, outside the graph's "
        "memory pool. Capture the model without ckpt_ext checkpointing (ckpt_ext.disable_checkpointing(model)), or "
        "keep the checkpointed part outside the captured region (under torch.no_grad() nothing is checkpointed).")


def run_segment(layers: Sequence[nn.Module], args: tuple, kwargs: dict):
    """Runs consecutive fused layers as one C++ SegmentFunction (checkpointed: one autograd node that
    replays them in backward), calling them with the first layer's arguments as Hugging Face's stack
    does. Returns ``NotImplemented`` when the layers or the call do not allow it (not all fused layers of
    one family and mode, a call the fused path cannot serve, mask or rotary tables requiring grad); the
    caller then checkpoints the layers' ordinary forwards instead."""
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
    _check_segment_not_capturing()
    specs, weights = zip(*(layer._call_args() for layer in layers))
    return _C.segment_apply(list(specs), call.hidden, call.mask, call.cos, call.sin, list(weights), first.training)


def _copy_hooks(src: nn.Module, dst: nn.Module):
    """Module hooks of the replaced layer (e.g. Hugging Face's output-capturing hooks) move to the fused one."""
    for attr in ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
                 "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks"):
        s, d = getattr(src, attr, None), getattr(dst, attr, None)
        if s and d is not None:
            d.update(s)


def _install_output_capturing(model: nn.Module):
    """Hugging Face installs its output-capturing hooks (output_hidden_states) lazily, matching layers by
    class; installed before the swap, they are copied onto the fused layers."""
    try:
        from transformers.modeling_utils import PreTrainedModel
        from transformers.utils.output_capturing import maybe_install_capturing_hooks
    except ImportError:
        return
    for m in model.modules():
        if isinstance(m, PreTrainedModel):
            maybe_install_capturing_hooks(m)
            return  # the outermost model installs for its submodels


def fuse(model: nn.Module) -> nn.Module:
    """Replaces every supported Hugging Face layer of ``model`` (``BertLayer``, ``RobertaLayer``,
    ``GPT2Block``, ``LlamaDecoderLayer``) in place with a :class:`FusedTransformerLayer`; returns the model.

    A layer whose configuration the fused layer cannot reproduce (another activation, cross-attention
    or ``is_decoder``, ``output_attentions`` set in the config, an attention implementation other than
    eager/sdpa, ...) is left as it is, with a warning saying why. Raises ``ValueError`` when the model
    has no supported layer, or none that can be fused. Rotary scaling variants (Llama ``rope_scaling``)
    need no support of their own: the fused layer applies the (cos, sin) tables the model computes.

    Apply module replacements (a quantised linear) before ``fuse``: a layer whose submodules are replaced
    afterwards runs Hugging Face's forward (with a warning). peft LoRA adapters on the attention and MLP
    projections are computed by the fused layer (read per call: added after ``fuse``, merged, disabled or
    switched adapters are followed); other adapters (DoRA, lora_bias, several active adapters, other
    modules, other tuner types) raise ``ValueError`` here, or ``RuntimeError`` at the call when added later.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"fuse expects an nn.Module, got {type(model).__name__}")
    classes = _layer_classes()
    if isinstance(model, FusedTransformerLayer) or type(model) in classes:
        raise ValueError("fuse expects a model containing layers; for a single layer use FusedTransformerLayer(layer)")
    targets = [(name, m) for name, m in model.named_modules() if type(m) in classes]
    for name, m in targets:
        check_layer_adapters(m, _LORA_PROJECTIONS[classes[type(m)]], f"ckpt_ext.fuse: layer {name}")
    if not targets:
        already = any(isinstance(m, FusedTransformerLayer) for m in model.modules())
        raise ValueError(
            f"fuse found no supported layer in {type(model).__name__}"
            + (" (its layers are already fused)" if already else "")
            + ": it replaces transformers' BertLayer, RobertaLayer, GPT2Block and LlamaDecoderLayer")
    _install_output_capturing(model)
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
    return model
