"""Distributed training around models that use ckpt_ext, over gloo with 2 CPU processes.

DDP (find_unused_parameters off and on, static_graph) and FSDP2 (torch.distributed.fsdp.fully_shard, per
layer plus root, or root only) wrap:
* `shared`: ckpt_ext.checkpoint on each block call, one block used twice in a step (a parameter used by
  two checkpointed calls); with per-layer FSDP the blocks are FSDP units passed to checkpoint directly;
* `unused`: the same with a block that is never called (DDP's find_unused_parameters / static_graph);
* `stack`: ckpt_ext.enable_checkpointing(model, every=...) on a plain layer stack;
* `bert`, `llama`: tiny Hugging Face models (random weights) after ckpt_ext.fuse + enable_checkpointing
  (fused layers, C++ SegmentFunction), checkpointing enabled before or after sharding.
Dropout is on everywhere (Llama: attention dropout). Each case runs two training steps (SGD in between,
so the second step runs on updated parameters); every parameter's gradient of each step (FSDP: the
unsharded gradient) must equal a single-process reference without checkpointing (for `bert`/`llama` the
fused model without enable_checkpointing: Hugging Face's dropout draws other masks) that runs each rank's
half of the batch under that rank's seed and averages, as DDP and FSDP do. The masks are the same
because the RNG is seeded identically: nn.Dropout draws from the CPU generator and a replay restores its
state; fused layers draw one seed per layer call from it, in the same order with or without
checkpointing. Tolerance: rtol 1e-5, atol 1e-6 x the largest gradient of the model in that step (the
all-reduce/reduce-scatter sums in another order; some gradients, such as BERT's key bias, are zero up to
rounding).

Combinations that cannot work raise at the point of use and are tested here: enable_checkpointing
groups (every > 1) across layers that are separate FSDP units, FSDP units run inside a checkpointed
function (ckpt_ext.checkpoint of a module containing them), fused layers whose submodules are FSDP units.

All cases run in one spawned 2-process job (spawn + imports cost seconds on a small machine); the tests
check its results case by case. The ranks talk over loopback (MASTER_ADDR=127.0.0.1, GLOO_SOCKET_IFNAME=
the loopback interface): on the lent GPU machine every case had died with SIGSEGV in the spawned ranks.
With CUDA, DDP also runs over NCCL on one GPU (world size 1) against the same model without DDP.
"""
import datetime
import importlib.util
import os
import re
import tempfile
import traceback
from typing import Dict, List, NamedTuple, Optional

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import ckpt_ext

pytestmark = [pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo"),
              pytest.mark.slow]
WORLD = 2
STEPS = 2
LR = 0.1
RTOL, ATOL = 1e-5, 1e-6


# ---- models ----------------------------------------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc1, self.fc2, self.drop = nn.Linear(d, 2 * d), nn.Linear(2 * d, d), nn.Dropout(0.1)

    def forward(self, x):
        return x + self.drop(self.fc2(torch.tanh(self.fc1(x))))


class SharedNet(nn.Module):
    """blocks[0] runs twice per step, each time in its own checkpoint; with `unused`, one more block is
    never called."""

    def __init__(self, d=16, unused=False):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(4 if unused else 3))
        self.head = nn.Linear(d, 1)
        self.checkpointed = True

    def forward(self, x):
        for i in (0, 1, 0, 2):
            x = ckpt_ext.checkpoint(self.blocks[i], x, use_reentrant=False) if self.checkpointed else self.blocks[i](x)
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


class UnitsInsideNet(StackNet):
    """Checkpoints an nn.Sequential of two layers: with the layers sharded one by one, FSDP units run
    inside the checkpoint (an error)."""

    def forward(self, x):
        x = ckpt_ext.checkpoint(nn.Sequential(self.layers[0], self.layers[1]), x, use_reentrant=False)
        return self.head(self.layers[3](self.layers[2](x)))


HF = ("bert", "llama")  # Hugging Face model kinds
VOCAB, SEQ = 50, 8


