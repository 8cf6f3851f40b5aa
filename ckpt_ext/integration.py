"""enable_checkpointing / disable_checkpointing: checkpoint the layer stack of a model in one call.

Works on Hugging Face models (BERT/RoBERTa ``encoder.layer``, GPT-2 ``h``, Llama ``layers``, ...) and on
any model whose repeated blocks sit in an ``nn.ModuleList`` or ``nn.Sequential``. The layers'
``forward`` is wrapped on the instance (hooks stay outside the checkpoint, as in Hugging Face), so
parameters, state_dict keys and optimizers are untouched.
"""
import inspect
import logging
import types
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from .checkpoint import _ATOMS, _add_module, _checkpoint, _Found
from .fused import run_segment

__all__ = ["enable_checkpointing", "disable_checkpointing"]

logger = logging.getLogger("ckpt_ext")
_ATTR = "_ckpt_ext_group"
# Arguments through which Hugging Face layers receive a KV cache. A cache written in forward would be
# written again by the replay, so (as Hugging Face does under checkpointing) it is dropped in training.
_CACHE_ARGS = ("past_key_values", "layer_past", "past_key_value")


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


def _same_args(a: Tuple, ka: Dict, b: Tuple, kb: Dict) -> bool:
    def same(x, y):
        return x is y or (isinstance(x, _ATOMS) and type(x) is type(y) and x == y)

    return (len(a) == len(b) and ka.keys() == kb.keys() and all(same(x, y) for x, y in zip(a, b))
            and all(same(ka[k], kb[k]) for k in ka))


class _Group:
    """`every` consecutive layers checkpointed as one call. The first layer's forward runs the whole
    group; the others hand the group's output on when the stack's loop reaches them."""

    def __init__(self, layers: List[nn.Module], index: int):
        self.layers = layers
        self.index = index  # position of the first layer in its stack
        self.pending = None  # (output, remaining layers, args, kwargs) after a checkpointed group run

    def checkpointed(self, layer_args: Tuple, layer_kwargs: Dict):
        """Runs the group checkpointed: fused layers (ckpt_ext.fuse) as one C++ SegmentFunction, other
        layers through ckpt_ext.checkpoint."""
        out = run_segment(self.layers, layer_args, layer_kwargs)
        if out is not NotImplemented:
            return out
        found = _Found()
        for layer in self.layers:
            _add_module(layer, found)
        return _checkpoint(self.run, (layer_args, layer_kwargs), {}, found=found)

    def run(self, layer_args: Tuple, layer_kwargs: Dict):
        """Runs every layer of the group (unwrapped), feeding each output's hidden state to the next."""
        first, rest = self.layers[0], self.layers[1:]
        out = type(first).forward(first, *layer_args, **layer_kwargs)
        for layer in rest:
            out = type(layer).forward(layer, _hidden_of(out), *layer_args[1:], **layer_kwargs)
        return out


def _drop_cache(layer: nn.Module, args: Tuple, kwargs: Dict) -> Tuple[Tuple, Dict]:
    sig = _signature(type(layer))
    changed = []
    args = list(args)
    for name in _CACHE_ARGS + ("use_cache",):
        if name in kwargs:
            if name == "use_cache":
                if kwargs[name]:
                    kwargs[name] = False
                    changed.append(name)
            elif kwargs[name] is not None:
                kwargs[name] = None
                changed.append(name)
        elif name in sig and sig[name] < len(args):
            i = sig[name]
            if name == "use_cache":
                if args[i]:
                    args[i] = False
                    changed.append(name)
            elif args[i] is not None:
                args[i] = None
                changed.append(name)
    if changed and type(layer) not in _CACHE_WARNED:
        _CACHE_WARNED.add(type(layer))
        logger.warning("ckpt_ext: a KV cache cannot be used with checkpointing in training (the replay would "
                       "write it twice); %s of %s set to None/False.", ", ".join(changed), type(layer).__name__)
    return tuple(args), kwargs


_SIGNATURES: Dict[type, Dict[str, int]] = {}
_CACHE_WARNED: set = set()  # layer classes warned about (once per process, like Hugging Face's warning)


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


