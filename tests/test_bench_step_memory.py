"""The step-memory accounting of issue 37 (benchmarks/bench_step_memory.py): its timeline on hand-made events, the
allocator events it reads, and a tiny Llama's step accounted without computing -- affine in the layers (the
extrapolation exact), one boundary per layer, no vocabulary-sized tensor with the fused head, the same peak as a
computed run where the same allocations happen. No timings."""
import pytest
import torch

from tests.helpers import benchmarks  # noqa: F401  (puts benchmarks/ on sys.path)

pytest.importorskip("transformers")
import bench_step_memory as bsm  # noqa: E402
import ckpt_ext  # noqa: E402
from ckpt_ext import head as head_mod  # noqa: E402

CPU = torch.device("cpu")


def test_timeline_by_hand():
    # (time, address, +bytes allocated / -bytes freed, op)
    events = [(0, 100, 10, "a"), (1, 200, 50, "grad"), (2, 300, 30, "b"), (3, 100, -10, "a"),
              (4, 400, 25, "c"), (5, 300, -30, "b"), (6, 999, -7, "before")]
    t = bsm.timeline(events, grad_spans=[(210, 8)])  # a .grad viewing the allocation at 200
    assert t["grad_bytes"] == 50
    assert t["peak_with_grads_bytes"] == 50 + 30 + 25  # at time 4
    assert t["peak_bytes"] == 30 + 25  # at time 4 too, without the gradient (time 2: 10 + 30)
    assert [(a["op"], a["bytes"]) for a in t["at_peak"]] == [("b", 30), ("c", 25)]


def test_allocations_are_the_allocators():
    def fn():
        a = torch.empty(1000)
        b = torch.empty(10, dtype=torch.float64)
        del a
        return b
    ev = bsm.allocations(fn, CPU)
    sizes = [e[2] for e in ev]
    assert sizes[:3] == [4000, 80, -4000]


def _tiny_step_events(variant: str, compute: bool, seq: int = 96):
    model = bsm.setup(bsm.build(dict(bsm.TINY), 2, CPU, compute), variant)
    ids = torch.randint(0, bsm.TINY["vocab_size"], (1, seq))

    def step():
        with bsm._executing(compute, CPU):
            model(input_ids=ids, labels=ids).loss.backward()
    return bsm.allocations(step, CPU)


def test_fused_head_allocates_no_logits(monkeypatch):
    """With the fused head no allocation of the step reaches the batch's logits (N x V, bf16), in chunks of 32
    rows; Hugging Face's head allocates several float32 ones."""
    monkeypatch.setattr(head_mod, "CHUNK_ROWS", 32)
    n, vocab = 96, bsm.TINY["vocab_size"]
    chunk = ckpt_ext.pool_chunk_bytes(CPU)
    ckpt_ext.set_pool_chunk_bytes(n * bsm.TINY["hidden_size"] * 2, CPU)  # a boundary each, not 4 MiB chunks
    try:
        fused = max(e[2] for e in _tiny_step_events("fused-head", False))
        hf = max(e[2] for e in _tiny_step_events("hf-head", False))
    finally:
        ckpt_ext.set_pool_chunk_bytes(chunk, CPU)
    assert fused <= 32 * vocab * 4 < n * vocab * 2  # one chunk's float32 logits at most
    assert hf >= n * vocab * 4


def test_tiny_step_is_affine_in_layers(tmp_path):
    result = bsm.main(["--device", "cpu", "--tiny", "--out", str(tmp_path)])
    pc = result["peak"]
    boundary = pc["batch"] * pc["seq"] * bsm.TINY["hidden_size"] * 2
    assert pc["boundary_bytes"] == boundary and pc["layer"]["peak_bytes"] > 2 * boundary
    for name, v in pc["variants"].items():
        assert v["affine"] and v["measured_at_full"], name  # the tiny model has 4 layers: traced too
        assert v["extrapolated_peak_bytes"] == v["peak_bytes"], name
        assert v["check"]["traced"] == v["check"]["extrapolated"], name  # 4 layers, traced and extrapolated
        # one boundary per layer (in a pool chunk of its own, with the pool's alignment): nothing else grows
        assert boundary <= v["per_layer_bytes"] <= boundary + ckpt_ext.pool_min_chunk_bytes(), name
        assert v["bound_bytes"] == pc["layers"] * boundary + pc["layer"]["peak_bytes"]
        assert v["ratio"] == pytest.approx(v["peak_bytes"] / v["bound_bytes"])
    assert pc["variants"]["fused-head"]["peak_bytes"] < pc["variants"]["hf-head"]["peak_bytes"]
    assert (tmp_path / "bench_step_memory.md").exists() and "| fused-head |" in result["markdown"]


def test_accounting_against_a_computed_run():
    """The same step accounted (no compute) and computed on CPU: Hugging Face's head step peaks at the same bytes
    exactly; with the fused head the computed run can only add (what CPU kernels allocate for themselves: GEMM
    packing, the flash kernel's buffers), never miss what the accounting sees."""
    got = bsm.validate(None)
    hf, fused = got["hf-head"], got["fused-head"]
    assert hf["accounted"]["peak_bytes"] == hf["computed"]["peak_bytes"]
    assert fused["accounted"]["peak_bytes"] <= fused["computed"]["peak_bytes"] <= 1.1 * fused["accounted"]["peak_bytes"]
    for r in (hf, fused):
        assert r["accounted"]["grad_bytes"] == r["computed"]["grad_bytes"] > 0