def _hf_model(kind):
    from transformers import BertConfig, BertModel, LlamaConfig, LlamaModel

    if kind == "bert":
        cfg = BertConfig(hidden_size=32, num_attention_heads=4, intermediate_size=48, num_hidden_layers=4,
                         vocab_size=VOCAB, max_position_embeddings=SEQ, hidden_dropout_prob=0.1,
                         attention_probs_dropout_prob=0.1, pad_token_id=0)
        return BertModel(cfg, add_pooling_layer=False)
    cfg = LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
                      num_hidden_layers=4, vocab_size=VOCAB, max_position_embeddings=SEQ, attention_dropout=0.1,
                      pad_token_id=0, bos_token_id=None, eos_token_id=None)
    return LlamaModel(cfg)


def _layers(model):
    for path in ("blocks", "layers", "encoder.layer"):
        try:
            return model.get_submodule(path)
        except AttributeError:
            pass
    raise AttributeError(type(model).__name__)


def _build(kind, checkpointed=True):
    """The model of a case, weights from seed 0 (enable_checkpointing is applied by the caller)."""
    torch.manual_seed(0)
    if kind in ("shared", "unused"):
        model = SharedNet(unused=kind == "unused")
        model.checkpointed = checkpointed
        return model
    if kind in HF:
        return ckpt_ext.fuse(_hf_model(kind))
    return UnitsInsideNet() if kind == "units-inside" else StackNet()


def _loss(model, kind, rank, step, device="cpu"):
    """Forward and loss of `rank`'s half of step `step`'s batch, under that rank's seed (dropout)."""
    g = torch.Generator().manual_seed(10 + step)
    torch.manual_seed(1000 + 10 * step + rank)
    half = slice(rank * 2, (rank + 1) * 2)
    if kind in HF:
        ids = torch.randint(1, VOCAB, (2 * WORLD, SEQ), generator=g)
        mask = torch.ones(2 * WORLD, SEQ, dtype=torch.long)
        mask[1::2, SEQ - 3:] = 0  # padding in every second sequence
        extra = {"use_cache": False} if kind == "llama" else {}
        out = model(input_ids=ids[half].to(device), attention_mask=mask[half].to(device), **extra).last_hidden_state
        return out.pow(2).mean()
    x, y = torch.randn(2 * WORLD, 16, generator=g), torch.randn(2 * WORLD, 1, generator=g)
    return nn.functional.mse_loss(model(x[half].to(device)), y[half].to(device))


# ---- the cases -------------------------------------------------------------------------------------------------------
class Case(NamedTuple):
    kind: str
    every: int  # enable_checkpointing(every=...) for stack/bert/llama; 0: not applied
    wrapper: str  # ddp, ddp-find-unused, ddp-static, fsdp-layers (per layer + root), fsdp-root,
    #               fsdp-sublayers (BERT: each layer's attention + root)
    error: Optional[str] = None  # expected error (regex); None: gradients must match
    checkpointing_last: bool = False  # enable_checkpointing after DDP/fully_shard rather than before

    @property
    def name(self):
        name = f"{self.kind}-every{self.every}-{self.wrapper}" if self.every else f"{self.kind}-{self.wrapper}"
        return name + ("-checkpointing-last" if self.checkpointing_last else "")


DDP = ["ddp", "ddp-find-unused", "ddp-static"]
CASES = (
    [Case("shared", 0, w) for w in DDP + ["fsdp-layers", "fsdp-root"]]
    + [Case("unused", 0, w) for w in ("ddp-find-unused", "ddp-static", "fsdp-layers")]
    + [Case("stack", 2, w) for w in DDP + ["fsdp-root"]]
    + [Case("stack", 1, "fsdp-layers")]
    + [Case("bert", 2, w) for w in DDP + ["fsdp-root"]]
    + [Case("bert", 1, "fsdp-layers", checkpointing_last=True), Case("llama", 2, "ddp-static"),
       Case("llama", 1, "fsdp-layers")]
    # Combinations that raise; last, so that no model left half-way through a step precedes a case that must match.
    + [Case("stack", 2, "fsdp-layers", r"layers 0-1 are one checkpointed group, but layer 1 \(FSDPBlock\) is an "
                                       r"FSDP unit of its own .* use every=1"),
       Case("bert", 2, "fsdp-layers", r"but layer 1 \(FSDPFusedTransformerLayer\) is an FSDP unit of its own"),
       Case("units-inside", 0, "fsdp-layers",
            r"`Sequential` runs 2 module\(s\) sharded with torch.distributed.fsdp.fully_shard \(FSDPBlock\) inside"),
       Case("bert", 0, "fsdp-sublayers", r"fused BertLayer: weight attention.self.query.weight is a DTensor "
                                         r"\(a sharded parameter\).* shard the fused layer as one FSDP unit")]
)
if importlib.util.find_spec("transformers") is None:
    CASES = [c for c in CASES if c.kind not in HF]


