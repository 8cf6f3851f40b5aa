"""PyTorch's own checkpoint tests, run on ckpt_ext.

    python tools/torch_checkpoint_tests.py PATH [--json OUT] [--no-reference] [-- more pytest arguments]

PATH is a PyTorch source checkout (or its `test/` folder) of the release you run: the tool reads
`test/test_autograd.py` and `test/test_utils.py` from it and downloads nothing. Fetch it yourself, e.g.
`git clone --depth 1 --branch v2.13.0 https://github.com/pytorch/pytorch` (torch's test utilities also need
`pip install expecttest`). Its tests are not copied into this repository: they are PyTorch's, and they change
with every release, so they are read from the checkout that matches the installed torch.

What runs (pytest `-k`): every test whose class or name contains "checkpoint" in those two files --
TestAutograd's checkpoint tests, TestNestedCheckpoint, TestSelectiveActivationCheckpoint, test_utils.py's
TestCheckpoint -- plus the TestAutograd tests in EXTRA that call checkpoint without saying so in their name.
`@slowTest` tests run too (PYTORCH_TEST_WITH_SLOW=1). The plugin tools/torch_checkpoint_patch.py sends every
checkpoint / checkpoint_sequential call that is not `use_reentrant=True` to ckpt_ext and counts, per test, the
calls ckpt_ext took.

The same selection runs twice: first on torch itself (the reference: every call goes to torch's own functions),
then on ckpt_ext. The report sorts every selected test into one of:
  passed    -- passed on ckpt_ext, and at least one checkpoint call went to ckpt_ext: the core tests that pass;
  failed    -- failed or errored on ckpt_ext while it passes on torch itself;
  torch     -- passed without a single call reaching ckpt_ext: tests of use_reentrant=True-only behaviour or of
               torch helpers (create_selective_checkpoint_contexts' argument checks, _infer_device_type), which
               say nothing about ckpt_ext and are excluded from the core count;
  mismatch  -- fails on torch itself too: the test files are not the installed release's (a test of another
               release's behaviour); excluded, listed with torch's failure;
  skipped   -- skipped by the test itself (CUDA, several GPUs, an accelerator), with torch's reason.
The exit status is 1 if any test failed.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = ("test_autograd.py", "test_utils.py")
# TestAutograd tests that call torch.utils.checkpoint without "checkpoint" in their name.
EXTRA = ("test_custom_autograd_ac_early_stop", "test_access_saved_tensor_twice_without_recomputation_works")


def _test_dir(path: str) -> str:
    for candidate in (os.path.join(path, "test"), path):
        if all(os.path.isfile(os.path.join(candidate, f)) for f in FILES):
            return os.path.abspath(candidate)
    raise SystemExit(f"torch_checkpoint_tests: no {' and '.join(FILES)} under {path} or {path}/test. Pass a PyTorch "
                     "source checkout of the installed release, e.g. git clone --depth 1 --branch v<torch version> "
                     "https://github.com/pytorch/pytorch")


def _checkout_revision(test_dir: str) -> str:
    try:
        out = subprocess.run(["git", "-C", test_dir, "describe", "--tags", "--always"], capture_output=True,
                             text=True, timeout=30)
        return out.stdout.strip() or "not a git checkout"
    except (OSError, subprocess.SubprocessError):
        return "not a git checkout"


def _classify(results: dict, reference: dict) -> dict:
    groups = {"passed": [], "failed": [], "torch": [], "mismatch": [], "skipped": []}
    for nodeid, entry in sorted(results.items()):
        outcome = entry.get("outcome")
        calls = entry.get("calls", {})
        name = nodeid.split("::", 1)[-1]
        on_torch = reference.get(nodeid, {})
        if outcome == "failed" and on_torch.get("outcome") == "failed":
            groups["mismatch"].append((name, "fails on torch itself: " + on_torch.get("reason", "")))
        elif outcome == "failed":
            groups["failed"].append((name, entry.get("reason", "")))
        elif outcome == "skipped":
            groups["skipped"].append((name, entry.get("reason", "")))
        elif outcome == "passed" and calls.get("ckpt_ext", 0) > 0:
            note = "" if on_torch.get("outcome") in ("passed", None) else f" (on torch: {on_torch['outcome']})"
            groups["passed"].append((name, f"{calls['ckpt_ext']} call(s), {calls.get('replays', 0)} replay(s)"
                                           + note))
        elif outcome == "passed":
            groups["torch"].append((name, f"{calls.get('torch_reentrant', 0)} call(s) to torch's reentrant "
                                          "checkpoint, none to ckpt_ext"))
    return groups


def _run(test_dir: str, route: str, extra: list) -> dict:
    """The selected tests, with the checkpoint calls routed to `route` ("ckpt_ext" or "torch"): per-test results."""
    with tempfile.TemporaryDirectory() as scratch:
        report = os.path.join(scratch, "results.json")
        ini = os.path.join(scratch, "pytest.ini")
        with open(ini, "w") as f:
            f.write("[pytest]\n")
        env = dict(os.environ, PYTORCH_TEST_WITH_SLOW="1", PYTORCH_PRINT_REPRO_ON_FAILURE="0",
                   CKPT_EXT_TORCH_TESTS_REPORT=report, CKPT_EXT_TORCH_TESTS_ROUTE=route,
                   PYTHONPATH=os.pathsep.join(p for p in (os.path.join(ROOT, "tools"), ROOT,
                                                          os.environ.get("PYTHONPATH")) if p))
        # --noconftest and our own empty ini: PyTorch's test/conftest.py and pytest.ini add plugins and options
        # (sharding, reruns) that need PyTorch's CI packages; none of them changes what a test checks.
        cmd = [sys.executable, "-m", "pytest", *[os.path.join(test_dir, f) for f in FILES],
               "-k", " or ".join(("checkpoint",) + EXTRA), "-p", "torch_checkpoint_patch", "-p", "no:cacheprovider",
               "--noconftest", "-c", ini, "--rootdir", test_dir, "-q", "-rfE", "--tb=short", *extra]
        print(f"\n== on {route}: " + " ".join(cmd), flush=True)
        subprocess.run(cmd, cwd=ROOT, env=env)
        if not os.path.exists(report):
            raise SystemExit("torch_checkpoint_tests: pytest wrote no results (see its output above)")
        with open(report) as f:
            return json.load(f)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", help="a PyTorch source checkout (or its test/ folder) of the installed release")
    parser.add_argument("--json", help="write the per-test results (outcome, calls; both runs) to this file")
    parser.add_argument("--no-reference", action="store_true", help="skip the reference run on torch itself")
    argv = sys.argv[1:] if argv is None else list(argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    args = parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    test_dir = _test_dir(args.path)

    import torch  # noqa: F401  (the version to report; the tests run in a child process)

    try:
        import expecttest  # noqa: F401
    except ImportError:
        raise SystemExit("torch_checkpoint_tests: torch's test utilities need expecttest: pip install expecttest")
    print(f"torch {torch.__version__} (git {torch.version.git_version[:12]}); tests from {test_dir} "
          f"({_checkout_revision(test_dir)})", flush=True)

    reference = {} if args.no_reference else _run(test_dir, "torch", extra)
    results = _run(test_dir, "ckpt_ext", extra)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": str(torch.__version__), "tests": test_dir, "ckpt_ext": results,
                       "reference": reference}, f, indent=1, sort_keys=True)
    groups = _classify(results, reference)

    titles = {"passed": "passed on ckpt_ext", "failed": "FAILED on ckpt_ext", "torch": "excluded: no call reached "
              "ckpt_ext", "mismatch": "excluded: fails on torch itself", "skipped": "skipped by the test"}
    for key in ("failed", "passed", "torch", "mismatch", "skipped"):
        print(f"\n{titles[key]} ({len(groups[key])}):")
        for name, detail in groups[key]:
            print(f"  {name}: {detail}")
    ran = sum(len(groups[k]) for k in ("passed", "failed", "torch", "mismatch"))
    print(f"\nsummary: {ran} ran, {len(groups['passed'])} passed on ckpt_ext, {len(groups['failed'])} failed, "
          f"{len(groups['torch'])} excluded (torch-only), {len(groups['mismatch'])} excluded (fail on torch "
          f"itself), {len(groups['skipped'])} skipped")
    return 1 if groups["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
