"""ckpt_ext in place of Hugging Face's activation (gradient) checkpointing, for Trainer and accelerate.

transformers 5.x checkpoints a layer when its ``gradient_checkpointing`` attribute is True: the class
``forward`` of every ``GradientCheckpointingLayer`` is wrapped to call ``_gradient_checkpointing_func``.
``model.activation_checkpointing_enable()`` (``gradient_checkpointing_enable()`` before 5.x renamed it),
which ``Trainer`` calls for ``TrainingArguments(gradient_checkpointing=True)``, sets those attributes.
A layer that ckpt_ext checkpoints and whose flag is also set would be checkpointed twice (run three
times per step), so ckpt_ext takes those four methods over on the model instance: enabling means
``ckpt_ext.enable_checkpointing`` and disabling means ``ckpt_ext.disable_checkpointing``.
"""
import functools
import inspect
import logging
from typing import Optional, Union

from torch import nn
from .versions import check_versions

__all__ = ["take_over_hf_checkpointing", "hf_checkpointing_on", "install_take_over", "remove_take_over",
           "refuse_hf_checkpointing_on", "layer_hf_checkpointed", "double_checkpointing_error"]

logger = logging.getLogger("ckpt_ext")
# ckpt_ext.stack imports this module; what this one calls back in stack, stack registers in _entry_points.

_OPTIONS = "_ckpt_ext_hf_options"  # instance attribute: the enable_checkpointing options the flag means
_ENABLE = ("activation_checkpointing_enable", "gradient_checkpointing_enable")
_DISABLE = ("activation_checkpointing_disable", "gradient_checkpointing_disable")
# Keyword arguments of HF's checkpoint function that ckpt_ext satisfies as they are meant: ckpt_ext's
# checkpoint is non-reentrant-like (inputs need not require grad) and always restores the RNG state.
_ACCEPTED_KWARGS = {"use_reentrant": (True, False), "preserve_rng_state": (True,)}


def is_hf_model(model: nn.Module) -> bool:
    """A transformers PreTrainedModel, or a model that forwards its checkpointing switch to one (a peft
    PeftModel), recognised by its methods."""
    return any(callable(getattr(model, name, None)) for name in _ENABLE)


def hf_checkpointing_on(model: nn.Module) -> bool:
    """Whether Hugging Face's checkpointing is enabled on a module of ``model``. Reads the per-module
    flags that ``is_activation_checkpointing`` reads, without its deprecated alias
    ``is_gradient_checkpointing`` (which warns FutureWarning in transformers 5.x)."""
    return any(layer_hf_checkpointed(m) for m in model.modules())


def refuse_hf_checkpointing_on(model: nn.Module):
    """Raises when Hugging Face's checkpointing is on in ``model``: ckpt_ext's on top would checkpoint the
    layers twice."""
    if hf_checkpointing_on(model):
        raise ValueError("this model has Hugging Face gradient checkpointing enabled; call "
                         "model.activation_checkpointing_disable() (gradient_checkpointing_disable() before "
                         "transformers 5.x renamed it) before ckpt_ext.enable_checkpointing(model), or the "
                         "layers would be checkpointed twice -- or ckpt_ext.take_over_hf_checkpointing(model), "
                         "which hands Hugging Face's checkpointing over to ckpt_ext")


def layer_hf_checkpointed(layer: nn.Module) -> bool:
    """Whether Hugging Face's ``GradientCheckpointingLayer`` flag is set on ``layer`` with Hugging Face's
    checkpoint function (with ckpt_ext's, see ride_hf_checkpointing, the layer is ckpt_ext's)."""
    return getattr(layer, "gradient_checkpointing", False) is True and not rides_hf(layer)


def checkpoint_for_hf(function, *args, **kwargs):
    """The checkpoint function ckpt_ext gives Hugging Face's ``_set_gradient_checkpointing``: Hugging Face
    calls it as ``func(partial(forward, layer, **kwargs), *args)`` (``partial(super().__call__, ...)`` before
    5.23)."""
    from ..checkpoint import checkpoint
    return checkpoint(function, *args, use_reentrant=False, **kwargs)


def checkpoint_for_hf_keeping_attention(function, *args, **kwargs):
    """checkpoint_for_hf with keep="attention" (ckpt_ext.keep_attention as the context_fn)."""
    from ..checkpoint import checkpoint
    from ..keep import keep_attention
    return checkpoint(function, *args, use_reentrant=False, context_fn=keep_attention, **kwargs)


