"""`make build`: build ckpt_ext._C in place (pip install -e, no build isolation) only when something changed.

The stamp (build/.build-stamp) is a hash of csrc/**, setup.py, tools/toolchain.py, pyproject.toml, the
installed torch's version, the Python running the build and the environment variables the build reads.
When it matches and the extension exists, nothing runs. Otherwise pip builds verbosely into
build/build.log while this prints what matters: setup.py's summary (what it built, what it skipped),
ninja's progress one source per line, and on failure the end of the log.

    python tools/build.py            # build if needed
    python tools/build.py --force    # build even if the stamp matches (ninja still skips what is fresh)
"""
import argparse
import glob
import importlib.metadata
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import toolchain  # noqa: E402

STAMP = os.path.join(ROOT, "build", ".build-stamp")
LOG = os.path.join(ROOT, "build", "build.log")
ENV_KEYS = ("CKPT_EXT_FORCE_CPU", "CKPT_EXT_NO_OPENMP", "CKPT_EXT_DEBUG_INFO", "TORCH_CUDA_ARCH_LIST", "CC", "CXX", "CUDAHOSTCXX", "CUDA_HOME")


def build_key() -> str:
    files = sorted(p for p in glob.glob(os.path.join(ROOT, "csrc", "**", "*"), recursive=True) if os.path.isfile(p))
    files += [os.path.join(ROOT, p) for p in ("setup.py", "tools/toolchain.py", "pyproject.toml")]
    return toolchain.content_hash(files, importlib.metadata.version("torch"), sys.executable,
                                  *(f"{k}={os.environ.get(k, '')}" for k in ENV_KEYS))


def up_to_date(key: str) -> bool:
    built = glob.glob(os.path.join(ROOT, "ckpt_ext", "_C.*so"))
    return bool(built) and os.path.exists(STAMP) and open(STAMP).read().strip() == key


def _show(line: str):
    """setup.py's own lines, ninja's progress as `[i/n] csrc/x.cpp`, and compiler errors."""
    if "ckpt_ext setup:" in line:
        print(line[line.index("ckpt_ext setup:"):].rstrip(), flush=True)
    elif re.match(r"\s*\[\d+/\d+\]", line):
        step = re.match(r"\s*(\[\d+/\d+\])", line).group(1)
        src = re.search(r"\s(\S+\.(?:cpp|cu|cc))(?:\s|$)", line)
        what = os.path.relpath(src.group(1), ROOT) if src else "link"
        print(f"  {step} {what}", flush=True)
    elif re.search(r"\berror\b|Error:", line) and "-Werror" not in line:
        print(line.rstrip(), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args()
    key = build_key()
    if not args.force and up_to_date(key):
        print("build: nothing changed since the last build (csrc, setup.py, torch, environment): skipped")
        return 0
    os.makedirs(os.path.dirname(STAMP), exist_ok=True)
    if os.path.exists(STAMP):
        os.remove(STAMP)
    cmd = [sys.executable, "-m", "pip", "install", "-v", "--no-build-isolation", "--no-deps", "-e", ROOT]
    print(f"build: {' '.join(cmd[2:])}  (full log: {os.path.relpath(LOG, ROOT)})", flush=True)
    start = time.time()
    with open(LOG, "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
        for line in proc.stdout:
            log.write(line)
            _show(line)
        rc = proc.wait()
    if rc != 0:
        with open(LOG) as log:
            tail = log.readlines()[-60:]
        print("".join(tail))
        print(f"build: FAILED after {time.time() - start:.0f} s (full log: {LOG})")
        return rc
    with open(STAMP, "w") as f:
        f.write(key + "\n")
    print(f"build: done in {time.time() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
