"""Hugging Face's transformer layers as the fused layers read them: which transformers classes are fused
into which C++ family, where each C++ weight slot lives in them (parameter paths), their forward's
positional arguments, how their modules and configs translate into a ``_C.LayerSpec`` (or why they
cannot), and transformers' output-capturing hooks. transformers is imported lazily, when a model is
fused."""
import inspect
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from torch import nn

from .._extension import load
from .._layout import BERT, DECODERS, FAMILIES, GEMMA, GEMMA2, GEMMA3, GPT2, LLAMA, QWEN3
from .peft import base_of

_C = load()

def _slots(*modules: Tuple[str, ...]) -> Dict[str, str]:
    """{slot: parameter path} from (slot prefix, module path[, parameter, ...]) entries: a module's slots are
    <prefix>_weight and <prefix>_bias unless its parameters are named (an RMSNorm has a weight only)."""
    return {f"{prefix}_{p}": f"{path}.{p}" for prefix, path, *params in modules for p in params or ("weight", "bias")}


# The rotary decoders' shared slots (Llama, Qwen2, Mistral, Qwen3, Gemma name them alike).
_DECODER = (("ln1", "input_layernorm", "weight"), ("q", "self_attn.q_proj"), ("k", "self_attn.k_proj"),
            ("v", "self_attn.v_proj"), ("o", "self_attn.o_proj"), ("ln2", "post_attention_layernorm", "weight"),
            ("gate", "mlp.gate_proj"), ("up", "mlp.up_proj"), ("down", "mlp.down_proj"))

# Where each C++ weight slot lives in the Hugging Face layer (parameter paths), written in C++'s slot
# order; slot_paths checks names and order against C++'s list.
HF_PARAMETERS: Dict[str, Dict[str, str]] = {
    "bert": _slots(("q", "attention.self.query"), ("k", "attention.self.key"), ("v", "attention.self.value"),
                   ("attn_out", "attention.output.dense"), ("ln1", "attention.output.LayerNorm"),
                   ("inter", "intermediate.dense"), ("out", "output.dense"), ("ln2", "output.LayerNorm")),
    "gpt2": _slots(("ln1", "ln_1"), ("attn", "attn.c_attn"), ("attn_proj", "attn.c_proj"), ("ln2", "ln_2"),
                   ("fc", "mlp.c_fc"), ("mlp_proj", "mlp.c_proj")),
    "llama": _slots(*_DECODER),
    "qwen3": _slots(*_DECODER, ("q_norm", "self_attn.q_norm", "weight"), ("k_norm", "self_attn.k_norm", "weight")),
    "gemma": _slots(*_DECODER),
    # Gemma 3: post_attention_layernorm (slot ln2) normalises the attention output; the MLP's input norm is
    # pre_feedforward_layernorm and its output's post_feedforward_layernorm (llama.cpp's Decoder::sandwich).
    "gemma3": _slots(*_DECODER, ("q_norm", "self_attn.q_norm", "weight"), ("k_norm", "self_attn.k_norm", "weight"),
                     ("pre_ff_norm", "pre_feedforward_layernorm", "weight"),
                     ("post_ff_norm", "post_feedforward_layernorm", "weight")),
    # Gemma 2: Gemma 3's layer without the q/k norms.
    "gemma2": _slots(*_DECODER, ("pre_ff_norm", "pre_feedforward_layernorm", "weight"),
                     ("post_ff_norm", "post_feedforward_layernorm", "weight")),
}


def slot_paths(families: Dict[str, Tuple[int, List[str]]],
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


WEIGHT_PATHS = slot_paths(FAMILIES, HF_PARAMETERS)
# LoRA: the module path (in the Hugging Face layer) of each projection that may carry an adapter, in C++'s
# adapter order (_C.layer_adapters(): adapter j's A, B follow the weight slots).
LORA_PROJECTIONS: Dict[int, List[str]] = {
    fid: [WEIGHT_PATHS[fid][slots.index(w)].rpartition(".")[0] for w in dict(_C.layer_adapters())[name]]
    for name, (fid, slots) in FAMILIES.items()}

def positional_parameters(cls: type) -> Tuple[str, ...]:
    """The names of the positional parameters of a Hugging Face layer's forward, after self, read from the
    class (they differ between releases: GPT-2's second is ``layer_past``, ``past_key_values`` or ``cache``)."""
    import inspect
    params = list(inspect.signature(inspect.unwrap(cls.forward)).parameters.values())[1:]
    return tuple(p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))