def checkpoint_for_hf_keeping_attention_inputs(function, *args, **kwargs):
    """checkpoint_for_hf with keep="attention_inputs"."""
    return _keeping("attention_inputs", function, args, kwargs)


def checkpoint_for_hf_keeping_gemms(function, *args, **kwargs):
    """checkpoint_for_hf with keep="gemms"."""
    return _keeping("gemms", function, args, kwargs)


def checkpoint_for_hf_keeping_gemms_attention(function, *args, **kwargs):
    """checkpoint_for_hf with keep="gemms_attention"."""
    return _keeping("gemms_attention", function, args, kwargs)


def _keeping(level, function, args, kwargs):
    from ..checkpoint import checkpoint
    from ..keep import keep_level
    return checkpoint(function, *args, use_reentrant=False, context_fn=keep_level(level), **kwargs)


_FOR_HF = {"boundaries": checkpoint_for_hf, "attention": checkpoint_for_hf_keeping_attention,
           "attention_inputs": checkpoint_for_hf_keeping_attention_inputs,
           "gemms": checkpoint_for_hf_keeping_gemms, "gemms_attention": checkpoint_for_hf_keeping_gemms_attention}


def rides_hf(module: nn.Module) -> bool:
    """Whether Hugging Face's checkpointing flag of ``module`` is on with ckpt_ext's checkpoint function."""
    return (getattr(module, "gradient_checkpointing", False) is True
            and module.__dict__.get("_gradient_checkpointing_func") in _FOR_HF.values())


def rides_hf_keep(module: nn.Module) -> str:
    """What a layer checkpointed through Hugging Face's mechanism keeps (see rides_hf): keep='...'."""
    func = module.__dict__.get("_gradient_checkpointing_func")
    return next((k for k, f in _FOR_HF.items() if f is func), "boundaries")


def hf_checkpointing_host(model: nn.Module):
    """The outermost transformers model in ``model`` that has Hugging Face's checkpointing mechanism
    (``supports_gradient_checkpointing`` and ``_set_gradient_checkpointing(enable, gradient_checkpointing_func)``,
    the signature transformers has kept since 4.35), or None."""
    for m in model.modules():
        if getattr(type(m), "supports_gradient_checkpointing", False) is True and \
                callable(getattr(m, "_set_gradient_checkpointing", None)):
            try:
                params = inspect.signature(m._set_gradient_checkpointing).parameters
            except (TypeError, ValueError):
                continue
            if "gradient_checkpointing_func" in params:
                return m
    return None


def ride_hf_checkpointing(host: nn.Module, keep: str = "boundaries"):
    """Turns Hugging Face's checkpointing of ``host`` on with ckpt_ext's checkpoint function (keeping what
    ``keep`` says)."""
    host._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=_FOR_HF[keep])
    if not any(rides_hf(m) for m in host.modules()):
        raise ValueError(f"ckpt_ext: {type(host).__name__} has Hugging Face's checkpointing switch but no layer took "
                         "ckpt_ext's checkpoint function; pass the layers: enable_checkpointing(model, layers=...)")


def double_checkpointing_error(layer: nn.Module, index: int) -> RuntimeError:
    """Hugging Face's flag was set on a layer ckpt_ext checkpoints by a path the take-over does not see
    (its switch on another module than the one given to enable_checkpointing, or the flag set by hand)."""
    return RuntimeError(
        f"ckpt_ext checkpoints layer {index} ({type(layer).__name__}), but Hugging "
        "Face's gradient checkpointing was also enabled on it, so it would be checkpointed twice. Call "
        "ckpt_ext.take_over_hf_checkpointing(model) on the model whose activation_checkpointing_enable() (or "
        "Trainer's gradient_checkpointing=True) turns it on, or turn one of the two off.")


def _hf_checkpointing_off(model: nn.Module):
    """Clears Hugging Face's per-module flags as its disable does, without its FutureWarning (the hook its
    enable put on the input embeddings, making their output require grad, stays: harmless)."""
    for m in model.modules():
        if layer_hf_checkpointed(m):
            m.gradient_checkpointing = False


