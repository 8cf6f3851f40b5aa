"""Hugging Face's KV cache under checkpointing. A cache written in a layer's forward would be written
again by the replay, so in training ckpt_ext drops it before a checkpointed call, as Hugging Face does
under its own gradient checkpointing."""
import inspect
import logging
from typing import Dict, Tuple

from torch import nn

__all__ = ["CACHE_ARGS", "drop_cache", "remember_signature"]

logger = logging.getLogger("ckpt_ext")
# Arguments through which Hugging Face layers receive a KV cache (transformers 5.x and before).
CACHE_ARGS = ("past_key_values", "layer_past", "past_key_value")


def drop_cache(layer: nn.Module, args: Tuple, kwargs: Dict) -> Tuple[Tuple, Dict]:
    """(args, kwargs) of a layer call with the KV cache arguments set to None and use_cache to False;
    logs once per process what was dropped."""
    # A fused layer takes (*args, **kwargs) and falls back to the Hugging Face layer's forward: the cache
    # positions are that layer's (GPT-2 passes its cache positionally).
    sig = _signature(type(getattr(layer, "_hf_layer", layer)))
    changed = []
    args = list(args)
    for name in CACHE_ARGS + ("use_cache",):
        if name in kwargs:
            holder, key = kwargs, name
        elif sig.get(name, len(args)) < len(args):
            holder, key = args, sig[name]
        else:
            continue
        off = False if name == "use_cache" else None
        if (bool(holder[key]) if off is False else holder[key] is not None):
            holder[key] = off
            changed.append(name)
    if changed and not _CACHE_WARNED:  # said once: default configs (use_cache=True) reach it every run
        _CACHE_WARNED.add(type(layer))
        logger.warning("ckpt_ext: a KV cache cannot be used with checkpointing in training (the replay would "
                       "write it twice); %s of %s set to None/False.", ", ".join(changed), type(layer).__name__)
    return tuple(args), kwargs


def remember_signature(layer: nn.Module):
    """Reads the layer's forward signature now (enable_checkpointing), not in its first call: read there
    under torch.compile, the table would change while traced and the next step would recompile."""
    _signature(type(getattr(layer, "_hf_layer", layer)))


_SIGNATURES: Dict[type, Dict[str, int]] = {}
_CACHE_WARNED: set = set()  # non-empty once warned (once per process, like Hugging Face's warning_once)


def _signature(cls: type) -> Dict[str, int]:
    """Positional index (after self) of each parameter of cls.forward."""
    sig = _SIGNATURES.get(cls)
    if sig is None:
        fwd = inspect.unwrap(cls.forward)
        params = list(inspect.signature(fwd).parameters.values())[1:]
        sig = {p.name: i for i, p in enumerate(params)
               if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)}
        _SIGNATURES[cls] = sig
    return sig
