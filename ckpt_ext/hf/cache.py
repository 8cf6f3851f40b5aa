"""Hugging Face's KV cache under checkpointing. A cache written in a layer's forward would be written
again by the replay, so in training ckpt_ext drops it before a checkpointed call, as Hugging Face does
under its own gradient checkpointing.

Which argument is the cache is asked of the layer, not read off a list of names (transformers renamed it
from ``layer_past``/``past_key_value`` to ``past_key_values`` and, in 5.24, to ``cache``):

* a value that is a transformers ``Cache`` object (``transformers.cache_utils.Cache``; also the legacy
  tuple-of-tensors caches, found through the parameter's annotation below), wherever it is passed;
* a parameter of the layer's ``forward`` annotated with a ``Cache`` type (``Cache | None``,
  ``Optional[Cache]``, ``EncoderDecoderCache``, a legacy ``tuple[tuple[torch.Tensor]]`` named as a past);
* ``use_cache`` is turned off (the flag Hugging Face itself turns off under its checkpointing).

A layer class that declares ``_can_checkpoint_with_cache = True`` (transformers 5.24: layers that only
read the cache) keeps its cache, as under Hugging Face's checkpointing. A ``Cache`` found where it cannot
be set to None (inside a list, a tuple or a dict argument) raises a ``ValueError`` naming the layer, rather
than letting the replay write it a second time."""
import inspect
import logging
import sys
from typing import Any, Dict, FrozenSet, Tuple

from torch import nn

__all__ = ["drop_cache", "cache_parameters", "find_cache", "remember_signature"]

logger = logging.getLogger("ckpt_ext")


def _cache_class():
    """transformers' Cache base class, if transformers is imported (never imported from here)."""
    mod = sys.modules.get("transformers.cache_utils")
    return getattr(mod, "Cache", None) if mod is not None else None


def _is_cache(value: Any) -> bool:
    cls = _cache_class()
    return cls is not None and isinstance(value, cls)


def _annotated_as_cache(param: inspect.Parameter) -> bool:
    """A parameter whose annotation names a Cache type, or a legacy past-key-values tuple."""
    ann = param.annotation
    if ann is inspect.Parameter.empty:
        return False
    text = ann if isinstance(ann, str) else repr(ann)
    if "Cache" in text:  # Cache, DynamicCache, EncoderDecoderCache, Optional[Cache], Cache | None, 'Cache'
        return True
    # transformers 4.x legacy caches: tuples of tensors, named as a "past" (layer_past, past_key_value[s])
    return "past" in param.name and "tuple" in text.lower()


def _keeps_cache(layer: nn.Module) -> bool:
    return getattr(type(getattr(layer, "_hf_layer", layer)), "_can_checkpoint_with_cache", False) is True


def drop_cache(layer: nn.Module, args: Tuple, kwargs: Dict) -> Tuple[Tuple, Dict]:
    """(args, kwargs) of a layer call with its KV cache arguments set to None and use_cache to False;
    logs once per process what was dropped."""
    # A fused layer takes (*args, **kwargs) and falls back to the Hugging Face layer's forward: the cache
    # positions are that layer's (GPT-2 passes its cache positionally).
    positions, names = _signature(type(getattr(layer, "_hf_layer", layer)))
    keep = _keeps_cache(layer)
    changed = []
    args = list(args)
    for i, value in enumerate(args):
        if value is None or keep:
            continue
        if _is_cache(value) or i in positions:
            args[i] = None
            changed.append(f"argument {i}")
        else:
            _refuse_nested(layer, value, f"argument {i}")
    for name, value in list(kwargs.items()):
        if name == "use_cache":
            if value:
                kwargs[name] = False
                changed.append(name)
        elif value is not None and not keep:
            if _is_cache(value) or name in names:
                kwargs[name] = None
                changed.append(name)
            else:
                _refuse_nested(layer, value, name)
    if changed and not _CACHE_WARNED:  # said once: default configs (use_cache=True) reach it every run
        _CACHE_WARNED.add(type(layer))
        logger.warning("ckpt_ext: a KV cache cannot be used with checkpointing in training (the replay would "
                       "write it twice); %s of %s set to None/False.", ", ".join(changed), type(layer).__name__)
    return tuple(args), kwargs


def find_cache(values: Dict, kwargs: Dict, names: FrozenSet[str]):
    """The KV cache of a parsed layer call (values: the positional parameters by name), or None."""
    for source in (values, kwargs):
        for name, value in source.items():
            if value is not None and (name in names or _is_cache(value)):
                return value
    return None


def _refuse_nested(layer: nn.Module, value: Any, where: str):
    """A Cache inside a container argument cannot be dropped without knowing the container's meaning."""
    if isinstance(value, (list, tuple)):
        items = value
    elif isinstance(value, dict):
        items = value.values()
    else:
        return
    if any(_is_cache(v) for v in items):
        raise ValueError(
            f"ckpt_ext: {type(layer).__name__} receives a KV cache inside {where} ({type(value).__name__}); "
            "ckpt_ext cannot drop it there, and the replay in backward would write the cache a second time. "
            "Pass use_cache=False to the model in training (or past_key_values=None), or checkpoint the layer "
            "with Hugging Face's own switch (model.gradient_checkpointing_enable()).")


def remember_signature(layer: nn.Module):
    """Reads the layer's forward signature now (enable_checkpointing), not in its first call: read there
    under torch.compile, the table would change while traced and the next step would recompile."""
    _signature(type(getattr(layer, "_hf_layer", layer)))


_SIGNATURES: Dict[type, Tuple[FrozenSet[int], FrozenSet[str]]] = {}
_CACHE_WARNED: set = set()  # non-empty once warned (once per process, like Hugging Face's warning_once)


def cache_parameters(cls: type) -> Tuple[FrozenSet[int], FrozenSet[str]]:
    """(positional indices after self, names) of the parameters of cls.forward that carry a KV cache."""
    return _signature(cls)


def _signature(cls: type) -> Tuple[FrozenSet[int], FrozenSet[str]]:
    sig = _SIGNATURES.get(cls)
    if sig is None:
        fwd = inspect.unwrap(cls.forward)
        params = list(inspect.signature(fwd).parameters.values())[1:]
        found = [(i, p) for i, p in enumerate(params)
                 if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and _annotated_as_cache(p)]
        sig = (frozenset(i for i, p in found if p.kind != p.KEYWORD_ONLY), frozenset(p.name for _, p in found))
        _SIGNATURES[cls] = sig
    return sig
