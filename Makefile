# make test  : fresh machine -> .venv (reusing an installed torch), build ckpt_ext, run pytest (the tests not
#              marked slow). Nothing else.
# make check : the release checks: the slow tests (several processes: DDP/FSDP over gloo, a spawned process, the
#              GPU report's dry run), CUDA sources through nvcc (sm_80, sm_90), C++ against the headers of other
#              torch releases, the Hugging Face-facing tests on other transformers releases.
# make bench : same set-up as make test, then the default benchmark set (benchmarks/bench_all.py): a summary
#              table and a plot at the end.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
MAX_JOBS ?= 2
export MAX_JOBS
# pytest workers (pytest-xdist): one per core on CI's 2-core machine; PYTEST_WORKERS=0 runs in one process.
PYTEST_WORKERS ?= 2

.PHONY: venv build test test-slow check test-compat bench check-cuda check-headers clean

# The venv sees system site-packages so that a torch already installed on the machine (for example a
# CUDA build on a GPU box) is reused instead of downloading another one.
# The Python packages are the tested set pinned in constraints.txt (make test-compat tries others).
$(VENV)/.ready: requirements-dev.txt constraints.txt
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -r requirements-dev.txt -c constraints.txt
	touch $@

venv: $(VENV)/.ready

# The Hugging Face-facing tests again with the oldest supported transformers and the newest releases the
# registry serves (a canary), each in an overlay venv .venv-compat/<set>; COMPAT_SETS picks (tools/compat.py).
COMPAT_SETS ?= oldest newest
test-compat: build
	$(PY) tools/compat.py $(COMPAT_SETS)

# Skipped when csrc/, setup.py, torch and the build environment are unchanged (stamp: build/.build-stamp);
# otherwise an in-place build whose objects persist in build/temp-*, so ninja recompiles only what changed.
build: venv
	$(PY) tools/build.py

# The tests marked slow start other processes (torch.distributed over gloo, torch.multiprocessing spawn, the GPU
# report's dry run: minutes of subprocesses); make check runs them (test-slow), so make test fits 10 minutes.
test: build
	$(PY) -m pytest -q -p no:cacheprovider -n $(PYTEST_WORKERS) -m "not slow" tests

test-slow: build
	$(PY) -m pytest -q -p no:cacheprovider -n $(PYTEST_WORKERS) -m slow tests

# The release checks (CI runs them after make test; .ci/run). Each caches what passed (~/.cache/ckpt_ext),
# so an unchanged tree costs seconds; from empty caches, on 2 cores, about 7-10 minutes (docs/install.md).
check: test-slow check-cuda check-headers test-compat

# The benchmarks' own dependencies are the pyproject extra [bench] (read from there, so that installing
# them does not rebuild the extension), pinned by constraints.txt. Results go to bench-out/<device>/
# (untracked). BENCH_ARGS passes options to benchmarks/bench_all.py (e.g. BENCH_ARGS=--quick).
BENCH_ARGS ?=
bench: build
	$(PY) -m pip install -q -c constraints.txt $$($(PY) -c "from setuptools.config.pyprojecttoml import read_configuration as r; \
	    print(*r('pyproject.toml', expand=False)['project']['optional-dependencies']['bench'])")
	$(PY) benchmarks/bench_all.py $(BENCH_ARGS)

# CI cannot run CUDA code, but it can compile it: every .cu source must build for sm_80 and sm_90.
# Cached per source hash, nvcc and torch version (~/.cache/ckpt_ext/check-cuda).
check-cuda: venv
	$(PY) tools/compile_cuda.py

# Every C++ source against the headers of each torch setup.py admits (MIN_TORCH, 2.11, NEWEST_TESTED_TORCH),
# taken from the wheels; headers and passing results are cached in ~/.cache/ckpt_ext.
check-headers: venv
	$(PY) tools/check_headers.py

clean:
	rm -rf build .venv-compat *.egg-info ckpt_ext/_C*.so ckpt_ext/_build_info.py   # the caches in ~/.cache/ckpt_ext stay
