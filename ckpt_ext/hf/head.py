"""A Hugging Face causal LM's head and loss as ckpt_ext's chunked linear cross-entropy (ckpt_ext/head.py).

Generic, not per class: a model qualifies when its output embedding (``get_output_embeddings()``) is a plain
``nn.Linear`` held directly by the model, its ``loss_function`` is transformers' ``ForCausalLMLoss`` and its
forward takes ``labels``. Hugging Face's forward itself keeps running (its arguments, the base model,
``logits_to_keep``, the output class); two things change, per call and only in training with labels:

* the head (a :class:`FusedLMHead`, an ``nn.Linear`` sharing the same Parameters, so state_dict keys, tied
  embeddings and optimizers are untouched) hands its input through instead of computing the logits;
* the model's ``loss_function`` (transformers' own setter) receives those hidden states and computes
  ``linear_cross_entropy`` with the head's weight, with the same arguments (labels, ``num_items_in_batch``,
  ``ignore_index``, ``shift_labels``) as ``ForCausalLMLoss``;

and the output's ``logits`` is None. A forward pre-hook decides per call (``skip_logits``, as Liger-Kernel's
keyword: None = training with labels, True/False to force it) and a forward hook (always called) undoes the
call's state. Gemma's ``config.final_logit_softcapping`` is applied inside the loss (and set aside on the
config for the call, so the forward does not apply it to the hidden states).
"""
import inspect
import warnings
from typing import Optional

import torch
from torch import nn

from ..head import linear_cross_entropy

__all__ = ["FusedLMHead", "fuse_lm_head", "unfuse_lm_head", "head_refusal"]

# Configuration attributes a model's forward applies between the head and the loss that the chunked loss does
# not reproduce (Cohere's logit_scale, Granite's logits_scaling): such a model keeps Hugging Face's head.
_UNSUPPORTED_SCALING = ("logit_scale", "logits_scaling")


class FusedLMHead(nn.Linear):
    """The model's ``lm_head`` (same Parameters): Hugging Face's ``F.linear`` unless the model's pre-hook has
    marked this call as fused, when it returns its input (the loss computes the logits chunk by chunk)."""

    def __init__(self, linear: nn.Linear):
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        for name, value in vars(linear).items():  # hooks and other plain state of the replaced module
            if name.startswith("_") and name.endswith("hooks") and value:
                getattr(self, name).update(value)
        self._fused_call = False
        self._fused_hidden: Optional[torch.Tensor] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._fused_call:
            self._fused_hidden = x
            return x
        return super().forward(x)

    def extra_repr(self) -> str:
        return super().extra_repr() + ", fused with the loss in training"


class _HeadState:
    """What the hooks and the loss of one model share (no module attributes: kept out of state_dict)."""

    def __init__(self, name: str, labels_pos: Optional[int], original_loss, softcap_attr: Optional[str]):
        self.name, self.labels_pos, self.original_loss = name, labels_pos, original_loss
        self.softcap_attr = softcap_attr
        self.saved_softcap = None
        self.warned = set()
        self.loss_ran = False  # the chunked loss ran in the current fused call (checked by the post-hook)


class FusedCausalLMLoss:
    """The model's ``loss_function`` after :func:`fuse_lm_head`: the chunked loss for a fused call,
    transformers' ``ForCausalLMLoss`` otherwise. Same arguments as ``ForCausalLMLoss``."""

    def __init__(self, model: nn.Module, state: _HeadState):
        self.model, self.state = model, state

    def __call__(self, logits, labels, vocab_size: int, num_items_in_batch=None, ignore_index: int = -100,
                 shift_labels=None, **kwargs):
        head = getattr(self.model, self.state.name)
        if not (isinstance(head, FusedLMHead) and head._fused_call):
            return self.state.original_loss(logits, labels, vocab_size, num_items_in_batch=num_items_in_batch,
                                            ignore_index=ignore_index, shift_labels=shift_labels, **kwargs)
        if logits is not head._fused_hidden:
            raise RuntimeError(
                f"ckpt_ext: {type(self.model).__name__}'s forward changed the head's output before its loss, which "
                "the fused head+loss cannot reproduce; call ckpt_ext.hf.head.unfuse_lm_head(model) (or pass "
                "skip_logits=False) to run Hugging Face's head and loss")
        if vocab_size != head.out_features:
            raise ValueError(f"ckpt_ext: the loss was asked for a vocabulary of {vocab_size} but the head has "
                             f"{head.out_features} outputs")
        self.state.loss_ran = True
        return linear_cross_entropy(logits, head.weight, head.bias, labels, ignore_index=ignore_index,
                                    num_items_in_batch=num_items_in_batch, shift_labels=shift_labels,
                                    softcap=self.state.saved_softcap)


