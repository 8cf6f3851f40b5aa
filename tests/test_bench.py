"""The benchmark suite (python -m ckpt_ext.bench): a smoke run on a tiny model on CPU, and the
max-batch search against a fake step."""
import json
import math

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")
from ckpt_ext import bench  # noqa: E402

ROW_KEYS = {"variant", "batch", "tokens", "status", "step_s", "tokens_per_s", "activation_bytes", "saved_bytes",
            "pool_bytes", "peak_allocated_bytes", "peak_reserved_bytes", "budget_bytes", "note"}


def test_suite_smoke(tmp_path):
    result = bench.main(["--device", "cpu", "--model", "custom", "--layers", "2", "--hidden", "32", "--heads", "2",
                         "--seq", "16", "--batch", "2", "--variants", "none,ckpt_ext", "--repeat", "2",
                         "--warmup", "1", "--out", str(tmp_path), "--no-progress"])
    data = json.loads((tmp_path / "custom.json").read_text())
    assert data["rows"] == result["rows"]
    for key in ("device", "device_name", "torch", "cuda", "git_commit", "date"):
        assert key in data["env"]
    assert len(data["load_average"]["start"]) == 3
    assert data["config"]["layers"] == 2 and data["config"]["seq"] == 16 and data["config"]["batch"] == [2]
    rows = data["rows"]
    assert [(r["variant"], r["batch"]) for r in rows] == [("none", 2), ("ckpt_ext", 2)]
    for r in rows:
        assert set(r) == ROW_KEYS
        assert r["status"] == "ok"
        assert r["step_s"]["p20"] <= r["step_s"]["median"] <= r["step_s"]["p80"]
        assert math.isclose(r["tokens_per_s"], 2 * 16 / r["step_s"]["median"])
        assert r["activation_bytes"] > 0
        assert r["peak_allocated_bytes"] is None  # CPU
    none, ours = rows
    assert ours["activation_bytes"] < none["activation_bytes"]
    assert ours["pool_bytes"] == 0  # ckpt_ext.checkpoint keeps boundaries as saved inputs, not in the pool (issue 13)

    md = (tmp_path / "custom.md").read_text()
    assert "| variant | batch | status |" in md
    assert "| none | 2 | ok |" in md and "| ckpt_ext | 2 | ok |" in md
    png = tmp_path / "custom.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


TINY = ["--device", "cpu", "--model", "custom", "--layers", "2", "--hidden", "32", "--heads", "2", "--seq", "16",
        "--repeat", "1", "--warmup", "1", "--no-progress"]


def test_suite_reports_oom_and_failures(tmp_path, monkeypatch):
    """Out of memory (faked: CPU has none to run into) and a failing compile become statuses, not crashes."""
    step = bench.Suite.step

    def step_with_oom(self, v, batch):
        if v == "none" and batch > 2:
            raise torch.OutOfMemoryError("CUDA out of memory (fake)")
        return step(self, v, batch)

    class Broken(torch.nn.Module):
        def forward(self, *args, **kwargs):
            raise NotImplementedError("no backend (fake)")

    monkeypatch.setattr(bench.Suite, "step", step_with_oom)
    monkeypatch.setattr(torch, "compile", lambda model: Broken())
    fixed = bench.main(TINY + ["--batch", "4", "--variants", "none,ckpt_ext,compile-budget", "--out", str(tmp_path)])
    assert [r["status"] for r in fixed["rows"]] == ["oom", "ok", "error: NotImplementedError"]
    assert "| compile-budget | 4 | error: NotImplementedError |" in (tmp_path / "custom.md").read_text()
    found = bench.main(TINY + ["--batch", "max", "--max-batch", "4", "--variants", "none,ckpt_ext",
                               "--out", str(tmp_path)])
    assert found["max_batch"] == {"none": 2, "ckpt_ext": 4}
    assert [(r["variant"], r["batch"], r["status"]) for r in found["rows"]] == [("none", 2, "ok"), ("ckpt_ext", 4, "ok")]
    assert (tmp_path / "custom-max-batch.png").exists()


def _fake_step(threshold, tries, exc=lambda b: torch.OutOfMemoryError(f"CUDA out of memory at batch {b}")):
    def step(batch):
        tries.append(batch)
        if batch > threshold:
            raise exc(batch)
    return step


@pytest.mark.parametrize("threshold,cap,expected", [(37, 1000, 37), (1, 64, 1), (64, 64, 64), (5000, 64, 64),
                                                    (0, 64, 0), (63, 64, 63), (100, 100, 100)])
def test_max_batch_search(threshold, cap, expected):
    tries, freed = [], []
    got = bench.find_max_batch(_fake_step(threshold, tries), cap, free=lambda: freed.append(1))
    assert got == expected
    assert max(tries) <= cap
    assert len(freed) == sum(b > threshold for b in tries)  # memory is freed after every failed try
    assert len(tries) <= 2 * math.ceil(math.log2(cap)) + 2  # doubling, then bisection
    assert len(set(tries)) == len(tries)


def test_max_batch_search_oom_as_runtime_error():
    tries = []
    step = _fake_step(20, tries, exc=lambda b: RuntimeError(f"CUDA error: out of memory (batch {b})"))
    assert bench.find_max_batch(step, 128, free=lambda: None) == 20


def test_max_batch_search_other_errors_propagate():
    with pytest.raises(ValueError, match="boom"):
        bench.find_max_batch(_fake_step(3, [], exc=lambda b: ValueError("boom")), 16)


def test_parse_batches():
    assert bench.parse_batches("8,16,32") == [8, 16, 32]
    assert bench.parse_batches("MAX") == "max"
    with pytest.raises(Exception):
        bench.parse_batches("0,4")
