"""The fault tests' models, traps and checks (test_faults.py says how faults are planted and what is checked
after each), and the fixtures it imports: one intra-op thread, and `path`, the four checkpointing paths."""
import contextlib
import copy
import warnings

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import ckpt_ext

D = 24
BATCH = 6


class Interrupt(BaseException):
    """A KeyboardInterrupt-like exception of the user's own (not an Exception)."""


EXCEPTIONS = [RuntimeError, KeyboardInterrupt, Interrupt]


# --------------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------------
def settle():
    torch.zeros((), requires_grad=True).backward()  # discards tasks a failed backward left queued


def in_use():
    settle()
    return ckpt_ext.pool_stats("cpu")["in_use_bytes"]


def autocast_nesting():
    n = torch.autocast_increment_nesting()
    torch.autocast_decrement_nesting()
    return n - 1


def thread_state():
    return dict(recomputing=ckpt_ext.is_recomputing(), grad=torch.is_grad_enabled(),
                autocast=torch.is_autocast_enabled("cpu"), autocast_dtype=torch.get_autocast_dtype("cpu"),
                nesting=autocast_nesting())


def raise_caught(fn, exc_type):
    """Runs fn, which must raise exc_type (exactly that type: not wrapped, not converted); returns the
    exception's text and notes. The exception object is not kept: its traceback holds the graph."""
    try:
        fn()
    except BaseException as e:  # noqa: B902 -- KeyboardInterrupt and Interrupt are the point
        assert type(e) is exc_type, f"expected {exc_type.__name__}, got {type(e).__name__}: {e}"
        return str(e), list(getattr(e, "__notes__", []))
    raise AssertionError(f"{exc_type.__name__} was not raised")


def grads(model):
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def assert_same_grads(a, b):
    assert a.keys() == b.keys()
    for n in a:
        assert (a[n] is None) == (b[n] is None), n
        assert a[n] is None or torch.equal(a[n], b[n]), n


class Trap(nn.Module):
    """Identity, until armed: then raises once, in forward or only in a replay (after `skip` calls of that
    kind)."""

    def __init__(self):
        super().__init__()
        self.armed = None  # [phase: "forward" | "replay", exception type, message, calls to skip]

    def arm(self, phase, exc_type, message="trapped", skip=0):
        self.armed = [phase, exc_type, message, skip]

    def forward(self, x):
        if self.armed is not None:
            phase, exc_type, message, skip = self.armed
            if (phase == "replay") == ckpt_ext.is_recomputing():
                if skip:
                    self.armed[3] -= 1
                else:
                    self.armed = None
                    raise exc_type(message)
        return x


class OpTrap(TorchDispatchMode):
    """Raises at the n-th call of an operator while active (reaches C++ code that runs no Python)."""

    def __init__(self, op, n, exc_type, message="trapped"):
        super().__init__()
        self.op, self.n, self.exc_type, self.message = op, n, exc_type, message
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is self.op:
            self.count += 1
            if self.count == self.n:
                raise self.exc_type(self.message)
        return func(*args, **(kwargs or {}))


# --------------------------------------------------------------------------------------------------
# The three paths, each a checkpointed model and the same model without checkpointing
# --------------------------------------------------------------------------------------------------
def make_block():
    return nn.Sequential(nn.Linear(D, 2 * D), nn.BatchNorm1d(2 * D), Trap(), nn.GELU(), nn.Dropout(0.2),
                         nn.Linear(2 * D, D))


class Net(nn.Module):
    def __init__(self, n=4, wrap=False):
        super().__init__()
        self.blocks = nn.ModuleList(make_block() for _ in range(n))
        self.head = nn.Linear(D, 3)
        self.wrap = wrap  # each block through ckpt_ext.checkpoint
        self.seen = None  # a list: collects what the loop passes on after each block

    def forward(self, x):
        for b in self.blocks:
            x = ckpt_ext.checkpoint(b, x, use_reentrant=False) if self.wrap else b(x)
            if self.seen is not None:
                self.seen.append(x)
        return self.head(x)


