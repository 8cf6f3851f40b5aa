"""peft adapters as ckpt_ext sees them. peft replaces a target ``nn.Linear`` (or GPT-2's ``Conv1D``) by a
tuner layer that holds the original as ``base_layer`` and adds the adapter terms in its forward. The fused
layers compute plain LoRA themselves (csrc/layers/lora.cpp): one active adapter per projection, not
merged, read here per call; every other kind of adapter is refused with an error naming it."""
import sys
from typing import List, Optional, Sequence, Tuple

import torch
from torch import nn

__all__ = ["is_adapter_layer", "adapter_layers", "refuse_adapters", "is_lora_linear", "base_of",
           "lora_terms", "check_layer_adapters", "peft_relink"]


def is_adapter_layer(module: nn.Module) -> bool:
    """Whether ``module`` is a peft tuner layer. peft need not be installed: a model can only hold
    its layers once peft was imported."""
    tuners = sys.modules.get("peft.tuners.tuners_utils")
    base = getattr(tuners, "BaseTunerLayer", None)
    return base is not None and isinstance(module, base)


def adapter_layers(module: nn.Module) -> List[Tuple[str, nn.Module]]:
    """(name, layer) of every peft tuner layer inside ``module``."""
    if "peft.tuners.tuners_utils" not in sys.modules:
        return []
    return [(name, m) for name, m in module.named_modules() if is_adapter_layer(m)]


def is_lora_linear(module: nn.Module) -> bool:
    """peft's LoRA layer over an nn.Linear or Conv1D (``peft.tuners.lora.layer.Linear`` itself, not a
    subclass: quantised and other variants compute differently)."""
    lora = sys.modules.get("peft.tuners.lora.layer")
    return lora is not None and type(module) is getattr(lora, "Linear", None)


def base_of(module: nn.Module) -> nn.Module:
    """The module holding a projection's own weight: the base layer of a LoRA layer, else itself."""
    return module._modules["base_layer"] if is_lora_linear(module) else module


_ADVICE = ("The fused layers compute plain LoRA (one active adapter, lora_bias=False, no DoRA or other variant) "
           "on the attention and MLP projections. Train this model with ckpt_ext.enable_checkpointing(model) "
           "without fuse(), or merge the adapters first (model.merge_and_unload()) and fuse the merged model.")


def _refuse(error: type, where: str, what: str):
    raise error(f"{where}: {what}. {_ADVICE}")


def lora_terms(module: nn.Module, where: str, error: type = RuntimeError
               ) -> Optional[Tuple[torch.Tensor, torch.Tensor, float, float]]:
    """(A, B, scaling, dropout p) of the LoRA term a projection adds in this call, as peft's forward
    would; None when it adds none (a plain module, adapters disabled or merged, no active adapter
    here). Raises ``error`` for what the fused layer does not compute."""
    if not is_lora_linear(module):
        if is_adapter_layer(module):
            _refuse(error, where, f"{type(module).__module__}.{type(module).__name__} is not a supported peft "
                                  "adapter (only LoRA on nn.Linear / Conv1D)")
        return None
    if is_adapter_layer(module._modules["base_layer"]):
        _refuse(error, where, "stacked peft adapters (an adapter layer wrapping another)")
    if module._forward_pre_hooks or module._forward_hooks:
        _refuse(error, where, "hooks on the LoRA layer (peft's per-sample adapter_names, or user hooks) would "
                              "not run: the fused layer never calls it")
    if module.disable_adapters:
        if module.merged:
            module.unmerge()  # what peft's forward does with adapters disabled
        return None
    if module.merged:
        return None  # the base weight holds B @ A * scaling
    active = [a for a in module.active_adapters if a in module.lora_A]
    if not active:
        return None
    if len(active) > 1:
        _refuse(error, where, f"{len(active)} active LoRA adapters ({', '.join(active)}); one is supported")
    name = active[0]
    if name in getattr(module, "lora_variant", {}) or getattr(module, "use_dora", {}).get(name):
        kind = "DoRA (use_dora=True)" if module.use_dora.get(name) else type(module.lora_variant[name]).__name__
        _refuse(error, where, f"adapter {name!r} is a LoRA variant, {kind}")
    if getattr(module, "lora_bias", {}).get(name) or module.lora_B[name].bias is not None:
        _refuse(error, where, f"adapter {name!r} has lora_bias=True")
    dropout = module.lora_dropout[name]
    if not isinstance(dropout, (nn.Dropout, nn.Identity)):
        _refuse(error, where, f"adapter {name!r} has lora_dropout of type {type(dropout).__name__}")
    p = float(dropout.p) if isinstance(dropout, nn.Dropout) else 0.0
    return module.lora_A[name].weight, module.lora_B[name].weight, float(module.scaling[name]), p


def check_layer_adapters(layer: nn.Module, projections: Sequence[str], where: str, error: type = ValueError):
    """Raises ``error`` when ``layer`` holds a peft adapter the fused layer cannot compute: one on a
    module other than the projections (paths in ``layer``), or of a kind lora_terms refuses."""
    allowed = set(projections)
    for name, m in adapter_layers(layer):
        if name not in allowed:
            if name.rsplit(".", 1)[0] in allowed and name.endswith(".base_layer"):
                _refuse(error, f"{where}, {name}", "stacked peft adapters (an adapter layer wrapping another)")
            _refuse(error, f"{where}, {name}", "an adapter on a module the fused layer has no adapter slot for "
                                               f"(supported: {', '.join(projections)})")
        lora_terms(m, f"{where}, {name}", error)


def peft_relink(old: nn.Module, new: nn.Module) -> bool:
    """Whether replacing child ``old`` by ``new`` is peft wrapping it in a LoRA layer (or unwrapping
    one): the weights stay the same Parameters and the fused layer reads the adapter per call."""
    return (is_lora_linear(new) and new._modules["base_layer"] is old) or \
        (is_lora_linear(old) and old._modules["base_layer"] is new)


def refuse_adapters(module: nn.Module, where: str, error: type = ValueError):
    """Raises ``error`` naming the peft tuner layers inside ``module``, if any (for callers that
    compute no adapter terms)."""
    found = adapter_layers(module)
    if found:
        names = ", ".join(name for name, _ in found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
        raise error(
            f"{where}: {names} {'is a peft adapter layer' if len(found) == 1 else 'are peft adapter layers'}; "
            "this does not support peft adapters. " + _ADVICE)
