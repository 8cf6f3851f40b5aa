"""The CPU kernels' code paths against each other: the SIMD kernels this CPU runs (AVX2 or AVX-512, picked
at run time from ATen's capability) and the portable loops (ATEN_CPU_CAPABILITY=default), and on an AVX-512
CPU the AVX2 kernels too (=avx2): every op in float32 and bfloat16, forward and backward, on a row length
that is a whole number of SIMD steps and on one that ends in a partial step. The other kernel tests run only
the path of the CPU they are on; CI's machines are of either kind.

Dropout masks (and the keep bits the LayerNorm stores, packed with AVX2 or by the scalar loop) must agree
exactly; values to within what the paths' arithmetic allows (the SIMD GELU/SiLU
use an exp accurate to 20 float ulps, the portable loops std::exp; bfloat16 results may differ by a
rounding)."""
import os
import subprocess
import sys

import pytest
import torch

import ckpt_ext
from ckpt_ext import ops

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
P, SEED = 0.3, 1234


def compute(dtype: torch.dtype, rows: int, hidden: int) -> dict:
    """Every op on fixed inputs; the results by name."""
    g = torch.Generator().manual_seed(hidden * 7 + rows)
    rand = lambda *s, scale=1.0: (torch.randn(*s, generator=g) * scale).to(dtype)  # noqa: E731
    x, r, gr, b = rand(rows, hidden), rand(rows, hidden), rand(rows, hidden), rand(hidden, scale=0.5)
    w, lb = (1 + rand(hidden, scale=0.1)), rand(hidden, scale=0.1)
    out = {}
    out["bias_gelu"] = ops.bias_gelu(x, b)
    out["bias_gelu_tanh"] = ops.bias_gelu(x, b, "tanh")
    out["bias_gelu_backward"] = ops.bias_gelu_backward(gr, x, b)
    out["bias_dropout_add"] = ops.bias_dropout_add(x, b, r, P, SEED, 0)
    out["dropout"] = ops.dropout(x, P, SEED, 5)
    if dtype != torch.float32:  # autocast's float32 stream beside a bfloat16 x; its gradient dropped into bfloat16
        out["bias_dropout_add_mixed"] = ops.bias_dropout_add(x, b.float(), r.float(), P, SEED, 0)
        out["dropout_into_lowp"] = ops.dropout(r.float() * 3, P, SEED, 5, dtype=dtype)
    y, pre, mean, rstd, bits = ops.bias_dropout_add_layer_norm(x, b, r, w, lb, P, 1e-5, SEED, 0)
    out.update(bdaln=y, bdaln_pre=pre, bdaln_mean=mean, bdaln_rstd=rstd, bdaln_keep_bits=bits)
    for k, t in zip(("gx", "gr", "gw", "gb"), ops.bias_dropout_add_layer_norm_backward(gr, x, pre, w, mean, rstd,
                                                                                      P, SEED, 0)):
        out["bdaln_backward_" + k] = t
    for k, t in zip(("gx", "gr", "gw", "gb"), ops.bias_dropout_add_layer_norm_backward(gr, x, pre, w, mean, rstd,
                                                                                      P, SEED, 0, bits)):
        out["bdaln_backward_bits_" + k] = t
    y, s, mean, rstd = ops.add_layer_norm(x, r, w, lb)
    out.update(add_layer_norm=y, add_layer_norm_sum=s, add_layer_norm_rstd=rstd)
    for k, t in zip(("gx", "gw", "gb"), ops.add_layer_norm_backward(gr, None, s, w, mean, rstd)):
        out["add_layer_norm_backward_" + k] = t
    y, s, rstd = ops.add_rms_norm(x, r, w)
    out.update(add_rms_norm=y, add_rms_norm_rstd=rstd)
    for k, t in zip(("gx", "gw"), ops.add_rms_norm_backward(gr, x, s, w, rstd)):
        out["add_rms_norm_backward_" + k] = t
    out["swiglu"] = ops.swiglu(x, r)
    for k, t in zip(("gate", "up"), ops.swiglu_backward(gr, x, r)):
        out["swiglu_backward_" + k] = t
    for approximate in ("tanh", "none"):
        out["geglu_" + approximate] = ops.geglu(x, r, approximate)
        for k, t in zip(("gate", "up"), ops.geglu_backward(gr, x, r, approximate)):
            out[f"geglu_{approximate}_backward_" + k] = t
    if hidden % 2 == 0:
        q = x.view(rows, 1, 1, hidden)
        cos, sin = rand(1, hidden).view(1, 1, hidden), rand(1, hidden).view(1, 1, hidden)
        out["rotary"] = ops.rotary(q, cos, sin)
        out["rotary_backward"] = ops.rotary_backward(q, cos, sin)
    return {k: v.float() for k, v in out.items()}


CASES = [(dtype, rows, hidden) for dtype in (torch.float32, torch.bfloat16) for rows, hidden in ((9, 256), (7, 100))]
_CHILD = "import sys, torch; sys.path.insert(0, {root!r}); sys.path.insert(0, {tests!r}); import test_kernels_paths as t; " \
         "torch.save({{repr(c): t.compute(*c) for c in t.CASES}}, {path!r})"


def capabilities_below() -> list:
    native = torch.backends.cpu.get_cpu_capability()
    return {"AVX512": ["default", "avx2"], "AVX2": ["default"]}.get(native, [])


@pytest.fixture(scope="module")
def lower_paths(tmp_path_factory):
    """{capability: {case: results}} computed in child processes with ATEN_CPU_CAPABILITY set."""
    results = {}
    for cap in capabilities_below():
        path = str(tmp_path_factory.mktemp("paths") / f"{cap}.pt")
        env = dict(os.environ, ATEN_CPU_CAPABILITY=cap)
        code = _CHILD.format(root=ROOT, tests=os.path.join(ROOT, "tests"), path=path)
        subprocess.run([sys.executable, "-c", code], env=env, check=True, cwd=ROOT)
        results[cap] = torch.load(path)
    return results


@pytest.mark.skipif(not capabilities_below(), reason="this CPU has no SIMD kernels to compare")
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{str(c[0])[6:]}-{c[1]}x{c[2]}")
def test_simd_kernels_match_the_portable_loops(lower_paths, case):
    dtype = case[0]
    here = compute(*case)
    for cap, res in lower_paths.items():
        there = res[repr(case)]
        assert there.keys() == here.keys()
        for name, want in there.items():
            got = here[name]
            assert torch.equal(got == 0, want == 0) or "dropout" not in name and "bdaln" not in name, \
                f"{name}: the dropout masks differ between the native kernels and ATEN_CPU_CAPABILITY={cap}"
            if "keep_bits" in name:  # the stored mask: bit for bit
                assert torch.equal(got, want), f"{name}: the keep bits differ from ATEN_CPU_CAPABILITY={cap}'s"
            elif dtype == torch.float32:
                torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5,
                                           msg=lambda m: f"{name} (native vs {cap}): {m}")
            else:
                torch.testing.assert_close(got, want, rtol=2 ** -7, atol=2e-2,
                                           msg=lambda m: f"{name} (native vs {cap}): {m}")
