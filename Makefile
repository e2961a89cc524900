# gradsync: `make demo` and `make test` work on a fresh machine (they install first).
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: install demo test bench clean

install: $(STAMP)

# torch first, pinned to the CPU build; DeepSpeed from source against it (build isolation would
# fetch a CUDA torch); then the package with its dev extras.
$(STAMP): setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0 setuptools wheel
	$(PY) -m pip install -q --disable-pip-version-check --no-build-isolation 'deepspeed>=0.16'
	$(PY) -m pip install -q --disable-pip-version-check -e '.[dev]'
	touch $(STAMP)

# The main job: 2 local CPU ranks train a small CNN on scikit-learn's digits with ACP-SGD.
demo: install
	$(VENV)/bin/gradsync-train hydra.run.dir=outputs/demo

test: install
	$(PY) -m pytest -q

bench: install
	$(PY) benchmarks/planner_speed.py
	$(PY) benchmarks/reproduce_planners.py > /dev/null && echo "wrote benchmarks/results/reproduce_planners.md"
	$(PY) benchmarks/overhead.py
	$(PY) benchmarks/compression_speed.py
	$(PY) benchmarks/triton_kernels.py
	$(PY) benchmarks/convergence_digits.py > /dev/null && echo "wrote benchmarks/results/convergence_digits.md"
	$(PY) benchmarks/reproduce_compression.py > /dev/null && echo "wrote benchmarks/results/reproduce_compression.md"
	$(PY) benchmarks/reproduce_topology.py > /dev/null && echo "wrote benchmarks/results/reproduce_topology.md"
	$(PY) benchmarks/forest_allreduce.py
	$(PY) benchmarks/forest_netbed.py
	$(PY) -m benchmarks.head_to_head --topology 2x2-pcie --inter-gbps 1 --out benchmarks/results/head_to_head_topology.md
	$(PY) -m benchmarks.head_to_head
	$(PY) -m benchmarks.interference > /dev/null && echo "wrote benchmarks/results/interference.md"

clean:
	rm -rf $(VENV) build *.egg-info