def _wrap(model, wrapper):
    if wrapper.startswith("ddp"):
        kwargs = {"find_unused_parameters": wrapper == "ddp-find-unused", "static_graph": wrapper == "ddp-static"}
        return nn.parallel.DistributedDataParallel(model, **kwargs)
    from torch.distributed.fsdp import fully_shard

    if wrapper == "fsdp-layers":
        for layer in _layers(model):
            fully_shard(layer)
    elif wrapper == "fsdp-sublayers":
        for layer in _layers(model):
            fully_shard(layer.attention)
    return fully_shard(model)


def _grads(model) -> Dict[str, Optional[torch.Tensor]]:
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        if g is not None and hasattr(g, "full_tensor"):  # FSDP: a DTensor shard; gather the whole gradient
            g = g.full_tensor()
        out[name] = None if g is None else g.detach().clone()
    return out


def _sgd_step(model):
    # By hand: torch.optim's first use imports torch._dynamo (seconds).
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.add_(p.grad, alpha=-LR)
            p.grad = None


def _run_case(rank, case: Case) -> List[Dict[str, Optional[torch.Tensor]]]:
    model = _build(case.kind).train()
    if case.every and not case.checkpointing_last:
        ckpt_ext.enable_checkpointing(model, every=case.every, layers=_layers(model))
    wrapped = _wrap(model, case.wrapper)
    if case.every and case.checkpointing_last:
        ckpt_ext.enable_checkpointing(model, every=case.every, layers=_layers(model))
    steps = []
    for step in range(STEPS):
        _loss(wrapped, case.kind, rank, step).backward()
        steps.append(_grads(model))
        _sgd_step(model)
    if not case.every:  # checkpoint(unit, ...) replaces the unit's forward for the duration of the call only
        assert not any("forward" in m.__dict__ for m in model.modules()), "an instance forward was left behind"
    return steps


def _loopback_interface() -> str:
    """The name of the loopback interface (IFF_LOOPBACK), "lo" on Linux; gloo binds to it."""
    try:
        for name in sorted(os.listdir("/sys/class/net")):
            with open(f"/sys/class/net/{name}/flags") as f:
                if int(f.read(), 16) & 0x8:
                    return name
    except OSError:
        pass
    return "lo"


def _use_loopback():
    # Both ranks run on this machine: keep gloo on loopback rather than the interface the hostname
    # resolves to (on the lent GPU machine every case died with SIGSEGV in the spawned ranks).
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["GLOO_SOCKET_IFNAME"] = _loopback_interface()


