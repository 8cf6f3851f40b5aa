"""Compile every CUDA source under csrc/ with nvcc for sm_80 and sm_90 (object files only).

CI has no GPU, so it cannot run CUDA code, but it can refuse CUDA code that does not compile.
Without nvcc this says so and exits 0. A source that compiled is stamped in the cache
(~/.cache/ckpt_ext/check-cuda/) under the hash of it and every csrc header, nvcc's version, torch's
version and the flags, so an unchanged tree costs seconds.

`--ptxas-report [SOURCE ...]` compiles the given sources (default: all) again with `-Xptxas -v` and prints,
per architecture and kernel, registers, spill stores / loads (bytes) and static shared memory (bytes): what
a change to a kernel's per-thread work does to its resources, measurable without a GPU.
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import toolchain  # noqa: E402
from toolchain import CACHE  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARCHS = ("80", "90")


def nvcc_flags():
    from torch.utils.cpp_extension import COMMON_NVCC_FLAGS, include_paths

    std = toolchain.cxx_standard(include_paths()[0])  # C++20 for torch 2.15, C++17 before
    includes = [f"-I{p}" for p in include_paths()] + [f"-I{sysconfig.get_paths()['include']}", f"-I{ROOT}/csrc"]
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in ARCHS]
    # torch's own nvcc flags, as setup.py's build passes them (BuildExtension): -D__CUDA_NO_HALF_OPERATORS__ and the
    # like take CUDA's __half / __nv_bfloat16 operators and conversions away, so code that needs them compiles here
    # only if it compiles in the real build (docs/cuda-audit.md).
    common = [f for f in COMMON_NVCC_FLAGS if f != "--expt-relaxed-constexpr"]
    return std, [f"-std={std}", "-O2", "--expt-relaxed-constexpr", *common, "-DCKPT_EXT_WITH_CUDA=1",
                 "-DTORCH_EXTENSION_NAME=_C", *gencode, *includes]


def find_nvcc():
    nvcc = shutil.which("nvcc") or (os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc") if os.environ.get("CUDA_HOME") else None)
    return nvcc if nvcc and os.path.exists(nvcc) else None


def _demangle(names):
    filt = shutil.which("cu++filt") or shutil.which("c++filt")
    if not filt or not names:
        return list(names)
    out = subprocess.run([filt], input="\n".join(names), capture_output=True, text=True).stdout.splitlines()
    return out if len(out) == len(names) else list(names)


def _short(kernel: str) -> str:
    """A demangled kernel name without namespaces and parameter lists."""
    kernel = re.sub(r"\bckpt_ext::kernels::cuda::(\(anonymous namespace\)::)?", "", kernel)
    kernel = kernel.replace("(anonymous namespace)::", "").replace("c10::", "")
    depth, name = 0, ""
    for ch in kernel:  # drop the parameter list: the first '(' at template depth 0
        if ch == "(" and depth == 0 and name and not name.endswith("operator"):
            break
        depth += ch == "<"
        depth -= ch == ">"
        name += ch
    return name


def ptxas_report(nvcc, sources) -> int:
    """Prints | arch | kernel | registers | spill stores | spill loads | smem | for every kernel of `sources`."""
    _, flags = nvcc_flags()
    rows, failures = [], 0
    with tempfile.TemporaryDirectory() as tmp:
        for src in sources:
            r = subprocess.run([nvcc, "-c", src, "-o", os.path.join(tmp, "x.o"), "-Xptxas", "-v", *flags],
                               capture_output=True, text=True)
            if r.returncode != 0:
                failures += 1
                print(f"ptxas-report: FAILED {os.path.relpath(src, ROOT)}\n{r.stdout}{r.stderr}")
                continue
            current = None
            for line in (r.stdout + r.stderr).splitlines():
                m = re.search(r"Compiling entry function '(\S+)' for 'sm_(\d+)'", line)
                if m:
                    current = {"src": os.path.basename(src), "name": m.group(1), "arch": m.group(2),
                               "regs": 0, "stores": 0, "loads": 0, "smem": 0}
                    rows.append(current)
                    continue
                if current is None:
                    continue
                m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
                if m:
                    current["stores"], current["loads"] = int(m.group(1)), int(m.group(2))
                m = re.search(r"Used (\d+) registers", line)
                if m:
                    current["regs"] = int(m.group(1))
                    sm = re.search(r"(\d+) bytes smem", line)
                    current["smem"] = int(sm.group(1)) if sm else 0
    for row, name in zip(rows, _demangle([r["name"] for r in rows])):
        row["name"] = _short(name)
    rows.sort(key=lambda r: (r["arch"], r["src"], r["name"]))
    print("| arch | source | kernel | registers | spill stores (B) | spill loads (B) | smem (B) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| sm_{r['arch']} | {r['src']} | `{r['name']}` | {r['regs']} | {r['stores']} | {r['loads']} | {r['smem']} |")
    spilling = sum(1 for r in rows if r["stores"] or r["loads"])
    print(f"\nptxas-report: {len(rows)} kernel instantiations, {spilling} spilling")
    return 1 if failures else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ptxas-report", nargs="*", metavar="SOURCE",
                        help="print registers / spills / shared memory per kernel of these .cu files (default: all)")
    args = parser.parse_args()
    sources = sorted(glob.glob(os.path.join(ROOT, "csrc", "**", "*.cu"), recursive=True))
    nvcc = find_nvcc()
    if not nvcc:
        print("check-cuda: nvcc not found; CUDA sources NOT compiled")
        return 0
    if args.ptxas_report is not None:
        return ptxas_report(nvcc, [os.path.abspath(s) for s in args.ptxas_report] or sources)
    if not sources:
        print("check-cuda: no CUDA sources under csrc/")
        return 0
    import torch

    std, flags = nvcc_flags()
    nvcc_version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1:]
    headers = sorted(p for ext in ("h", "cuh") for p in glob.glob(os.path.join(ROOT, "csrc", "**", f"*.{ext}"), recursive=True))
    stamps = os.path.join(CACHE, "check-cuda")
    os.makedirs(stamps, exist_ok=True)
    jobs = []
    with tempfile.TemporaryDirectory() as tmp:
        for src in sources:
            rel = os.path.relpath(src, ROOT)
            stamp = os.path.join(stamps, toolchain.content_hash([src, *headers], torch.__version__, nvcc_version, flags))
            if os.path.exists(stamp):
                print(f"check-cuda: ok {rel} (unchanged since it compiled with {' '.join(nvcc_version)}, "
                      f"torch {torch.__version__})")
            else:
                jobs.append((rel, stamp, [nvcc, "-c", src, "-o", os.path.join(tmp, os.path.basename(src) + ".o"), *flags]))

        def run(job):
            return job, subprocess.run(job[2], capture_output=True, text=True)

        failures = 0
        with concurrent.futures.ThreadPoolExecutor(max(1, int(os.environ.get("MAX_JOBS", "1")))) as pool:
            for (rel, stamp, _), r in pool.map(run, jobs):
                if r.returncode != 0:
                    failures += 1
                    print(f"check-cuda: FAILED {rel}\n{r.stdout}{r.stderr}")
                else:
                    open(stamp, "w").close()
                    print(f"check-cuda: ok {rel} (sm_{', sm_'.join(ARCHS)}, -std={std})", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