_RETURNS_TUPLE: Dict[type, bool] = {}


def returns_tuple(layer: nn.Module, family: int) -> bool:
    """Whether the Hugging Face layer's forward returns a tuple (hidden states first) rather than the hidden
    states (transformers 5.0's GPT2Block returns a tuple; its BertLayer, annotated as returning one, returns
    a tensor). Asked of the layer itself: one forward of a 1 x 2 input without grad, once per class."""
    cls = type(layer)
    if cls not in _RETURNS_TUPLE:
        import torch
        p = next(layer.parameters())
        hidden = {BERT: lambda: base_of(layer.attention.self.query).in_features, GPT2: lambda: layer.attn.embed_dim,
                  }.get(family, lambda: base_of(layer.self_attn.q_proj).in_features)()
        x = torch.zeros(1, 2, hidden, device=p.device, dtype=p.dtype)
        kwargs = {}
        if family in DECODERS:
            rot = torch.zeros(1, 2, layer.self_attn.head_dim, device=p.device, dtype=p.dtype)
            kwargs["position_embeddings"] = (rot + 1, rot)
        was_training = layer.training
        layer.eval()
        try:
            with torch.no_grad():
                out = cls.forward(layer, x, **kwargs)
        finally:
            layer.train(was_training)
        _RETURNS_TUPLE[cls] = isinstance(out, tuple)
    return _RETURNS_TUPLE[cls]


_GELU_EXACT = {"GELUActivation"}
_GELU_TANH = {"NewGELUActivation", "GELUTanh", "PytorchGELUTanh", "FastGELUActivation"}
_SILU = {"SiLU", "SiLUActivation"}
_ATTN_IMPLEMENTATIONS = (None, "eager", "sdpa")


# (transformers module, layer class, family). Qwen2 (biases on q, k, v) and Mistral (a sliding window: the
# mask its model passes each layer) are Llama layers to the fused code.
_FUSED_CLASSES = (
    ("bert", "BertLayer", BERT), ("roberta", "RobertaLayer", BERT), ("gpt2", "GPT2Block", GPT2),
    ("llama", "LlamaDecoderLayer", LLAMA), ("qwen2", "Qwen2DecoderLayer", LLAMA),
    ("mistral", "MistralDecoderLayer", LLAMA), ("qwen3", "Qwen3DecoderLayer", QWEN3),
    ("gemma", "GemmaDecoderLayer", GEMMA), ("gemma3", "Gemma3DecoderLayer", GEMMA3),
    ("gemma2", "Gemma2DecoderLayer", GEMMA2),
)
# Layers fuse() knows and leaves to Hugging Face, with why (fuse warns; docs/models.md).
_HF_CLASSES: Tuple[Tuple[str, str, str], ...] = ()


def _loaded_classes(table) -> Dict[type, Any]:
    """{class: value} of the (module, class name, value) entries whose transformers module is imported: a model
    holding such a layer has imported its class's module, and nothing else needs importing here (a BERT user
    does not import Gemma 3's modeling code). Read per call: cheap, and follows modules imported later."""
    classes = {}
    for module, name, value in table:
        mod = sys.modules.get(f"transformers.models.{module}.modeling_{module}")
        cls = getattr(mod, name, None) if mod is not None else None  # absent from this release: skipped
        if cls is not None:
            classes[cls] = value
    return classes


def layer_classes() -> Dict[type, int]:
    """{transformers layer class: fused family} of the classes fuse() replaces (those imported)."""
    return _loaded_classes(_FUSED_CLASSES)


def left_to_hf_classes() -> Dict[type, str]:
    """{transformers layer class: why it is not fused} of the layers fuse() knows and leaves to Hugging Face."""
    return _loaded_classes(_HF_CLASSES)


class Unsupported(Exception):
    """A layer whose configuration the fused layer cannot reproduce (the message says why)."""


def _attn_impl(config) -> Optional[str]:
    return getattr(config, "_attn_implementation", None)


