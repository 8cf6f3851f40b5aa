# make test  : fresh machine -> .venv (reusing an installed torch), build ckpt_ext, run pytest.
# make bench : same set-up, then the default benchmark on the best device present.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
MAX_JOBS ?= 2
export MAX_JOBS

.PHONY: venv build test bench check-cuda clean

# The venv sees system site-packages so that a torch already installed on the machine (for example a
# CUDA build on a GPU box) is reused instead of downloading another one.
$(VENV)/.ready: requirements-dev.txt
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -r requirements-dev.txt
	touch $@

venv: $(VENV)/.ready

build: venv
	$(PY) -m pip install -q --no-build-isolation --no-deps -e .

test: build check-cuda
	$(PY) -m pytest -q -p no:cacheprovider tests

# The benchmarks' own dependencies are the pyproject extra [bench] (read from there, so that installing
# them does not rebuild the extension). Results go to bench-out/ (untracked); --save-results writes the
# committed benchmarks/results/<device>/.
bench: build
	$(PY) -m pip install -q $$($(PY) -c "from setuptools.config.pyprojecttoml import read_configuration as r; \
	    print(*r('pyproject.toml', expand=False)['project']['optional-dependencies']['bench'])")
	$(PY) benchmarks/bench_checkpoint.py
	$(PY) benchmarks/bench_ops.py
	$(PY) benchmarks/bench_fused.py
	$(PY) benchmarks/suite.py

# CI cannot run CUDA code, but it can compile it: every .cu source must build for sm_80 and sm_90.
check-cuda: venv
	$(PY) tools/compile_cuda.py

clean:
	rm -rf build *.egg-info ckpt_ext/_C*.so ckpt_ext/_build_info.py