def _pre_hook(model, args, kwargs):
    state: _HeadState = model._ckpt_ext_head
    skip = kwargs.pop("skip_logits", None)
    labels = kwargs.get("labels")
    if labels is None and state.labels_pos is not None and len(args) > state.labels_pos:
        labels = args[state.labels_pos]
    head = getattr(model, state.name)
    fused = (model.training and labels is not None) if skip is None else bool(skip)
    if fused and labels is None:
        raise ValueError("ckpt_ext: skip_logits=True needs labels (the fused head computes only the loss)")
    if fused and not (isinstance(head, FusedLMHead) and isinstance(model.__dict__.get("_loss_function"),
                                                                      FusedCausalLMLoss)):
        what = (f"{state.name} was replaced ({type(head).__name__})" if not isinstance(head, FusedLMHead)
                else "its loss_function was replaced")
        if what not in state.warned:  # once per reason and model
            state.warned.add(what)
            warnings.warn(f"ckpt_ext: {type(model).__name__}'s {what} after fuse: its head and loss run Hugging "
                          "Face's way (call ckpt_ext.fuse_lm_head(model) again to fuse a new nn.Linear head)",
                          stacklevel=3)
        fused = False
    if isinstance(head, FusedLMHead):
        head._fused_call = fused
    state.loss_ran = False
    if fused and state.softcap_attr is not None:
        state.saved_softcap = getattr(model.config, state.softcap_attr)
        setattr(model.config, state.softcap_attr, None)
    return args, kwargs


def _post_hook(model, args, kwargs, output):
    state: _HeadState = model._ckpt_ext_head
    head = getattr(model, state.name)
    fused = isinstance(head, FusedLMHead) and head._fused_call
    head_ran = fused and head._fused_hidden is not None
    if isinstance(head, FusedLMHead):
        head._fused_call = False
        head._fused_hidden = None
    if state.softcap_attr is not None and state.saved_softcap is not None:
        setattr(model.config, state.softcap_attr, state.saved_softcap)
        state.saved_softcap = None
    if not fused or output is None:
        return output
    bare = isinstance(output, torch.Tensor)  # a forward returning its loss alone
    loss = output[0] if isinstance(output, tuple) else output if bare else getattr(output, "loss", None)
    if head_ran and not state.loss_ran and loss is not None:
        # The forward computed its loss some other way than its loss_function (head_refusal reads the forward's
        # source for this; a source it cannot read, or one that names loss_function without calling it, gets here):
        # in a fused call the head returned the hidden states, so that loss is wrong. Refuse it.
        raise RuntimeError(
            f"ckpt_ext: {type(model).__name__}'s forward computed its loss without its loss_function, from the fused "
            "head's output (the hidden states, not logits): that loss would be wrong. Run Hugging Face's head and "
            "loss for this model: ckpt_ext.hf.head.unfuse_lm_head(model), or pass skip_logits=False")
    if bare:
        return output
    if isinstance(output, tuple):  # return_dict=False: (loss, logits, ...)
        return output[:1] + output[2:]
    fields = {k: v for k, v in output.items() if k != "logits"}
    return type(output)(**fields)