def attention_implementation(model: nn.Module, layers: Sequence[nn.Module]) -> Optional[str]:
    """The Hugging Face attention implementation (config ``_attn_implementation``: "eager", "sdpa",
    "flash_attention_2", ...) the layers' attention modules run, else the model's; None for a model that
    is not Hugging Face's (no config says), or whose class has no SDPA path to choose (``_supports_sdpa``
    unset: its config says "eager" whatever its layers call)."""
    if not any(getattr(type(m), "_supports_sdpa", False) for m in model.modules()):
        return None
    for layer in layers:
        for m in layer.modules():
            impl = _attn_impl(getattr(m, "config", None))
            if impl is not None:
                return impl
    return _attn_impl(getattr(model, "config", None))


def _check_common(layer: nn.Module, config):
    impl = _attn_impl(config)
    if impl not in _ATTN_IMPLEMENTATIONS:
        raise Unsupported(f"attention implementation {impl!r} passes masks the fused layer does not read "
                           "(supported: 'eager', 'sdpa')")
    if config is not None and getattr(config, "output_attentions", False):
        raise Unsupported("config.output_attentions=True: the fused layer computes no attention weights")
    if any(p.is_meta for p in layer.parameters()):
        raise Unsupported("its parameters are on the meta device")
    if layer._parameters or layer._buffers:
        raise Unsupported("it has parameters or buffers of its own the fused layer would not use")


def _same(values: Sequence[float], what: str) -> float:
    if len(set(values)) != 1:
        raise Unsupported(f"its {what} differ ({', '.join(map(str, values))}); the fused layer uses one value")
    return float(values[0])


def _gelu_tanh(act: nn.Module, where: str) -> bool:
    name = type(act).__name__
    if name in _GELU_EXACT:
        return False
    if name in _GELU_TANH:
        return True
    raise Unsupported(f"activation {name} in {where} (supported: exact and tanh GELU)")


def _layer_norm_eps(ln: nn.Module, where: str) -> float:
    if not isinstance(ln, nn.LayerNorm) or not ln.elementwise_affine or ln.weight is None:
        raise Unsupported(f"{where} is not an affine nn.LayerNorm")
    if tuple(ln.normalized_shape) != (ln.weight.shape[0],):
        raise Unsupported(f"{where} normalises more than the last dimension")
    return ln.eps


def _bert_spec(layer) -> "_C.LayerSpec":
    config = getattr(layer.attention.self, "config", None)
    _check_common(layer, config)
    if getattr(layer, "is_decoder", False) or getattr(layer, "add_cross_attention", False):
        raise Unsupported("is_decoder/cross-attention (causal self-attention with a KV cache, cross-attention) "
                           "is not implemented by the fused BERT layer")
    if getattr(layer.attention, "is_cross_attention", False):
        raise Unsupported("its attention is cross-attention")
    sa = layer.attention.self
    for name in ("query", "key", "value"):
        lin = base_of(getattr(sa, name))  # through a peft LoRA layer
        if not isinstance(lin, nn.Linear) or lin.bias is None:
            raise Unsupported(f"attention.self.{name} is not an nn.Linear with bias")
    hidden = sa.query.in_features
    heads, head_dim = sa.num_attention_heads, sa.attention_head_size
    if heads * head_dim != hidden or sa.query.out_features != hidden:
        raise Unsupported(f"all_head_size {heads * head_dim} differs from hidden size {hidden}")
    eps = _same([_layer_norm_eps(layer.attention.output.LayerNorm, "attention.output.LayerNorm"),
                 _layer_norm_eps(layer.output.LayerNorm, "output.LayerNorm")], "LayerNorm epsilons")
    hidden_p = _same([layer.attention.output.dropout.p, layer.output.dropout.p], "hidden dropout probabilities")
    gelu_tanh = _gelu_tanh(layer.intermediate.intermediate_act_fn, "intermediate")
    return _C.LayerSpec(family=BERT, hidden=hidden, num_heads=heads, num_kv_heads=heads, head_dim=head_dim,
                        scaling=float(getattr(sa, "scaling", head_dim ** -0.5)), attn_p=float(sa.dropout.p), hidden_p=hidden_p, eps=eps,
                        gelu_tanh=gelu_tanh)