def take_over_hf_checkpointing(model: nn.Module, every: Optional[int] = None,
                               budget: Union[int, str, None] = None, keep: Optional[str] = None) -> nn.Module:
    """Makes Hugging Face's checkpointing switch of ``model`` mean ckpt_ext: afterwards
    ``TrainingArguments(gradient_checkpointing=True)`` (Trainer calls ``model.activation_checkpointing_enable()``)
    and ``model.gradient_checkpointing_enable()`` run ``ckpt_ext.enable_checkpointing(model, every=every,
    budget=budget, keep=keep)``, and the disable methods ``ckpt_ext.disable_checkpointing``. If Hugging Face's
    checkpointing is already on, it is handed over to ckpt_ext now. Returns the model.

    The switch's ``use_reentrant`` is accepted and has no effect (ckpt_ext needs no input that requires
    grad); ``every_n_layers`` other than 1, ``offload=True`` and other checkpoint arguments raise
    ``ValueError`` (give ckpt_ext's ``every=``/``budget=`` here instead)."""
    from .._entry_points import check_options as _check_options, enable_checkpointing
    if not isinstance(model, nn.Module):
        raise TypeError(f"take_over_hf_checkpointing expects an nn.Module, got {type(model).__name__}")
    if not is_hf_model(model):
        raise TypeError(f"take_over_hf_checkpointing expects a Hugging Face model (a transformers PreTrainedModel "
                        f"with activation_checkpointing_enable); {type(model).__name__} has none. Call "
                        "ckpt_ext.enable_checkpointing(model) directly.")
    _check_options(every, budget, keep)
    check_versions()
    if hf_checkpointing_on(model):
        _hf_checkpointing_off(model)
        logger.info("ckpt_ext: Hugging Face's checkpointing of %s handed over to ckpt_ext", type(model).__name__)
        enable_checkpointing(model, every=every, budget=budget, keep=keep)
    install_take_over(model, {"every": every, "budget": budget, "keep": keep})
    return model


def install_take_over(model: nn.Module, options: dict):
    """Replaces the model instance's four checkpointing methods, so that enabling means
    ``enable_checkpointing(model, **options)`` (a no-op on a model that is not Hugging Face's)."""
    if not is_hf_model(model):
        return
    object.__setattr__(model, _OPTIONS, dict(options))
    # partials, not bound methods: they pickle with the model (torch.save, a spawned process)
    for name in _ENABLE:
        if callable(getattr(model, name, None)):
            object.__setattr__(model, name, functools.partial(_enable, model))
    for name in _DISABLE:
        if callable(getattr(model, name, None)):
            object.__setattr__(model, name, functools.partial(_disable, model))


def remove_take_over(model: nn.Module):
    """Gives the four methods back to Hugging Face."""
    if model.__dict__.pop(_OPTIONS, None) is not None:
        for name in _ENABLE + _DISABLE:
            model.__dict__.pop(name, None)


def _check_hf_arguments(kwargs: Optional[dict], every_n_layers: int, offload: bool):
    where = "ckpt_ext checkpoints this model (ckpt_ext.take_over_hf_checkpointing)"
    if every_n_layers != 1:
        raise ValueError(f"{where}: every_n_layers={every_n_layers} (Hugging Face's every n-th layer) has no "
                         "ckpt_ext meaning; give ckpt_ext.take_over_hf_checkpointing(model, every=k) (groups of k "
                         "layers) or budget= instead")
    if offload:
        raise ValueError(f"{where}: offload=True (saved activations in host memory) is not supported by ckpt_ext")
    for key, value in (kwargs or {}).items():
        if key not in _ACCEPTED_KWARGS or value not in _ACCEPTED_KWARGS[key]:
            raise ValueError(f"{where}: the checkpoint argument {key}={value!r} has no ckpt_ext equivalent "
                             f"(accepted: use_reentrant, preserve_rng_state=True)")


def _enable(model: nn.Module, activation_checkpointing_kwargs: Optional[dict] = None, every_n_layers: int = 1,
            offload: bool = False, *, gradient_checkpointing_kwargs: Optional[dict] = None):
    """Hugging Face's enable, taken over (both names: the kwargs arrive under either)."""
    from .._entry_points import enable_checkpointing, is_enabled
    _check_hf_arguments(activation_checkpointing_kwargs or gradient_checkpointing_kwargs, every_n_layers, offload)
    if is_enabled(model):
        logger.info("ckpt_ext: %s is checkpointed by ckpt_ext already; Hugging Face's checkpointing switch is "
                    "handed over to it", type(model).__name__)
        return
    enable_checkpointing(model, **model.__dict__[_OPTIONS])


def _disable(model: nn.Module):
    from .._entry_points import detach_groups as _detach_groups
    _detach_groups(model)  # the take-over stays: enabling again means ckpt_ext again