def head_refusal(model: nn.Module) -> Optional[str]:
    """Why ``model``'s head cannot be fused (None: it can)."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if type(head) is not nn.Linear and not isinstance(head, FusedLMHead):
        return f"its output embedding is {type(head).__name__}, not an nn.Linear"
    if not any(m is head for m in model._modules.values()):
        return "its output embedding is not a direct submodule"
    try:
        from transformers.loss.loss_utils import ForCausalLMLoss
    except ImportError:
        return "transformers' ForCausalLMLoss is not importable"
    loss = getattr(model, "loss_function", None)
    if loss is not ForCausalLMLoss and not isinstance(loss, FusedCausalLMLoss):
        return f"its loss_function is {getattr(loss, '__name__', type(loss).__name__)}, not ForCausalLMLoss"
    if "labels" not in inspect.signature(type(model).forward).parameters:
        return "its forward takes no labels"
    try:  # (getsource unwraps decorators)
        source = inspect.getsource(type(model).forward)
    except (OSError, TypeError):
        source = None
    if source is not None and "loss_function" not in source:
        # e.g. transformers 5.0's Gemma3ForConditionalGeneration, whose forward computes nn.CrossEntropyLoss itself:
        # handed the hidden states instead of the logits, it would compute a wrong loss
        return "its forward computes its loss without its loss_function"
    config = getattr(model, "config", None)
    for attr in _UNSUPPORTED_SCALING:
        if getattr(config, attr, None) not in (None, 1, 1.0):
            return f"its forward scales the logits (config.{attr})"
    return None


def fuse_lm_head(model: nn.Module, warn: bool = True) -> bool:
    """Makes ``model``'s head and loss one chunked operation in training with labels (see the module's
    docstring and docs/head.md); returns whether it did. Idempotent. A peft model: its base model's head."""
    base = getattr(model, "get_base_model", None)
    if callable(base) and base() is not model:
        return fuse_lm_head(base(), warn)
    state = model.__dict__.get("_ckpt_ext_head")
    if state is not None:  # fused before; a head replaced since (resize_token_embeddings) is wrapped again
        head = getattr(model, state.name)
        if type(head) is nn.Linear:
            setattr(model, state.name, FusedLMHead(head))
        return isinstance(getattr(model, state.name), FusedLMHead)
    why = head_refusal(model)
    if why is not None:
        if warn:
            warnings.warn(f"ckpt_ext.fuse: the head of {type(model).__name__} keeps Hugging Face's path: {why}",
                          stacklevel=3)
        return False
    head = model.get_output_embeddings()
    name = next(n for n, m in model._modules.items() if m is head)
    params = list(inspect.signature(type(model).forward).parameters)
    labels_pos = params.index("labels") - 1  # without self
    softcap_attr = "final_logit_softcapping" if hasattr(model.config, "final_logit_softcapping") else None
    state = _HeadState(name, labels_pos, model.loss_function, softcap_attr)
    setattr(model, name, FusedLMHead(head))
    object.__setattr__(model, "_ckpt_ext_head", state)
    model.loss_function = FusedCausalLMLoss(model, state)
    state.handles = (model.register_forward_pre_hook(_pre_hook, with_kwargs=True),
                     model.register_forward_hook(_post_hook, with_kwargs=True, always_call=True))
    return True


def unfuse_lm_head(model: nn.Module) -> None:
    """Undoes :func:`fuse_lm_head`: Hugging Face's head (a plain nn.Linear with the same Parameters) and loss."""
    base = getattr(model, "get_base_model", None)
    if callable(base) and base() is not model:
        return unfuse_lm_head(base())
    state = model.__dict__.pop("_ckpt_ext_head", None)
    if state is None:
        return
    for h in state.handles:
        h.remove()
    head = getattr(model, state.name)
    if isinstance(head, FusedLMHead):
        plain = nn.Linear(head.in_features, head.out_features, bias=head.bias is not None, device="meta")
        plain.weight, plain.bias = head.weight, head.bias
        setattr(model, state.name, plain)
    if isinstance(model.__dict__.get("_loss_function"), FusedCausalLMLoss):
        del model.__dict__["_loss_function"]
