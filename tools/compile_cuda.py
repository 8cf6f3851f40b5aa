"""Compile every CUDA source under csrc/ with nvcc for sm_80 and sm_90 (object files only).

CI has no GPU, so it cannot run CUDA code, but it can refuse CUDA code that does not compile.
Without nvcc this says so and exits 0.
"""
import glob
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile

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
    from torch.utils.cpp_extension import include_paths

    includes = [f"-I{p}" for p in include_paths()] + [f"-I{sysconfig.get_paths()['include']}", f"-I{ROOT}/csrc"]
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in ARCHS]
    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        for src in sources:
            obj = os.path.join(tmp, os.path.basename(src) + ".o")
            cmd = [nvcc, "-c", src, "-o", obj, "-std=c++17", "-O2", "--expt-relaxed-constexpr",
                   "-DCKPT_EXT_WITH_CUDA=1", "-DTORCH_EXTENSION_NAME=_C", *gencode, *includes]
            rel = os.path.relpath(src, ROOT)
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                failures += 1
                print(f"check-cuda: FAILED {rel}\n{r.stdout}{r.stderr}")
            else:
                print(f"check-cuda: ok {rel} (sm_{', sm_'.join(ARCHS)})")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
