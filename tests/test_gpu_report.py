"""The GPU report (tools/gpu_report.py, `bash tools/gpu_session.sh report`): its dry run end to end on CPU, so a broken
report is found before a GPU is lent, and the readers of what the sections write (side_by_side.py's JSON, pytest's
-v log, bench_compile.py's JSON whatever its layout) on fixed inputs."""
import importlib.util
import json
import os
import subprocess
import sys
import tarfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Loaded from its file: tools/ on sys.path would put its build.py, compat.py ... before other packages.
_spec = importlib.util.spec_from_file_location("gpu_report", os.path.join(ROOT, "tools", "gpu_report.py"))
gpu_report = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_report)


@pytest.mark.slow  # minutes on a 2-core machine; deselect with -m "not slow"
@pytest.mark.timeout(900)
def test_dry_run_writes_the_summary_and_the_tarball(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    env = dict(os.environ, PYTHON=sys.executable)
    env.pop("OUT", None)
    proc = subprocess.run(["bash", os.path.join(ROOT, "tools", "gpu_session.sh"), "report", "--dry-run", "--out",
                           str(out), "--work", str(work), "--limit", "480"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=840)
    assert sorted(os.listdir(out)) == ["gpu-report.tar.gz", "summary.md"], proc.stdout + proc.stderr  # 2 of 8 files
    summary = (out / "summary.md").read_text()
    assert summary.startswith("# GPU report: DRY RUN on CPU")
    assert "## Targets of the open issues" in summary and "| issue | target | figure | goal | verdict | note |" in summary
    for issue in ("31", "32", "33", "35"):
        assert f"\n| {issue} | " in summary, issue
    for key, (title, *_rest) in gpu_report.SECTIONS.items():
        assert f"| {key}. {title} | " in summary, key
    assert "not run yet" not in summary
    # f: what transformers hands SDPA under compile, next to the compile timings; d: the memory peak is CUDA only.
    assert "What SDPA receives (tools/repro_compile_mask.py):" in summary and "  bert  compiled no mask" in summary
    assert "memory peak not recorded: the allocator's history is CUDA only" in summary
    with tarfile.open(out / "gpu-report.tar.gz") as tar:
        names = set(tar.getnames())
    assert {"gpu-report/report.json", "gpu-report/summary.md", "gpu-report/b/pytest.log"} <= names
    state = json.loads((work / "report.json").read_text())
    assert [s["key"] for s in state["sections"]] == list(gpu_report.SECTIONS)
    for s in state["sections"]:
        # A section may time out on a loaded machine; its own code must not raise, and each says what it did.
        assert "the report's section raised" not in s["line"], s
        assert s["line"] and s["seconds"] <= s["limit_s"] + 15, s
    by = {s["key"]: s for s in state["sections"]}
    assert by["b"]["status"] == "ok" and "skipped" in by["b"]["line"]  # CUDA tests, skipped on CPU
    assert by["e"]["status"] == "ok" and "copy" in by["e"]["line"]
    assert all(t["verdict"] in ("not judged (dry run)", "not measured") for t in state["targets"])


def test_sections_share_what_is_left(tmp_path, monkeypatch):
    rep = gpu_report.Report(str(tmp_path / "o"), False, 540, sys.executable, list(gpu_report.SECTIONS),
                            str(tmp_path / "w"))
    budget, estimate = gpu_report.budget_of, gpu_report.estimate_of
    later = sum(estimate(k, False) for k in "bcdefghij")
    assert rep.allot("a") == pytest.approx(min(budget("a", False), rep.left() - later), abs=1)
    monkeypatch.setattr(rep, "left", lambda: 1000.0)  # ahead of schedule: the whole budget
    assert rep.allot("e") == budget("e", False)
    monkeypatch.setattr(rep, "left", lambda: 100.0)  # behind: a share in proportion to the estimates
    rest = sum(estimate(k, False) for k in "efghij")
    assert rep.allot("e") == pytest.approx(100.0 * estimate("e", False) / rest)
    assert rep.allot("j") == pytest.approx(min(budget("j", False), 100.0))  # the last takes what is left


def test_carried_wheels_are_unpacked_for_the_commands(tmp_path):
    """.yardsticks/wheels/*.whl (pure-Python packages carried to the offline GPU machine): each unpacked into its own
    folder, importable by the sections' commands; a file that is not a wheel is reported and left out."""
    import zipfile
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    with zipfile.ZipFile(wheels / "carried_pkg-1.0-py3-none-any.whl", "w") as z:
        z.writestr("carried_pkg/__init__.py", "VALUE = 42\n")
    (wheels / "broken-1.0-py3-none-any.whl").write_text("not a zip")
    paths = gpu_report.unpack_wheels(str(wheels), str(tmp_path / "deps"))
    assert [os.path.basename(p) for p in paths] == ["carried_pkg-1.0-py3-none-any"]
    out = subprocess.run([sys.executable, "-c", "import carried_pkg; print(carried_pkg.VALUE)"],
                         env=dict(os.environ, PYTHONPATH=paths[0]), capture_output=True, text=True)
    assert out.stdout.strip() == "42", out.stderr
    assert gpu_report.unpack_wheels(str(tmp_path / "none"), str(tmp_path / "deps2")) == []


def test_work_folder_that_is_not_a_report_is_not_emptied(tmp_path):
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "precious.txt").write_text("x")
    with pytest.raises(SystemExit, match="not emptying it"):
        gpu_report.Report(str(tmp_path / "o"), True, 10, sys.executable, ["a"], str(tmp_path / "w"))
    assert (tmp_path / "w" / "precious.txt").exists()


def test_side_by_side_json_is_read():
    data = {"batch": 4, "seq": 2048, "res": {
        "none": {"peak_over_base_MiB": 14065.5, "median_ms": 130.0, "min_ms": 126.4},
        "fused+ckpt": {"peak_over_base_MiB": 2897.7, "median_ms": 124.8, "min_ms": 123.1},
        "fused+keep": {"error": "RuntimeError('ckpt_ext keep-attention: ... cuDNN ...')"}}}
    t = gpu_report._from_side_by_side(data)
    assert t["variants"]["fused+ckpt"]["ratio"] == pytest.approx(124.8 / 130.0)
    assert t["variants"]["fused+keep"] == {"error": data["res"]["fused+keep"]["error"]}
    rep = gpu_report.Report.__new__(gpu_report.Report)
    rep.dry_run, rep.targets = False, []
    gpu_report.yardstick_targets(rep, {"llama-bf16": t}, [])
    rows = {r["target"]: r for r in rep.targets}
    keep = rows["llama-bf16 fuse + keep=attention / HF eager (default SDPA settings)"]
    assert keep["verdict"] == "not measured" and "cuDNN" in keep["note"]
    assert rows["llama-bf16 fuse + ckpt / HF eager: no worse than the H200"]["verdict"] == "met"  # 0.960 <= 0.978
    assert rows["bert-large-bf16 fuse / HF eager"]["verdict"] == "not measured"


def test_pytest_log_outcomes_when_junit_is_missing(tmp_path):
    log = tmp_path / "pytest.log"
    log.write_text("[gw0] [  1%] PASSED tests/test_a.py::test_x[cuda] \n"
                   "tests/test_b.py::test_y[cuda-bf16] FAILED                    [ 50%]\n"
                   "[gw1] [ 99%] SKIPPED tests/test_c.py::test_z \n"
                   "FAILED tests/test_b.py::test_y[cuda-bf16] - AssertionError: boom\n")
    assert gpu_report._log_results(str(log)) == {"tests/test_a.py::test_x[cuda]": "PASSED",
                                                 "tests/test_b.py::test_y[cuda-bf16]": "FAILED",
                                                 "tests/test_c.py::test_z": "SKIPPED"}


@pytest.mark.parametrize("data", [
    {"rows": [{"variant": "hf-torch-nonreentrant", "compiled": True, "compile_s": 5.0, "graph_breaks": 0,
               "unique_graphs": 1, "recompiles": 0, "step_s": {"median": 0.2}},
              {"variant": "hf-torch-nonreentrant", "compiled": False, "step_s": {"median": 0.1}},
              {"variant": "ckpt_ext-fused", "compiled": True, "compile_s": 9.0, "recompiles": 1,
               "step_s": {"median": 0.15}},
              {"variant": "ckpt_ext-fused", "compiled": False, "step_s": {"median": 0.16}}]},
    {"results": {"a": {"name": "compiled-hf-torch-nonreentrant", "compile_seconds": 5.0, "median_ms": 200.0,
                       "recompiles": 0},
                 "b": {"name": "hf-torch-nonreentrant", "median_ms": 100.0},
                 "c": {"name": "compiled-ckpt_ext-fused", "compile_seconds": 9.0, "median_ms": 150.0,
                       "recompiles": 1},
                 "d": {"name": "ckpt_ext-fused", "median_ms": 160.0}}},
])
def test_compile_json_is_read_whatever_its_layout(data):
    t = gpu_report.compile_table(data)
    assert t["hf-gc:compiled"]["median_ms"] == pytest.approx(200.0)
    assert t["fused+ckpt:compiled"]["compile_s"] == 9.0 and t["fused+ckpt:compiled"]["recompiles"] == 1
    assert t["fused+ckpt:eager"]["median_ms"] == pytest.approx(160.0)
