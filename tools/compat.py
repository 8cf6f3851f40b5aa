"""`make test-compat`: the Hugging Face-facing tests against other releases of transformers (and peft,
accelerate) than the pinned set of `make test`.

    python tools/compat.py                 # the default sets: oldest, newest
    python tools/compat.py oldest 5.17     # named sets (see SETS)

Each set is an overlay venv in .venv-compat/<set>: it sees the main venv's packages (torch, pytest, the
in-place extension build) through a .pth file, and installs only the set's releases over them. `newest`
asks the registry for the newest transformers, peft and accelerate every run: a canary, so that a new
release that breaks ckpt_ext fails CI the first time CI meets it. The tests run from the repository root,
so they import this checkout's ckpt_ext with the extension `make build` built in place.
"""
import argparse
import os
import subprocess
import sys
import sysconfig
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# set -> pip install arguments. Keep `oldest` in step with ckpt_ext/hf/versions.py (TESTED), README and docs/install.md.
SETS = {
    "oldest": ["transformers==5.0.0"],
    "5.17": ["transformers==5.17.0"],  # the GPU image's
    "4.57": ["transformers==4.57.6"],  # below the supported range: to see what 4.x users would meet
    "newest": ["--upgrade", "transformers", "peft", "accelerate"],
}
DEFAULT = ("oldest", "newest")
TESTS = ["tests/test_hf_zoo.py", "tests/test_integration.py", "tests/test_trainer.py",
         "tests/test_checkpoint_hf_fallback.py", "tests/test_fused_parity.py", "tests/test_fused_segment.py",
         "tests/test_lora_fused.py", "tests/test_lifecycle.py", "tests/test_compile_steps.py",
         # Gemma 2/3 (transformers 5.0's SDPA drops Gemma 2's softcap; its Gemma 3 multimodal loss is inline) and the
         # fused LoRA path's op counts against peft's
         "tests/test_gemma_fused.py", "tests/test_lora_work.py"]


def _run(cmd, **kw):
    print("compat: " + " ".join(cmd), flush=True)
    return subprocess.run(cmd, cwd=ROOT, **kw)


def overlay(name: str) -> str:
    """The set's venv (created once), with the main venv's site-packages behind its own."""
    path = os.path.join(ROOT, ".venv-compat", name)
    py = os.path.join(path, "bin", "python")
    if not os.path.exists(py):
        base = getattr(sys, "_base_executable", sys.executable)
        subprocess.run([base, "-m", "venv", "--system-site-packages", path], check=True)
        site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              check=True, capture_output=True, text=True).stdout.strip()
        with open(os.path.join(site, "_ckpt_ext_main_venv.pth"), "w") as f:
            f.write(sysconfig.get_paths()["purelib"] + "\n")  # this (main) venv's packages
    return py


def versions(py: str) -> str:
    code = ("import importlib.metadata as m; print(', '.join(f'{n} {m.version(n)}' for n in "
            "('torch', 'transformers', 'peft', 'accelerate', 'huggingface_hub')))")
    return subprocess.run([py, "-c", code], capture_output=True, text=True).stdout.strip()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sets", nargs="*", default=list(DEFAULT), help=f"of {', '.join(SETS)}")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)  # argparse would take what follows -- as sets
    args = ap.parse_args(argv[:cut])
    args.pytest_args = argv[cut + 1:]  # after --: passed to pytest
    unknown = [s for s in args.sets if s not in SETS]
    if unknown:
        ap.error(f"unknown set(s) {unknown}; known: {', '.join(SETS)}")
    failed = []
    for name in args.sets:
        start = time.time()
        py = overlay(name)
        install = _run([py, "-m", "pip", "install", "-q", "--disable-pip-version-check", *SETS[name]])
        if install.returncode != 0:
            failed.append(f"{name} (install)")
            continue
        print(f"compat[{name}]: {versions(py)}", flush=True)
        rc = _run([py, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS, *args.pytest_args]).returncode
        print(f"compat[{name}]: {'passed' if rc == 0 else 'FAILED'} in {time.time() - start:.0f} s", flush=True)
        if rc != 0:
            failed.append(name)
    if failed:
        print(f"compat: FAILED: {', '.join(failed)}")
        return 1
    print(f"compat: all sets passed ({', '.join(args.sets)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