def _worker(rank, out_dir):
    _use_loopback()
    # One thread per process: two processes with a thread per core each oversubscribe a small machine,
    # and OpenMP's spinning then makes tiny steps take seconds.
    torch.set_num_threads(1)
    # A file store: no TCP port to pick (a free port can be taken between picking and binding). The timeout
    # turns a rank left waiting in a collective into an error rather than a hung test.
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(out_dir, 'store')}", rank=rank,
                            world_size=WORLD, timeout=datetime.timedelta(seconds=60))
    try:
        results = {}
        for case in CASES:
            try:
                results[case.name] = _run_case(rank, case)
            except Exception as e:  # both ranks fail at the same point; the next case starts afresh
                results[case.name] = "".join(traceback.format_exception_only(type(e), e)).strip()
            dist.barrier()
        if rank == 0:
            torch.save(results, os.path.join(out_dir, "results.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results():
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_worker, args=(out_dir,), nprocs=WORLD, start_method="spawn")
        return torch.load(os.path.join(out_dir, "results.pt"))


_REFERENCES: Dict[str, List[Dict[str, Optional[torch.Tensor]]]] = {}


def _reference(kind):
    """Per step, the gradients DDP/FSDP should produce: each rank's half run in one process, averaged."""
    if kind not in _REFERENCES:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # as in the workers (see _worker); the results do not depend on it
        try:
            _REFERENCES[kind] = _reference_steps(kind)
        finally:
            torch.set_num_threads(threads)
    return _REFERENCES[kind]


def _reference_steps(kind):
    model = _build(kind, checkpointed=False).train()
    steps = []
    for step in range(STEPS):
        total = {n: None for n, _ in model.named_parameters()}
        for rank in range(WORLD):
            model.zero_grad(set_to_none=True)
            _loss(model, kind, rank, step).backward()
            for n, p in model.named_parameters():
                if p.grad is not None:
                    total[n] = p.grad / WORLD if total[n] is None else total[n] + p.grad / WORLD
        for n, p in model.named_parameters():
            p.grad = total[n]
        steps.append(total)
        _sgd_step(model)
    return steps


@pytest.mark.parametrize("case", [c for c in CASES if c.error is None], ids=lambda c: c.name)
def test_gradients_match_single_process(results, case):
    got = results[case.name]
    assert not isinstance(got, str), f"{case.name} failed in the workers: {got}"
    for step, (got_step, ref_step) in enumerate(zip(got, _reference(case.kind))):
        assert got_step.keys() == ref_step.keys()
        scale = max(g.abs().max().item() for g in ref_step.values() if g is not None)
        for n, ref in ref_step.items():
            assert (got_step[n] is None) == (ref is None), f"step {step}, {n}: gradient {got_step[n]} vs {ref}"
            if ref is not None:
                torch.testing.assert_close(got_step[n], ref, rtol=RTOL, atol=ATOL * scale,
                                           msg=lambda m: f"step {step}, {n}: {m}")


@pytest.mark.parametrize("case", [c for c in CASES if c.error is not None], ids=lambda c: c.name)
def test_unsupported_combination_raises_a_clear_error(results, case):
    got = results[case.name]
    assert isinstance(got, str), f"{case.name} ran without the expected error"
    assert re.search(case.error, got, re.S), got


# ---- CUDA: DDP over NCCL on one GPU (world size 1) -------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or not dist.is_nccl_available(), reason="needs CUDA and NCCL")
@pytest.mark.parametrize("kind, every", [("shared", 0), ("stack", 2)] + [(k, 2) for k in HF if k in {c.kind for c in CASES}])
def test_ddp_nccl_one_gpu_matches_the_model_without_ddp(tmp_path, kind, every):
    """The CUDA path of the DDP integration: gradient hooks fire from the C++ replay on a CUDA stream,
    NCCL all-reduces them. With one rank the gradients are the model's own (the mean over one rank)."""
    def steps(model, wrapped):
        out = []
        for step in range(STEPS):
            _loss(wrapped, kind, 0, step, device="cuda").backward()
            out.append(_grads(model))
            _sgd_step(model)
        return out

    reference = _build(kind, checkpointed=False).cuda().train()
    expected = steps(reference, reference)
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    try:
        model = _build(kind).cuda().train()
        if every:
            ckpt_ext.enable_checkpointing(model, every=every, layers=_layers(model))
        got = steps(model, nn.parallel.DistributedDataParallel(model, device_ids=[torch.cuda.current_device()]))
    finally:
        dist.destroy_process_group()
    for step, (got_step, ref_step) in enumerate(zip(got, expected)):
        assert got_step.keys() == ref_step.keys()
        scale = max(g.abs().max().item() for g in ref_step.values() if g is not None)
        for n, ref in ref_step.items():
            assert (got_step[n] is None) == (ref is None), f"step {step}, {n}"
            if ref is not None:
                torch.testing.assert_close(got_step[n], ref, rtol=RTOL, atol=ATOL * scale,
                                           msg=lambda m: f"step {step}, {n}: {m}")
