"""What the fused-layer tests (test_fused_*.py) share: a fixed seed per test (an autouse fixture the test files
import) and a fused model paired with a checkpointed copy."""
import contextlib
import copy
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import ckpt_ext
from ckpt_ext import fuse

from helpers.hf_models import embeds_call, layers_of, make_model


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@contextlib.contextmanager
def switched(setting, on):
    """A process-wide ``_C`` switch (``setting(value)`` sets it and returns the value before) set to `on` for the
    block, restored after."""
    before = setting(on)
    try:
        yield
    finally:
        setting(before)


def assert_switch_defaults_on(setting):
    """A process-wide ``_C`` switch is on by default and returns the setting before when set."""
    assert setting() is True
    assert setting(False) is True
    try:
        assert setting() is False
    finally:
        assert setting(True) is False


class CountCasts(TorchDispatchMode):
    """Counts ``aten._to_copy`` calls (autocast's and autograd's casts) under the mode."""

    def __init__(self):
        super().__init__()
        self.casts = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.casts += func._overloadpacket is torch.ops.aten._to_copy
        return func(*args, **(kwargs or {}))


def autocast_step(model, family, kw, device="cpu", dtype=torch.bfloat16):
    """One training step of a Hugging Face model (tests/helpers/hf_models.embeds_call) under autocast: (loss, output,
    the input embeddings' gradient, {parameter: gradient}); names without torch.compile's ``_orig_mod.``."""
    model.zero_grad(set_to_none=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        with torch.autocast(device, dtype=dtype):
            torch.manual_seed(7)
            emb, out = embeds_call(model, family, kw)
            loss = (out.float() * torch.linspace(-1, 1, out.shape[-1], device=device)).sum()
    loss.backward()
    grads = {n.removeprefix("_orig_mod."): p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), out.detach(), emb.grad.clone(), grads


def assert_identical_steps(a, b):
    """Two autocast_step results: bit-identical, every gradient of the same dtype."""
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and torch.equal(a[2], b[2])
    assert a[3].keys() == b[3].keys() and len(a[3]) > 0
    for name in a[3]:
        assert a[3][name].dtype == b[3][name].dtype and torch.equal(a[3][name], b[3][name]), name


def checkpointed(model, **options):
    """ckpt_ext.enable_checkpointing(model, **options), transformers' rename warnings silenced; the model."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        ckpt_ext.enable_checkpointing(model, **options)
    return model


# The checkpointing variants the autocast switch tests run (enable_checkpointing's options; None: fuse alone).
CHECKPOINTING = {"fuse": None, "every1": dict(every=1), "all": dict(every=3), "gemms": dict(every=1, keep="gemms")}


def lora_switch_steps(family, targets, switch, dropout, lora_dropout, checkpointing=None):
    """A tiny `family` model with peft LoRA (r=4) on `targets`, B not zero (peft's is: every adapter gradient
    informative), fused and checkpointed with `checkpointing` (None: not), one CPU-autocast bfloat16 step with
    ``switch(True)`` and one with ``switch(False)``. Asserts the two bit-identical (output, every gradient, adapters
    among them); returns the `aten._to_copy` counts {on: casts}."""
    peft = pytest.importorskip("peft")
    model = make_model(family, dropout=dropout, layers=2)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=lora_dropout,
                                                       target_modules=targets, fan_in_fan_out=family == "gpt2"))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    fused = fuse(model).train()
    if checkpointing is not None:
        checkpointed(fused, **checkpointing)
    from helpers.hf_models import inputs_for
    kw = inputs_for(family, padding=False)

    def step():
        fused.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            torch.manual_seed(3)
            out = fused(**kw).last_hidden_state
        out.float().pow(2).mean().backward()
        return out.detach(), {n: p.grad.clone() for n, p in fused.named_parameters() if p.grad is not None}

    runs, casts = {}, {}
    for on in (True, False):
        with switch(on), CountCasts() as count:
            runs[on] = step()
        casts[on] = count.casts
    assert torch.equal(runs[True][0], runs[False][0])
    assert runs[True][1].keys() == runs[False][1].keys() and any("lora" in n for n in runs[True][1])
    for n in runs[True][1]:
        assert torch.equal(runs[True][1][n], runs[False][1][n]), n
    return casts


def assert_same_step(a, b):
    """(output, {name: gradient}) of two steps: bit-identical, the same parameters."""
    assert torch.equal(a[0], b[0])
    assert a[1].keys() == b[1].keys()
    for name in a[1]:
        assert torch.equal(a[1][name], b[1][name]), name


def _checkpointed_pair(family, every, layers=3, dropout=0.2):
    model = fuse(make_model(family, dropout=dropout, layers=layers)).train()
    ck = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers' is_gradient_checkpointing rename
        ckpt_ext.enable_checkpointing(ck, every=every)
    return model, ck


class CountKernels(TorchDispatchMode):
    """Counts the GEMMs (keep.GEMM_OPS) and the attention kernels with a log-sum-exp (keep.LSE_OPS) a region runs:
    what a replay skips at each recompute level."""

    def __init__(self):
        super().__init__()
        self.gemms = self.attention = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from ckpt_ext.keep import GEMM_OPS, LSE_OPS
        self.gemms += func in GEMM_OPS
        self.attention += func in LSE_OPS
        return func(*args, **(kwargs or {}))


def held_step(model, kw, seed=1, autocast=False):
    """One training step of a model planned by ``budget=`` with the bytes it held from forward to backward
    (bench_budget.held_by_stack): (output, {name: gradient}, held bytes)."""
    from helpers import benchmarks  # noqa: F401  (puts benchmarks/ on sys.path)
    import bench_budget
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)

    def call(m):  # (autocast's cache of cast weights is freed when its region ends, before the bytes are counted)
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            return m(**kw).last_hidden_state.float()

    out, held = bench_budget.held_by_stack(model, layers_of(model), call)
    g = torch.Generator().manual_seed(seed + 100)
    (out * torch.randn(out.shape, generator=g)).sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, held
