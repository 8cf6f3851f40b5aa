"""Compile every CUDA source under csrc/ with nvcc for sm_80 and sm_90 (object files only).

CI has no GPU, so it cannot run CUDA code, but it can refuse CUDA code that does not compile.
Without nvcc this says so and exits 0. A source that compiled is stamped in the cache
(~/.cache/ckpt_ext/check-cuda/) under the hash of it and every csrc header, nvcc's version, torch's
version and the flags, so an unchanged tree costs seconds.
"""
import concurrent.futures
import glob
import os
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


def main() -> int:
    sources = sorted(glob.glob(os.path.join(ROOT, "csrc", "**", "*.cu"), recursive=True))
    nvcc = shutil.which("nvcc") or (os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc") if os.environ.get("CUDA_HOME") else None)
    if not nvcc or not os.path.exists(nvcc):
        print("check-cuda: nvcc not found; CUDA sources NOT compiled")
        return 0
    if not sources:
        print("check-cuda: no CUDA sources under csrc/")
        return 0
    import torch
    from torch.utils.cpp_extension import include_paths

    std = toolchain.cxx_standard(include_paths()[0])  # C++20 for torch 2.15, C++17 before
    includes = [f"-I{p}" for p in include_paths()] + [f"-I{sysconfig.get_paths()['include']}", f"-I{ROOT}/csrc"]
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in ARCHS]
    nvcc_version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1:]
    headers = sorted(p for ext in ("h", "cuh") for p in glob.glob(os.path.join(ROOT, "csrc", "**", f"*.{ext}"), recursive=True))
    stamps = os.path.join(CACHE, "check-cuda")
    os.makedirs(stamps, exist_ok=True)
    jobs = []
    with tempfile.TemporaryDirectory() as tmp:
        for src in sources:
            rel = os.path.relpath(src, ROOT)
            flags = [f"-std={std}", "-O2", "--expt-relaxed-constexpr", "-DCKPT_EXT_WITH_CUDA=1",
                     "-DTORCH_EXTENSION_NAME=_C", *gencode, *includes]
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