def _gpt2_spec(layer) -> "_C.LayerSpec":
    attn = layer.attn
    config = getattr(attn, "config", None)
    _check_common(layer, config)
    if hasattr(layer, "crossattention") or getattr(attn, "is_cross_attention", False):
        raise Unsupported("cross-attention (add_cross_attention=True) is not implemented by the fused GPT-2 layer")
    if getattr(attn, "reorder_and_upcast_attn", False) and _attn_impl(config) == "eager":
        raise Unsupported("reorder_and_upcast_attn=True (float32 attention scores) is not implemented")
    hidden, heads, head_dim = attn.embed_dim, attn.num_heads, attn.head_dim
    eps = _same([_layer_norm_eps(layer.ln_1, "ln_1"), _layer_norm_eps(layer.ln_2, "ln_2")], "LayerNorm epsilons")
    resid_p = _same([attn.resid_dropout.p, layer.mlp.dropout.p], "residual dropout probabilities")
    gelu_tanh = _gelu_tanh(layer.mlp.act, "mlp")
    return _C.LayerSpec(family=GPT2, hidden=hidden, num_heads=heads, num_kv_heads=heads, head_dim=head_dim,
                        scaling=_gpt2_scaling(attn, head_dim), attn_p=float(attn.attn_dropout.p), hidden_p=resid_p, eps=eps,
                        gelu_tanh=gelu_tanh)


def _gpt2_scaling(attn: nn.Module, head_dim: int) -> float:
    """The attention scale GPT-2's attention applies: the module's own ``scaling`` where it holds one
    (transformers 5.x after 5.0), else derived from its flags as its eager attention does (5.0 has no
    ``scaling``; its SDPA path then scales by head_dim ** -0.5 whatever the flags say, so a layer whose
    flags are not the defaults is not fused there: its eager and SDPA paths disagree)."""
    scaling = getattr(attn, "scaling", None)
    if scaling is not None:
        return float(scaling)
    by_dim = getattr(attn, "scale_attn_weights", True)
    by_layer = getattr(attn, "scale_attn_by_inverse_layer_idx", False)
    if by_dim and not by_layer:
        return float(head_dim) ** -0.5
    raise Unsupported(f"scale_attn_weights={by_dim}, scale_attn_by_inverse_layer_idx={by_layer}: this transformers "
                      "release's GPT2Attention holds no `scaling`, and its eager and SDPA paths scale such layers "
                      "differently")


def _rms_eps(norm: nn.Module, where: str, size: int) -> float:
    """The epsilon of a Hugging Face RMSNorm of ``size`` features (``variance_epsilon``, Gemma's ``eps``)."""
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    weight = getattr(norm, "weight", None)
    if eps is None or not isinstance(weight, nn.Parameter) or tuple(weight.shape) != (size,):
        raise Unsupported(f"{where} is not an RMSNorm with a weight of {size} features")
    return float(eps)


