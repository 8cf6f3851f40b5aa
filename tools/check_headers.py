"""Compile every C++ source under csrc/ with -fsyntax-only against the headers of several torch releases.

CI builds against one torch; users install others. This proves the sources compile against each torch
setup.py admits at its bounds: MIN_TORCH, 2.11 (the GPU image's) and NEWEST_TESTED_TORCH. Sources with
CKPT_EXT_WITH_CUDA blocks are checked a second time with that macro set (needs the CUDA toolkit's
headers; skipped, and said so, without them). The .cu files are compiled by tools/compile_cuda.py.

Headers come from the torch wheel itself: `pip download --no-deps torch==X.*` into a temporary folder,
torch/include/* extracted into the cache (~/.cache/ckpt_ext/torch-X/include), the wheel deleted.
A passing (source + every csrc header, torch release, variant, compiler) is stamped in the cache, so a
second run with unchanged sources costs seconds. With GCC, ATen/ATen.h is precompiled once per release for
the run (a temporary folder first on the include path: used by the sources whose first include it is, in
place of ~10 s of parsing each; 164 s instead of ~240 s for one release on the 2-core machine).

    python tools/check_headers.py                  # the versions setup.py admits
    python tools/check_headers.py --torch 2.5 2.6  # others (e.g. to find MIN_TORCH)
"""
import argparse
import concurrent.futures
import glob
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import toolchain  # noqa: E402

CACHE = toolchain.CACHE
GPU_IMAGE_TORCH = "2.11"


def admitted_versions():
    """MIN_TORCH, 2.11 and NEWEST_TESTED_TORCH as written in setup.py (read, not imported: importing
    setup.py would build)."""
    text = open(os.path.join(ROOT, "setup.py")).read()
    found = {k: re.search(rf'^{k}\s*=\s*"([^"]+)"', text, re.M).group(1) for k in ("MIN_TORCH", "NEWEST_TESTED_TORCH")}
    return list(dict.fromkeys([found["MIN_TORCH"], GPU_IMAGE_TORCH, found["NEWEST_TESTED_TORCH"]]))


def torch_headers(version: str) -> str:
    """torch/include of the newest torch==<version>.* wheel, downloaded once and cached."""
    dest = os.path.join(CACHE, f"torch-{version}")
    include = os.path.join(dest, "include")
    if os.path.exists(os.path.join(dest, "VERSION")):
        return include
    os.makedirs(CACHE, exist_ok=True)
    spec = f"torch=={version}.*" if version.count(".") == 1 else f"torch=={version}"
    print(f"check-headers: downloading {spec} (wheel only, no dependencies) for its headers", flush=True)
    with tempfile.TemporaryDirectory(prefix="ckpt_ext_wheel_", dir=CACHE) as tmp:
        # Only the headers are read, nothing is installed: a machine-wide constraint that caps installs
        # (some machines pin torch<=2.14 in /etc/xdg/pip) must not refuse the newest release's wheel, so an
        # empty constraints file replaces the configured one for this one download.
        empty = os.path.join(tmp, "no-constraints.txt")
        open(empty, "w").close()
        env = dict(os.environ, PIP_CONSTRAINT=empty)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-cache-dir",
                        "--only-binary=:all:", "--progress-bar", "off", "-d", tmp, spec], check=True, env=env)
        wheel = glob.glob(os.path.join(tmp, "torch-*.whl"))[0]
        staging = os.path.join(tmp, "out")
        with zipfile.ZipFile(wheel) as z:
            members = [m for m in z.namelist() if m.startswith("torch/include/")]
            z.extractall(staging, members)
        shutil.rmtree(dest, ignore_errors=True)
        os.makedirs(dest)
        os.rename(os.path.join(staging, "torch", "include"), include)
        with open(os.path.join(dest, "VERSION"), "w") as f:
            f.write(os.path.basename(wheel).split("-")[1] + "\n")
    return include


def _cuda_include():
    """The CUDA toolkit's include folder, looked for where torch.utils.cpp_extension looks."""
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    if shutil.which("nvcc"):
        homes.append(os.path.dirname(os.path.dirname(os.path.realpath(shutil.which("nvcc")))))
    for home in filter(None, homes):
        if os.path.exists(os.path.join(home, "include", "cuda_runtime_api.h")):
            return os.path.join(home, "include")
    return None


PCH_HEADER = "ATen/ATen.h"  # the first include of most layer and op sources, ~12 s of each one's parse


def _flags(std, include):
    return [f"-std={std}", "-w", "-DTORCH_EXTENSION_NAME=_C", "-DTORCH_API_INCLUDE_EXTENSION_H", f"-I{include}",
            f"-I{os.path.join(include, 'torch/csrc/api/include')}", f"-I{sysconfig.get_paths()['include']}"]