class Path:
    """A checkpointed model `ck`, its reference `ref` (same weights, not checkpointed), inputs, a step,
    and how to plant a fault in forward or in the replay."""

    def __init__(self, kind):
        self.kind = kind
        torch.manual_seed(0)
        if kind in ("checkpoint", "stack"):
            self.ref = Net().train()
            self.ck = copy.deepcopy(self.ref)
            if kind == "checkpoint":
                self.ck.wrap = True
            else:
                ckpt_ext.enable_checkpointing(self.ck, every=2, layers=self.ck.blocks)
            gen = torch.Generator().manual_seed(1)
            self.inputs = {"x": torch.randn(BATCH, D, generator=gen)}
        else:
            from transformers import BertConfig, BertModel, GPT2Config, GPT2Model
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                if kind == "fused-bert":
                    model = BertModel(BertConfig(hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
                                                 intermediate_size=48, vocab_size=50, hidden_dropout_prob=0.1,
                                                 attention_probs_dropout_prob=0.1), add_pooling_layer=False)
                    every = 2
                else:
                    model = GPT2Model(GPT2Config(n_embd=32, n_layer=3, n_head=2, vocab_size=50, bos_token_id=0,
                                                 eos_token_id=0))
                    every = 1
                self.ref = ckpt_ext.fuse(model).train()
                self.ck = ckpt_ext.enable_checkpointing(copy.deepcopy(self.ref), every=every)
            gen = torch.Generator().manual_seed(1)
            mask = torch.ones(3, 11, dtype=torch.long)
            mask[1, 7:] = 0
            self.inputs = {"input_ids": torch.randint(0, 50, (3, 11), generator=gen), "attention_mask": mask}

    @property
    def fused(self):
        return self.kind.startswith("fused")

    def trap(self):
        return self.trap_of(self.ck)

    @staticmethod
    def trap_of(model):
        return model.blocks[2][2]  # in the last group of the stack, after its BatchNorm

    def batchnorm(self):
        return self.ck.blocks[2][1]

    def loss(self, model=None, seed=7):
        model = model or self.ck
        torch.manual_seed(seed)
        if self.fused:
            out = model(**self.inputs, **({"use_cache": False} if self.kind == "fused-gpt2" else {})).last_hidden_state
        else:
            out = model(self.inputs["x"])
        return (out ** 2).mean()

    def planted(self, phase, exc_type, message="trapped"):
        """A context manager around the forward (phase "forward") or the backward (phase "replay") that
        makes the fault happen there."""
        if self.fused:
            # The first fused GELU of the forward; the second one of the backward, which is in a replay. (GPT-2's
            # replays stop before their last layer's GELU, whose backward writes it -- issue 33 --: its second LN2.)
            op = torch.ops.ckpt_ext.bias_gelu.default
            if phase != "forward" and self.kind == "fused-gpt2":
                op = torch.ops.ckpt_ext.bias_dropout_add_layer_norm.default
            return OpTrap(op, 1 if phase == "forward" else 2, exc_type, message)
        self.trap().arm(phase, exc_type, message)
        return contextlib.nullcontext()

    def step(self, model, seed=11):
        model.zero_grad(set_to_none=True)
        loss = self.loss(model, seed)
        loss.backward()
        return loss.detach(), grads(model)

    def assert_next_step_right(self):
        """A whole step of the checkpointed model gives the reference's loss and gradients, bit for bit."""
        # BatchNorm statistics may differ after a fault in forward (the reference did not run it); training
        # uses batch statistics, so the step's results do not depend on them.
        loss_ck, g_ck = self.step(self.ck)
        loss_ref, g_ref = self.step(self.ref)
        assert torch.equal(loss_ck, loss_ref)
        assert_same_grads(g_ck, g_ref)
        assert not ckpt_ext.is_recomputing()


PATHS = ["checkpoint", "stack", "fused-bert", "fused-gpt2"]


@pytest.fixture(autouse=True)
def _one_thread():
    # Tiny tensors: a second thread only waits (on a loaded machine, 100x slower steps).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(params=PATHS)
def path(request):
    if request.param.startswith("fused"):
        pytest.importorskip("transformers")
    return Path(request.param)