def _decoder_spec(layer, family: int) -> "_C.LayerSpec":
    """Llama and its relatives (llama: Llama, Qwen2, Mistral; qwen3; gemma; gemma3). Gemma 3's
    ``attn_logit_softcapping`` is not read: its attention never passes it on (Hugging Face's Gemma3Attention stores it
    and calls the attention without a softcap), so neither does the fused layer."""
    attn, mlp = layer.self_attn, layer.mlp
    config = getattr(attn, "config", None)
    # The sliding window (Mistral; Qwen2/Qwen3 sliding layers) is the mask the model builds for eager and SDPA
    # attention and passes each layer; the fused layer applies that mask. Other implementations get no such mask.
    window = getattr(attn, "sliding_window", getattr(config, "sliding_window", None))
    if window is not None and _attn_impl(config) not in _ATTN_IMPLEMENTATIONS:
        raise Unsupported(f"sliding window {window} under attention implementation {_attn_impl(config)!r}: the fused "
                          "layer applies the window through the mask Hugging Face builds for 'eager' and 'sdpa' "
                          "attention, which this implementation does not build")
    _check_common(layer, config)
    act = type(mlp.act_fn).__name__
    if family == GEMMA3 and getattr(config, "use_bidirectional_attention", False):
        raise Unsupported("use_bidirectional_attention=True (EmbeddingGemma: non-causal attention): the fused Gemma 3 "
                          "layer is causal")
    softcap = 0.0
    if family == GEMMA2 and getattr(attn, "attn_logit_softcapping", None) is not None:
        if _attn_impl(config) not in (None, "eager"):
            raise Unsupported(f"attn_logit_softcapping={attn.attn_logit_softcapping} under attention implementation "
                              f"{_attn_impl(config)!r}, which does not apply it (transformers 5.0's SDPA path drops "
                              "it; later releases refuse it): the fused Gemma 2 layer applies it as 'eager' does")
        softcap = float(attn.attn_logit_softcapping)
    if family in (GEMMA, GEMMA3, GEMMA2):
        gelu_tanh = _gelu_tanh(mlp.act_fn, "mlp (the fused Gemma MLP is GeGLU)")
    elif act not in _SILU:
        raise Unsupported(f"activation {act} (the fused {type(layer).__name__} MLP is SwiGLU: silu)")
    else:
        gelu_tanh = False
    biases = [getattr(attn, n).bias is not None for n in ("q_proj", "k_proj", "v_proj")]
    if len(set(biases)) != 1:
        raise Unsupported("q/k/v projections with and without bias mixed")
    head_dim = attn.head_dim
    heads = attn.q_proj.out_features // head_dim
    kv_heads = attn.k_proj.out_features // head_dim
    if heads * head_dim != attn.q_proj.out_features or kv_heads * head_dim != attn.k_proj.out_features:
        raise Unsupported("projection sizes are not multiples of head_dim")
    hidden = attn.q_proj.in_features
    norms = [_rms_eps(layer.input_layernorm, "input_layernorm", hidden),
             _rms_eps(layer.post_attention_layernorm, "post_attention_layernorm", hidden)]
    if family in (QWEN3, GEMMA3):
        norms += [_rms_eps(attn.q_norm, "self_attn.q_norm", head_dim), _rms_eps(attn.k_norm, "self_attn.k_norm", head_dim)]
    if family in (GEMMA3, GEMMA2):
        norms += [_rms_eps(layer.pre_feedforward_layernorm, "pre_feedforward_layernorm", hidden),
                  _rms_eps(layer.post_feedforward_layernorm, "post_feedforward_layernorm", hidden)]
    eps = _same(norms, "RMSNorm epsilons")
    return _C.LayerSpec(family=family, hidden=hidden, num_heads=heads, num_kv_heads=kv_heads,
                        head_dim=head_dim, scaling=float(attn.scaling), attn_p=float(attn.attention_dropout),
                        hidden_p=0.0, eps=eps, gelu_tanh=gelu_tanh, attn_softcap=softcap)


_SPEC_BUILDERS: Dict[int, Callable[[nn.Module], Any]] = {
    BERT: _bert_spec, GPT2: _gpt2_spec, **{f: (lambda layer, f=f: _decoder_spec(layer, f)) for f in DECODERS}}


def layer_spec(layer: nn.Module, family: int) -> "_C.LayerSpec":
    """The C++ spec of a Hugging Face layer of ``family``; raises :class:`Unsupported` saying why not."""
    return _SPEC_BUILDERS[family](layer)


_collector: Optional[Any] = None  # transformers' output-capturing context variable (resolve_collector)
_collector_resolved = False


def resolve_collector():
    """Looks transformers' output-capturing context variable up, once per process. Called where a fused layer
    is made or unpickled -- never first while Dynamo traces: a module global filled during a trace changes
    what the trace's guards saw, and the next step recompiles (issue 35)."""
    global _collector, _collector_resolved
    if not _collector_resolved:
        try:
            from transformers.utils.output_capturing import _active_collector
        except ImportError:
            _active_collector = None
        _collector, _collector_resolved = _active_collector, True


def collecting_attentions() -> bool:
    """True while a Hugging Face model collects attention weights through its output-capturing hooks."""
    if _collector is None:
        return False
    collected = _collector.get()
    return bool(collected) and any("attentions" in k for k in collected)


