"""The soak's measurements and fault injection (benchmarks/soak.py): resident memory, the first difference between
a checkpointed model and its reference, and KeyboardInterrupts planted at a Python call of forward or at an
operator of backward."""
import os
import sys
from typing import Dict, Optional

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import ckpt_ext


# --------------------------------------------------------------------------------------------------
# Measurements
# --------------------------------------------------------------------------------------------------
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> Optional[int]:
    """Resident set size of this process now (Linux /proc/self/statm), or None where unavailable."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


def _in_replay() -> bool:
    """True while a checkpointed function is being replayed: is_recomputing(), or ckpt_ext's autograd node
    running (the fused SegmentFunction replays in C++ and does not set is_recomputing())."""
    if ckpt_ext.is_recomputing():
        return True
    node = torch._C._current_autograd_node() if hasattr(torch._C, "_current_autograd_node") else None
    name = node.name() if node is not None else ""
    return "CheckpointFunction" in name or "SegmentFunction" in name


class InterruptAtCall:
    """Raises KeyboardInterrupt at the start of the n-th Python function call (sys.setprofile) while
    active: where a real Ctrl-C lands, since Python delivers signals only while it runs bytecode. Calls of
    __enter__/__exit__ are not counted: an interrupt there breaks the context manager itself (torch.no_grad()
    left on), with or without ckpt_ext."""

    def __init__(self, n: int):
        self.n = n
        self.count = 0
        self.raised = False
        self.in_replay = False
        self.where = ""

    def _profile(self, frame, event, arg):
        if event != "call" or self.raised or frame.f_code.co_name in ("__enter__", "__exit__"):
            return
        self.count += 1
        if self.count == self.n:
            self.raised = True
            self.in_replay = _in_replay()
            self.where = f"{frame.f_code.co_name} ({os.path.basename(frame.f_code.co_filename)})"
            sys.setprofile(None)
            raise KeyboardInterrupt(f"soak: injected at Python call {self.n}")

    def __enter__(self):
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc):
        sys.setprofile(None)
        return False


class InterruptAtOp(TorchDispatchMode):
    """Raises KeyboardInterrupt at the n-th computing operator (matrix products, the fused kernels, ...)
    dispatched while active: reaches C++ code that runs no Python, such as the fused SegmentFunction's
    replay. Views, detach and copies are not counted: PyTorch's C++ autograd.Function dispatches them
    between wrapping its outputs and saving them, and an exception there leaks the node (a PyTorch bug,
    see docs/design.md)."""

    _COMPUTE = ("mm", "addmm", "bmm", "_softmax", "native_layer_norm", "gelu", "tanh", "mul", "add", "sum",
                "embedding", "masked_fill", "bias_gelu", "bias_dropout_add", "bias_dropout_add_layer_norm",
                "dropout", "native_layer_norm_backward", "_softmax_backward_data", "gelu_backward")

    def __init__(self, n: int):
        super().__init__()
        self.n = n
        self.count = 0
        self.raised = False
        self.in_replay = False
        self.where = ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.raised and func.overloadpacket.__name__ in self._COMPUTE:
            self.count += 1
            if self.count == self.n:
                self.raised = True
                self.in_replay = _in_replay()
                self.where = str(func)
                raise KeyboardInterrupt(f"soak: injected at operator {self.n} ({func})")
        return func(*args, **(kwargs or {}))


def _grads(model: nn.Module) -> Dict[str, Optional[torch.Tensor]]:
    return {n: p.grad for n, p in model.named_parameters()}


def _first_difference(loss_a, loss_b, model_a, model_b) -> Optional[str]:
    if not torch.equal(loss_a, loss_b):
        return f"loss {loss_a.item()!r} vs {loss_b.item()!r}"
    ga, gb = _grads(model_a), _grads(model_b)
    for name, a in ga.items():
        b = gb[name]
        if (a is None) != (b is None):
            return f"gradient of {name}: one is None"
        if a is not None and not torch.equal(a, b):
            return f"gradient of {name}: max abs difference {(a - b).abs().max().item():.3g}"
    return None


def inject_fault(p: dict, kind: str, n: int, ids, mask, seed: int) -> dict:
    """One faulty attempt at a step of p's checkpointed model; everything it made dies on return.
    forward-interrupt: KeyboardInterrupt at the n-th Python call of the forward (ckpt_ext's wrapper, the
    model's code, a replay's runner); backward-interrupt: at the n-th computing operator of the backward
    (often inside a replay, Python or C++); graph-dropped: the loss is computed and dropped."""
    torch.manual_seed(seed)
    trap = InterruptAtCall(n) if kind == "forward-interrupt" else InterruptAtOp(n)
    try:
        if kind == "forward-interrupt":
            with trap:
                p["loss"](p["ck"], ids, mask)
        else:
            loss = p["loss"](p["ck"], ids, mask)
            if kind == "backward-interrupt":
                with trap:
                    loss.backward()
    except KeyboardInterrupt:
        pass
    return {"kind": kind, "n": n, "raised": trap.raised, "in_replay": trap.in_replay, "where": trap.where}


def drain_autograd_queue():
    """Runs a trivial backward. After an exception in backward, PyTorch's autograd engine leaves the tasks
    it had queued in this thread's ready queue, and with them the part of the graph they reference (pooled
    boundaries included), until the next backward on the thread pops and discards them. Plain PyTorch
    does the same with ordinary activations; the pool is checked after this."""
    torch.zeros((), requires_grad=True).backward()
