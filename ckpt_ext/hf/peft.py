"""peft adapters (LoRA, ...) as ckpt_ext sees them. peft replaces a target ``nn.Linear`` by a tuner layer
that holds the original as ``base_layer`` and adds the adapter terms in its forward; the fused layers
compute with the original weights only, so they must not run over such a layer."""
import sys
from typing import List, Tuple

from torch import nn

__all__ = ["is_adapter_layer", "adapter_layers", "refuse_adapters"]


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


def refuse_adapters(module: nn.Module, where: str, error: type = ValueError):
    """Raises ``error`` naming the peft tuner layers inside ``module``, if any: the fused layers do not
    compute adapter terms yet, and running Hugging Face's forward instead would quietly give up fusion."""
    found = adapter_layers(module)
    if found:
        names = ", ".join(name for name, _ in found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
        raise error(
            f"{where}: {names} {'is a peft adapter layer' if len(found) == 1 else 'are peft adapter layers'}; "
            "ckpt_ext.fuse() does not support peft adapters (LoRA) yet. Train the peft model with "
            "ckpt_ext.enable_checkpointing(model) and without fuse(), or merge the adapters first "
            "(model.merge_and_unload()) and fuse the merged model.")
