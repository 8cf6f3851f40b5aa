"""`make bench`'s driver (benchmarks/bench_all.py) and README's plot (benchmarks/plot_results.py): the committed
H200 results read as README states them, bench_fused's results read and plotted, and bench_all's summary built
from its parts' results -- the parts themselves replaced by the committed CPU results, so nothing is timed here."""
import os
import shutil
from types import SimpleNamespace

import pytest

pytest.importorskip("matplotlib")
import helpers.benchmarks  # noqa: E402,F401  (puts benchmarks/ on sys.path)
import bench_all  # noqa: E402
import plot_results  # noqa: E402

RESULTS = os.path.join(helpers.benchmarks.BENCH, "results")
H200 = os.path.join(RESULTS, "h200")
CPU = os.path.join(RESULTS, "cpu")
README = os.path.join(os.path.dirname(helpers.benchmarks.BENCH), "README.md")


def _png(path) -> bool:
    with open(path, "rb") as f:
        return f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_h200_results_read_as_committed():
    panels = plot_results.load_all([H200])
    titles = [p["title"] for p in panels]
    assert titles[0].startswith("BERT-large s512 b32, bf16") and titles[1].startswith("BERT-large s512 b32, autocast")
    assert [t.split()[0] for t in titles[2:]] == ["GPT-2", "Llama", "Llama"] and "cudnn-sdp-off" in titles[4]
    assert {p["device"] for p in panels} == {"NVIDIA H200"} and {p["torch"] for p in panels} == {"2.11.0+cu130"}
    gpt2 = {r["variant"]: r for r in panels[2]["rows"]}
    assert round(gpt2["fused+ckpt"]["step_ms"], 1) == 105.5 and round(gpt2["fused+ckpt"]["peak_mib"]) == 1757
    llama = {r["variant"]: r for r in panels[3]["rows"]}
    assert llama["fused+keep"]["step_ms"] is None and "cuDNN" in llama["fused+keep"]["error"]
    table = plot_results.summary_table(panels)
    assert "| fuse + enable_checkpointing | 105.5 | 0.881 | 1757 |" in table
    assert '| fuse + keep="attention" | RuntimeError | | |' in table


def test_readme_headline_matches_committed_h200_results():
    """Every (step ms, × HF eager, peak MiB) triple of the summary appears in README's table."""
    with open(README) as f:
        readme = f.read()
    for line in plot_results.summary_table(plot_results.load_all([H200])).splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[3]:  # a measured row (an error row has no ratio)
            assert f"| {cells[2]} | " in readme and f"{cells[3]}" in readme and f"| {cells[4]} |" in readme, line


def test_plot_from_side_by_side_and_bench_fused(tmp_path):
    out = plot_results.plot(plot_results.load_all([H200]), str(tmp_path / "h200.png"), "caption")
    assert _png(out)
    panels = plot_results.load(os.path.join(CPU, "fused.json"))
    assert len(panels) == 4 and all(len(p["rows"]) == 5 for p in panels)
    assert all(r["step_ms"] > 0 and r["peak_mib"] > 0 for p in panels for r in p["rows"])
    assert panels[0]["peak"] == "activations held fwd→bwd"  # CPU: no allocator statistics (plotted in the next test)


def test_plot_results_refuses_other_json(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text('{"a": 1}')
    with pytest.raises(ValueError, match="neither side_by_side"):
        plot_results.load(str(bad))
    os.makedirs(tmp_path / "empty")
    with pytest.raises(SystemExit, match="no side_by_side"):
        plot_results.load_all([str(tmp_path / "empty")])


def test_bench_all_summary_from_its_parts(tmp_path, monkeypatch, capsys):
    """bench_all runs each part as `python <script> --device D --out OUT ...`; here each "run" copies the
    committed CPU result of that script into OUT, and one part fails."""
    calls = []

    def fake_run(argv, cwd=None):
        calls.append(argv)
        script, out = os.path.basename(argv[1]), argv[argv.index("--out") + 1]
        stem = {"bench_checkpoint.py": "engine", "bench_ops.py": "ops", "bench_fused.py": "fused"}[script]
        os.makedirs(out, exist_ok=True)
        shutil.copy(os.path.join(CPU, stem + ".json"), os.path.join(out, stem + ".json"))
        return SimpleNamespace(returncode=0)

    monkeypatch.setattr(bench_all, "subprocess", SimpleNamespace(run=fake_run))
    assert bench_all.main(["--device", "cpu", "--out", str(tmp_path)]) == 0
    assert [os.path.basename(c[1]) for c in calls] == ["bench_checkpoint.py", "bench_ops.py", "bench_fused.py"]
    assert "--skip-bert" in calls[0] and calls[2][-4:] == ["--rounds", "5", "--warmup", "1"]
    quick = bench_all.part_argv("fused", "cpu", "o", quick=True)
    assert quick.count("--rounds") == 1 and quick[quick.index("--rounds") + 1] == "2" and "--configs" in quick
    summary = (tmp_path / "summary.md").read_text()
    assert summary in capsys.readouterr().out
    assert "| model | variant | step ms | × HF eager | peak MiB |" in summary
    assert "per checkpointed call: ckpt_ext.checkpoint" in summary and "blocks ending in a GEMM" in summary
    assert "fused ops, float32: eager / ours median" in summary and "fused ops, bfloat16" in summary
    assert _png(tmp_path / "step_vs_memory.png")

    def failing_run(argv, cwd=None):
        return SimpleNamespace(returncode=3)

    monkeypatch.setattr(bench_all, "subprocess", SimpleNamespace(run=failing_run))
    assert bench_all.main(["--device", "cpu", "--parts", "ops", "--quick", "--out", str(tmp_path / "f")]) == 1
    assert "ops 0 s FAILED" in (tmp_path / "f" / "summary.md").read_text()


def test_bench_all_rejects_unknown_parts():
    with pytest.raises(SystemExit):
        bench_all.main(["--parts", "ops,nope"])
