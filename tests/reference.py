"""Reference models and helpers shared by the tests and the benchmarks.

    from reference import make_stack, run_step, assert_grads_close

(pytest puts tests/ on sys.path; a benchmark adds it itself.) A *step* is one forward and one
backward of a fixed random projection of every floating output, so that each output element gets
its own gradient; it returns the outputs, the inputs' gradients and every parameter's gradient.
"""
from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils import _pytree as pytree

__all__ = [
    "MLPBlock",
    "make_block",
    "make_stack",
    "chain",
    "leaf_inputs",
    "StepResult",
    "loss_of",
    "run_step",
    "assert_grads_close",
]

# The projection used as loss comes from its own generator: drawing it must not move the global
# RNG, which the dropout of the runs being compared depends on.
_PROJECTION_SEED = 1234


class MLPBlock(nn.Module):
    """Pre-norm residual MLP: x + dropout(fc2(gelu(fc1(layernorm(x))))). Odd sizes on purpose."""

    def __init__(self, dim: int = 19, hidden: int = 37, p: float = 0.1):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.norm(x)))))


def make_block(dim: int = 19, hidden: int = 37, p: float = 0.1, seed: int = 0, dtype=torch.float32) -> MLPBlock:
    """An MLPBlock with weights drawn from `seed` (the global RNG is left as it was)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return MLPBlock(dim, hidden, p).to(dtype)


def make_stack(n: int = 4, dim: int = 19, hidden: int = 37, p: float = 0.1, seed: int = 0,
               dtype=torch.float32) -> nn.Sequential:
    """n MLPBlocks in an nn.Sequential, weights drawn from `seed`."""
    return nn.Sequential(*[make_block(dim, hidden, p, seed * 1000 + i, dtype) for i in range(n)])


def chain(blocks: Sequence[Callable], wrap: Optional[Callable] = None) -> Callable:
    """A function running `blocks` one after the other, each through `wrap(block, x)` when given
    (e.g. ``wrap=ckpt_ext.checkpoint``), so that one checkpoint call follows another."""

    def run(x):
        for b in blocks:
            x = wrap(b, x) if wrap is not None else b(x)
        return x

    return run


def leaf_inputs(*shapes, seed: int = 0, requires_grad: Union[bool, Sequence[bool]] = True,
                dtype=torch.float32, device="cpu") -> List[torch.Tensor]:
    """Fresh random leaf tensors of the given shapes, drawn from `seed` (global RNG untouched)."""
    flags = [requires_grad] * len(shapes) if isinstance(requires_grad, bool) else list(requires_grad)
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen, dtype=torch.float32).to(dtype=dtype, device=device).requires_grad_(f)
            for s, f in zip(shapes, flags)]


class StepResult(NamedTuple):
    outputs: Any                                   # the function's result, tensors detached
    input_grads: List[Optional[torch.Tensor]]      # one per tensor input, None where it had none
    param_grads: Dict[str, Optional[torch.Tensor]]  # every parameter, None where it got none


def _named_params(model_fn: Any) -> Dict[str, torch.Tensor]:
    if isinstance(model_fn, nn.Module):
        return dict(model_fn.named_parameters())
    owner = getattr(model_fn, "__self__", None)
    if isinstance(owner, nn.Module):
        return dict(owner.named_parameters())
    return {}


def _projection(t: torch.Tensor, index: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(_PROJECTION_SEED + index)
    return torch.randn(t.shape, generator=gen, dtype=torch.float32).to(t.device)


def loss_of(outputs: Any) -> torch.Tensor:
    """Sum of a fixed random projection of every floating tensor in `outputs` that requires grad."""
    leaves = [t for t in pytree.tree_leaves(outputs)
              if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad]
    assert leaves, "run_step: the function returned no tensor that requires grad"
    return sum((t.float() * _projection(t, i)).sum() for i, t in enumerate(leaves))


def run_step(model_fn: Callable, inputs: Sequence[Any], *, params: Optional[Mapping[str, torch.Tensor]] = None,
             kwargs: Optional[Mapping[str, Any]] = None, seed: Optional[int] = None) -> StepResult:
    """One forward + backward of ``model_fn(*inputs, **kwargs)``.

    Tensor inputs are replaced by fresh leaf copies (same requires_grad), so two runs on the same
    inputs never share gradients. `params` defaults to the named parameters of `model_fn` (a module
    or a bound method of one); their .grad is cleared before the step and after it is collected.
    `seed` reseeds the global RNG right before the forward (dropout)."""
    params = dict(params) if params is not None else _named_params(model_fn)
    for p in params.values():
        p.grad = None
    leaves = [t.detach().clone().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t
              for t in inputs]
    if seed is not None:
        torch.manual_seed(seed)
    out = model_fn(*leaves, **dict(kwargs or {}))
    loss_of(out).backward()
    outputs = pytree.tree_map(lambda v: v.detach() if isinstance(v, torch.Tensor) else v, out)
    input_grads = [t.grad for t in leaves if isinstance(t, torch.Tensor)]
    param_grads = {n: (p.grad.clone() if p.grad is not None else None) for n, p in params.items()}
    for p in params.values():
        p.grad = None
    return StepResult(outputs, input_grads, param_grads)


def _check(what: str, a: Any, b: Any, rtol: float, atol: float, exact: bool):
    if a is None or b is None:
        assert a is None and b is None, f"{what}: one is None, the other is not ({type(a).__name__} vs {type(b).__name__})"
        return
    if not isinstance(a, torch.Tensor):
        assert a == b, f"{what}: {a!r} != {b!r}"
        return
    assert isinstance(b, torch.Tensor), f"{what}: tensor vs {type(b).__name__}"
    assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    if exact:
        assert torch.equal(a, b), f"{what}: not bit-identical, max abs diff {(a.double() - b.double()).abs().max().item()}"
    else:
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def assert_grads_close(a: StepResult, b: StepResult, rtol: float = 1e-5, atol: float = 1e-6, exact: bool = False):
    """Compares two run_step results: the outputs (same structure, tensors close, other leaves
    equal), every input gradient and every parameter gradient. A gradient that is None on one side
    only fails. `exact=True` demands bit-identical tensors (torch.equal)."""
    out_a, spec_a = pytree.tree_flatten(a.outputs)
    out_b, spec_b = pytree.tree_flatten(b.outputs)
    assert spec_a == spec_b, f"outputs differ in structure:\n{spec_a}\nvs\n{spec_b}"
    for i, (x, y) in enumerate(zip(out_a, out_b)):
        _check(f"output leaf {i}", x, y, rtol, atol, exact)
    assert len(a.input_grads) == len(b.input_grads), "different numbers of tensor inputs"
    for i, (x, y) in enumerate(zip(a.input_grads, b.input_grads)):
        _check(f"grad of input {i}", x, y, rtol, atol, exact)
    assert a.param_grads.keys() == b.param_grads.keys(), (
        f"different parameters: {sorted(a.param_grads)} vs {sorted(b.param_grads)}")
    for name in a.param_grads:
        _check(f"grad of parameter {name!r}", a.param_grads[name], b.param_grads[name], rtol, atol, exact)
