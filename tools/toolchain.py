"""What the toolchain must agree on with the installed torch; shared by setup.py and the tools/ checks.

* cxx_standard(): the C++ standard torch's own headers demand (torch 2.15's ATen.h stops with
  `#error C++20 or later compatible compiler is required`; older ones need C++17).
* libstdcxx_linkage(): whether a compiler links libstdc++ into a shared object statically. Such an
  extension carries its own copy of libstdc++ next to the one torch loads, and the two disagree on
  global state (locales): formatting a double in an error message then segfaults inside codecvt.

Only the standard library is imported here, so the tools can load this file without torch.
"""
import hashlib
import os
import re
import shlex
import shutil
import subprocess
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The cache the checks stamp their passing results in (and keep torch headers in), outside the checkout.
CACHE = os.environ.get("CKPT_EXT_CACHE") or os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "ckpt_ext")


def content_hash(paths, *extra) -> str:
    """sha256 of the files (named relative to the checkout, so a stamp does not depend on where it
    lives) and of `extra`."""
    h = hashlib.sha256()
    for p in paths:
        h.update(os.path.relpath(p, ROOT).encode())
        with open(p, "rb") as f:
            h.update(f.read())
    for e in extra:
        h.update(str(e).encode())
    return h.hexdigest()[:24]

SYSTEM_COMPILERS = "CC=/usr/bin/gcc CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++"
_STANDARDS = {201703: "c++17", 202002: "c++20", 202302: "c++23"}


def cxx_standard(torch_include: str) -> str:
    """The -std value torch's headers require, read from the guard at the top of ATen/ATen.h."""
    try:
        with open(os.path.join(torch_include, "ATen", "ATen.h")) as f:
            head = f.read(4096)
    except OSError:
        return "c++17"
    found = [int(v) for v in re.findall(r"__cplusplus\s*<\s*(\d{6})L", head)]
    return _STANDARDS.get(max(found), "c++17") if found else "c++17"


def _readelf_needed(path: str):
    """DT_NEEDED entries of a shared object, or None when readelf/objdump are missing."""
    for tool, args in (("readelf", ["-d"]), ("objdump", ["-p"])):
        exe = shutil.which(tool)
        if exe:
            out = subprocess.run([exe, *args, path], capture_output=True, text=True).stdout
            return re.findall(r"NEEDED\)?\s+(?:Shared library: \[)?([^\]\s]+)", out)
    return None


def _defines_libstdcxx(path: str) -> bool:
    """True when the object exports libstdc++'s own internals (the codecvt facets, __cxa_throw)."""
    nm = shutil.which("nm")
    if not nm:
        return False
    out = subprocess.run([nm, "-D", "--defined-only", path], capture_output=True, text=True).stdout
    return bool(re.search(r" (__cxa_throw|_ZNSt7codecvtI\w*|_ZNSt6locale\w*)$", out, re.M))


def shared_object_linkage(path: str) -> str:
    """'static' if the shared object carries its own libstdc++, 'dynamic' if it loads libstdc++.so,
    'unknown' when binutils are missing."""
    needed = _readelf_needed(path)
    if needed is None:
        return "unknown"
    if any(n.startswith("libstdc++.so") for n in needed):
        return "dynamic"
    return "static" if _defines_libstdcxx(path) or not needed else "dynamic-nolibstdcxx"


_PROBE = '#include <sstream>\n#include <string>\nstd::string ckpt_probe(double x) { std::ostringstream s; s << x; return s.str(); }\n'


def libstdcxx_linkage(cxx: str) -> str:
    """Builds a tiny shared object that formats a double with `cxx` (a command, possibly with flags)
    and reports how it got libstdc++: 'static', 'dynamic', or 'unknown' (compiler or binutils failed)."""
    with tempfile.TemporaryDirectory(prefix="ckpt_ext_cxx_") as tmp:
        src, so = os.path.join(tmp, "probe.cpp"), os.path.join(tmp, "probe.so")
        with open(src, "w") as f:
            f.write(_PROBE)
        try:
            r = subprocess.run([*shlex.split(cxx), "-shared", "-fPIC", "-O0", src, "-o", so],
                               capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired):
            return "unknown"
        if r.returncode != 0 or not os.path.exists(so):
            return "unknown"
        linkage = shared_object_linkage(so)
        return "dynamic" if linkage == "dynamic-nolibstdcxx" else linkage


def static_libstdcxx_message(what: str) -> str:
    return (
        f"ckpt_ext: {what} links libstdc++ statically into the extension. ckpt_ext._C would carry its own "
        "copy of libstdc++ beside the one torch uses, and C++ error paths that format numbers crash (SIGSEGV "
        "in std::codecvt). Build with the system compilers instead, e.g.\n"
        f"    {SYSTEM_COMPILERS} pip install --no-build-isolation .\n"
        "(CKPT_EXT_ALLOW_STATIC_LIBSTDCXX=1 skips this check.)"
    )


def real_cuda_home(home):
    """The CUDA toolkit's directory. Without CUDA_HOME, torch takes it from the nvcc on PATH, two levels
    up; a wrapper script (say /usr/local/bin/nvcc running /usr/local/cuda-13.0/bin/nvcc) then gives
    /usr/local, which holds no CUDA libraries, and linking fails on -lcudart. Such a home is replaced by
    the directory nvcc reports as its own (`nvcc -v --dryrun`: "TOP=..."); anything else is kept."""
    if home is None or os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH"):
        return home
    if any(os.path.exists(os.path.join(home, d, "libcudart.so")) for d in ("lib64", "lib")):
        return home
    try:
        out = subprocess.run([os.path.join(home, "bin", "nvcc"), "-v", "--dryrun", "-c", "-x", "cu", os.devnull,
                              "-o", os.devnull], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return home
    m = re.search(r"^#\$ TOP=(.+)$", out.stderr + out.stdout, re.MULTILINE)
    return os.path.realpath(m.group(1).strip()) if m else home
