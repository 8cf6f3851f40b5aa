"""DDP over gloo with 2 CPU processes around models that use ckpt_ext, one block used twice in a
step: the averaged gradients equal the single-process reference. (Reentrant checkpointing fails
here with DDP's "marked ready twice"; ckpt_ext passes parameters through the outer graph once.)"""
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import ckpt_ext

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")
WORLD = 2


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc1, self.fc2, self.drop = nn.Linear(d, 2 * d), nn.Linear(2 * d, d), nn.Dropout(0.1)

    def forward(self, x):
        return x + self.drop(self.fc2(torch.tanh(self.fc1(x))))


class SharedNet(nn.Module):
    """blocks[0] runs twice per step, each time in its own checkpoint."""

    def __init__(self, d=16, mode="checkpoint"):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(3))
        self.head = nn.Linear(d, 1)
        self.mode = mode

    def forward(self, x):
        order = [0, 1, 0, 2]
        for i in order:
            if self.mode == "checkpoint":
                x = ckpt_ext.checkpoint(self.blocks[i], x)
            else:
                x = self.blocks[i](x)
        return self.head(x)


class StackNet(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.layers = nn.ModuleList(Block(d) for _ in range(4))
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _build(kind):
    torch.manual_seed(0)
    if kind == "shared":
        return SharedNet(mode="checkpoint")
    model = StackNet()
    ckpt_ext.enable_checkpointing(model, every=2)
    return model


def _data():
    g = torch.Generator().manual_seed(5)
    return torch.randn(WORLD * 4, 16, generator=g), torch.randn(WORLD * 4, 1, generator=g)


def _shard_grads(model, x, y, seed):
    torch.manual_seed(seed)
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()


def _worker(rank, kind, out_dir, ddp_kwargs):
    # A file store: no TCP port to pick (a free port can be taken between picking and binding).
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(out_dir, 'store')}", rank=rank,
                            world_size=WORLD)
    try:
        model = _build(kind).train()
        ddp = nn.parallel.DistributedDataParallel(model, **ddp_kwargs)
        x, y = _data()
        for step in range(2):  # two steps: the second one runs with DDP's buckets rebuilt
            ddp.zero_grad(set_to_none=True)
            _shard_grads(ddp, x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4], seed=100 * step + rank)
        if rank == 0:
            torch.save({n: p.grad for n, p in model.named_parameters()}, os.path.join(out_dir, "grads.pt"))
    finally:
        dist.destroy_process_group()


def _reference(kind):
    model = _build(kind).train()
    if kind == "shared":
        model.mode = "plain"
    else:
        ckpt_ext.disable_checkpointing(model)
    x, y = _data()
    total = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for rank in range(WORLD):  # DDP averages the per-rank gradients of the last step
        model.zero_grad(set_to_none=True)
        _shard_grads(model, x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4], seed=100 + rank)
        for n, p in model.named_parameters():
            total[n] += p.grad / WORLD
    return total


@pytest.mark.slow
@pytest.mark.parametrize("kind,ddp_kwargs", [
    ("shared", {}),
    ("shared", {"find_unused_parameters": True}),
    ("stack", {}),
])
def test_ddp_gloo_matches_single_process(kind, ddp_kwargs):
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_worker, args=(kind, out_dir, ddp_kwargs), nprocs=WORLD,
                           start_method="spawn")
        got = torch.load(os.path.join(out_dir, "grads.pt"))
    ref = _reference(kind)
    assert got.keys() == ref.keys()
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")