def _layer_forward(self: nn.Module, *args, **kwargs):
    group: _Group = getattr(self, _ATTR)
    if group.layers[0] is self:
        if not (self.training and torch.is_grad_enabled()):
            group.pending = None
            return type(self).forward(self, *args, **kwargs)
        args, kwargs = _drop_cache(self, args, kwargs)
        out = group.checkpointed(args, kwargs)
        if len(group.layers) > 1:
            group.pending = (out, 1, args, kwargs)
        return out
    # A later layer of the group: the group already ran it.
    if group.pending is None:  # called on its own (e.g. by the user): run it, checkpointed alone
        if not (self.training and torch.is_grad_enabled()):
            return type(self).forward(self, *args, **kwargs)
        args, kwargs = _drop_cache(self, args, kwargs)
        out = run_segment([self], args, kwargs)
        if out is not NotImplemented:
            return out
        return _checkpoint(lambda a, k: type(self).forward(self, *a, **k), (args, kwargs), {})
    out, done, g_args, g_kwargs = group.pending
    expected = group.layers[done]
    args, kwargs = _drop_cache(self, args, kwargs)
    if expected is not self or not args or args[0] is not _hidden_of(out):
        group.pending = None
        raise RuntimeError(
            f"ckpt_ext.enable_checkpointing(every={len(group.layers)}): layer {group.index + done} "
            f"({type(self).__name__}) did not receive the output of the layer before it unchanged; this model "
            "transforms hidden states between layers, so layers cannot be grouped. Use every=1.")
    if not _same_args(args[1:], kwargs, g_args[1:], g_kwargs):
        group.pending = None
        raise RuntimeError(
            f"ckpt_ext.enable_checkpointing(every={len(group.layers)}): layer {group.index + done} "
            f"({type(self).__name__}) receives different arguments than layer {group.index}, but a group runs "
            "all its layers with the first layer's arguments. Use every=1.")
    group.pending = (out, done + 1, g_args, g_kwargs) if done + 1 < len(group.layers) else None
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


def enable_checkpointing(model: nn.Module, every: int = 1, layers: Optional[Sequence[nn.Module]] = None) -> nn.Module:
    """Checkpoints the model's layer stack with ckpt_ext: groups of ``every`` consecutive layers run as
    one checkpointed call in training (layer keyword arguments -- attention masks, position ids,
    rotary embeddings -- are passed through). ``layers`` names the stack explicitly (an
    ``nn.ModuleList``/``nn.Sequential`` or a list of modules). Returns the model."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"enable_checkpointing expects an nn.Module, got {type(model).__name__}")
    if isinstance(every, bool) or not isinstance(every, int):
        raise TypeError(f"every must be a positive int, got {every!r}")
    if every < 1:
        raise ValueError(f"every must be at least 1, got {every}")
    if getattr(model, "is_gradient_checkpointing", False) or any(
            getattr(m, "gradient_checkpointing", False) is True for m in model.modules()):
        raise ValueError("this model has Hugging Face gradient checkpointing enabled; call "
                         "model.activation_checkpointing_disable() (gradient_checkpointing_disable() before "
                         "transformers 5.x renamed it) before ckpt_ext.enable_checkpointing(model), or the "
                         "layers would be checkpointed twice")
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
        if not stacks:
            raise ValueError(
                f"enable_checkpointing found no layer stack in {type(model).__name__}: it looks for an "
                "nn.ModuleList or nn.Sequential of two or more blocks of one class. Pass the stack "
                "explicitly, e.g. enable_checkpointing(model, layers=model.encoder.layer).")
    disable_checkpointing(model)
    for name, stack in stacks:
        mods = list(stack)
        if every > len(mods):
            raise ValueError(f"every={every} is larger than the {len(mods)} layers of {name or 'the model'}")
        for start in range(0, len(mods), every):
            group = _Group(mods[start:start + every], start)
            for layer in group.layers:
                if hasattr(layer, _ATTR):
                    raise ValueError(f"layer {type(layer).__name__} appears twice in the stacks to checkpoint")
                object.__setattr__(layer, _ATTR, group)
                object.__setattr__(layer, "forward", types.MethodType(_layer_forward, layer))
    return model


def disable_checkpointing(model: nn.Module) -> nn.Module:
    """Undoes enable_checkpointing; returns the model."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"disable_checkpointing expects an nn.Module, got {type(model).__name__}")
    for m in model.modules():
        if _ATTR in m.__dict__:
            del m.__dict__[_ATTR]
            m.__dict__.pop("forward", None)
    return model