def _command(cxx, src, include, std, cuda_inc, pch_dir=None):
    # pch_dir (first on the search path) holds only ATen/ATen.h.gch: GCC uses it where that header is a source's
    # first include, with the same options, and otherwise ignores it and reads the header itself from the
    # next directory -- what compiles is what would compile without it.
    cmd = [*cxx.split(), "-fsyntax-only", *([f"-I{pch_dir}"] if pch_dir else []), *_flags(std, include),
           f"-I{os.path.join(ROOT, 'csrc')}", src]
    if cuda_inc:
        cmd[-1:-1] = ["-DCKPT_EXT_WITH_CUDA=1", f"-I{cuda_inc}"]
    return cmd


def _make_pch(cxx, include, std, pch_dir):
    """ATen/ATen.h precompiled into pch_dir (GCC only; None where it cannot be made)."""
    out = os.path.join(pch_dir, PCH_HEADER + ".gch")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    # Where the .gch cannot serve (the header included from another header), GCC reads the header from the
    # directory it found the .gch in: the header itself is linked there.
    os.symlink(os.path.join(include, PCH_HEADER), os.path.join(pch_dir, PCH_HEADER))
    r = subprocess.run([*cxx.split(), "-x", "c++-header", *_flags(std, include),
                        os.path.join(include, PCH_HEADER), "-o", out], capture_output=True, text=True)
    return pch_dir if r.returncode == 0 else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--torch", nargs="+", default=None, help="torch releases (X.Y or X.Y.Z); default: setup.py's bounds")
    ap.add_argument("--no-pch", action="store_true", help=f"parse {PCH_HEADER} in every source (no precompiled header)")
    ap.add_argument("--jobs", type=int, default=int(os.environ.get("MAX_JOBS", os.cpu_count() or 1)))
    args = ap.parse_args()
    cxx = os.environ.get("CXX", "c++")
    cxx_id = subprocess.run([*cxx.split(), "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    cpp = sorted(glob.glob(os.path.join(ROOT, "csrc", "**", "*.cpp"), recursive=True))
    headers = sorted(p for ext in ("h", "cuh") for p in glob.glob(os.path.join(ROOT, "csrc", "**", f"*.{ext}"), recursive=True))
    cuda_inc = _cuda_include()
    start, failures, cached, jobs = time.time(), [], 0, []
    stamps = os.path.join(CACHE, "check-headers")
    os.makedirs(stamps, exist_ok=True)
    gcc = not any("clang" in line.lower() for line in cxx_id)  # GCC's .gch lookup; clang has its own scheme
    pch_root = tempfile.mkdtemp(prefix="ckpt_ext_pch_", dir=CACHE)  # ~100s of MB each: made per run, removed
    pending = []  # (release, rel, stamp, src, include, std, variant): what is not stamped yet
    for version in args.torch or admitted_versions():
        include = torch_headers(version)
        release = open(os.path.join(os.path.dirname(include), "VERSION")).read().strip()
        std = toolchain.cxx_standard(include)
        for src in cpp:
            variants = [None]
            if "CKPT_EXT_WITH_CUDA" in open(src).read():
                variants.append(cuda_inc or "missing")
            for variant in variants:
                rel = os.path.relpath(src, ROOT) + (" [CKPT_EXT_WITH_CUDA]" if variant else "")
                if variant == "missing":
                    print(f"check-headers: torch {release}: {rel} not checked: no CUDA toolkit headers")
                    continue
                stamp = os.path.join(stamps, toolchain.content_hash([src, *headers], release, variant, cxx_id, std))
                if os.path.exists(stamp):
                    cached += 1
                    continue
                pending.append((release, rel, stamp, src, include, std, variant))

    def run(job):
        release, rel, stamp, cmd = job
        r = subprocess.run(cmd, capture_output=True, text=True)
        return job, r

    try:
        with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
            # one precompiled header per release with sources to compile; where the compiler refuses it, those
            # sources parse the header themselves
            wanted = {} if not gcc or args.no_pch else {r: (inc, std) for r, _, _, _, inc, std, _ in pending}
            pch = dict(zip(wanted, pool.map(lambda r: _make_pch(cxx, *wanted[r], os.path.join(pch_root, r)), wanted)))
            for release, made in pch.items():
                if not made:
                    print(f"check-headers: torch {release}: no precompiled {PCH_HEADER} (compiler refused it)")
            jobs = [(release, rel, stamp, _command(cxx, src, include, std, variant, pch.get(release)))
                    for release, rel, stamp, src, include, std, variant in pending]
            for (release, rel, stamp, cmd), r in pool.map(run, jobs):
                if r.returncode == 0:
                    open(stamp, "w").close()
                    print(f"check-headers: ok torch {release} {rel}", flush=True)
                else:
                    failures.append(f"torch {release} {rel}")
                    print(f"check-headers: FAILED torch {release} {rel}\n{r.stderr[-6000:]}", flush=True)
    finally:
        shutil.rmtree(pch_root, ignore_errors=True)
    print(f"check-headers: {len(jobs) - len(failures)} compiled, {cached} unchanged since a passing run, "
          f"{len(failures)} failed ({time.time() - start:.0f} s)")
    for f in failures:
        print(f"check-headers: FAILED {f}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