class CapturingHook:
    """transformers' output-capturing forward hook (``install_output_capuring_hook``'s closure, which cannot be
    pickled) as a picklable object: it holds the closure's arguments (key, index, ...), and runs the closure
    transformers builds from them, built again after unpickling. fuse() installs transformers' hooks on the whole
    model (its layers must be matched before the swap); this keeps such a model picklable, as Hugging Face's own
    model is until it captures outputs."""

    def __init__(self, arguments: Dict[str, Any], hook: Optional[Callable] = None):
        self.arguments = arguments
        if hook is None:  # built now, not at the first call: no state filled while Dynamo traces
            scratch = nn.Module()
            _hook_installer()(scratch, **arguments)
            hook = next(iter(scratch._forward_hooks.values()))
        self._hook = hook

    @classmethod
    def wrap(cls, hook: Callable) -> Optional["CapturingHook"]:
        """A CapturingHook for transformers' closure ``hook``, or None if ``hook`` is not one (or its arguments
        cannot be read from it on this release)."""
        installer = _hook_installer()
        if installer is None or getattr(hook, "__qualname__", "") != f"{installer.__name__}.<locals>.output_capturing_hook" \
                or getattr(hook, "__module__", None) != installer.__module__:
            return None
        cells = dict(zip(hook.__code__.co_freevars, (c.cell_contents for c in hook.__closure__ or ())))
        arguments = {}
        for name, p in list(inspect.signature(installer).parameters.items())[1:]:  # after the module
            if name in cells:
                arguments[name] = cells[name]
            elif p.default is inspect.Parameter.empty:
                return None
        return cls(arguments, hook)

    def __call__(self, module, args, output):
        return self._hook(module, args, output)

    def __reduce__(self):
        return CapturingHook, (self.arguments,)

    def __repr__(self):
        return f"CapturingHook({self.arguments})"


def _hook_installer() -> Optional[Callable]:
    try:
        from transformers.utils.output_capturing import install_output_capuring_hook
    except ImportError:
        return None
    return install_output_capuring_hook


def picklable_capturing_hooks(modules):
    """Replaces transformers' output-capturing closures among the forward hooks of ``modules`` with
    CapturingHook objects (same hook ids, so handles stay valid)."""
    for m in modules:
        hooks = m.__dict__.get("_forward_hooks")
        if not hooks:
            continue
        for hook_id, hook in list(hooks.items()):
            wrapped = CapturingHook.wrap(hook)
            if wrapped is not None:
                hooks[hook_id] = wrapped


def install_output_capturing(model: nn.Module, fused_class: type):
    """Hugging Face records per-layer outputs (output_hidden_states) by matching layers by class, and each
    release does it its own way; the fused layers (``fused_class``) are made to be matched too.

    * Releases with ``maybe_install_capturing_hooks`` (later 5.x) install hooks lazily: installed before the
      swap, they are copied onto the fused layers (fuse() moves the hooks).
    * Releases that patch the matching layers' forward at every call (5.0: ``_CAN_RECORD_REGISTRY``, read
      from the model class's ``_can_record_outputs``) get the fused class added next to each fused layer
      class it names, with the same output index."""
    try:
        from transformers.modeling_utils import PreTrainedModel
    except ImportError:
        return
    try:
        from transformers.utils.output_capturing import maybe_install_capturing_hooks
    except ImportError:
        maybe_install_capturing_hooks = None
    if maybe_install_capturing_hooks is not None:
        for m in model.modules():
            if isinstance(m, PreTrainedModel):
                maybe_install_capturing_hooks(m)
                return  # the outermost model installs for its submodels
        return
    try:
        from transformers.utils.generic import _CAN_RECORD_REGISTRY, OutputRecorder
    except ImportError:
        return
    fusable = tuple(layer_classes())
    for m in model.modules():
        flags = getattr(type(m), "_can_record_outputs", None) if isinstance(m, PreTrainedModel) else None
        if not flags:
            continue
        extended = {}
        for key, specs in flags.items():
            specs = list(specs) if isinstance(specs, (list, tuple)) else [specs]
            targets = [spec.target_class if isinstance(spec, OutputRecorder) else spec for spec in specs]
            if fused_class in targets:  # added by an earlier fuse() of this class
                extended[key] = specs if len(specs) > 1 else specs[0]
                continue
            for spec in list(specs):
                target = spec.target_class if isinstance(spec, OutputRecorder) else spec
                if isinstance(target, type) and issubclass(target, fusable):
                    index = spec.index if isinstance(spec, OutputRecorder) else (0 if "hidden_states" in key else 1)
                    specs.append(OutputRecorder(target_class=fused_class, index=index))
            extended[key] = specs if len(specs) > 1 else specs[0]
        type(m)._can_record_outputs = extended  # what the class's later instances register too
        _CAN_RECORD_REGISTRY[str(type(m))] = extended
