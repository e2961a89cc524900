# gradsync: `make demo` and `make test` work on a fresh machine (they install first).
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: install demo test bench gpu-check gpu-wheels clean

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

# two workers, a test file each at a time: the suite's multi-rank tests leave a core idle much of the time
test: install
	$(PY) -m pytest -q -n 2 --dist loadfile

bench: install
	$(PY) benchmarks/planner_speed.py
	$(PY) benchmarks/reproduce_planners.py > /dev/null && echo "wrote benchmarks/results/reproduce_planners.md"
	$(PY) -m benchmarks.overhead
	$(PY) -m benchmarks.overhead --rate 10gbit
	$(PY) benchmarks/compression_speed.py
	$(PY) benchmarks/triton_kernels.py
	$(PY) benchmarks/codec_launch_costs.py
	$(PY) benchmarks/convergence_digits.py > /dev/null && echo "wrote benchmarks/results/convergence_digits.md"
	$(PY) benchmarks/reproduce_compression.py > /dev/null && echo "wrote benchmarks/results/reproduce_compression.md"
	$(PY) benchmarks/reproduce_topology.py > /dev/null && echo "wrote benchmarks/results/reproduce_topology.md"
	$(PY) benchmarks/forest_allreduce.py
	$(PY) benchmarks/forest_netbed.py
	$(PY) -m benchmarks.head_to_head --topology 2x2-pcie --inter-gbps 1 --out benchmarks/results/head_to_head_topology.md
	$(PY) -m benchmarks.head_to_head
	$(PY) -m benchmarks.deepspeed_zero
	$(PY) -m benchmarks.interference > /dev/null && echo "wrote benchmarks/results/interference.md"
	$(PY) -m benchmarks.replanning > /dev/null && echo "wrote benchmarks/results/replanning.md"

# The GPU acceptance run (benchmarks/gpu_check): on a CUDA machine with its own python3 and no network
# it installs gradsync offline and writes its report into GPU_CHECK_DIR (default gpu-check-report/).
# DRY_RUN=1 runs the same driver here, in the virtual environment, with every GPU step only prepared.
gpu-check: $(if $(DRY_RUN),install)
	$(if $(DRY_RUN),$(PY),$(PYTHON)) -m benchmarks.gpu_check $(if $(DRY_RUN),--dry-run)

# Wheels the GPU machine lacks (Python 3.12, x86-64), fetched here into .gpu-wheels/ to travel with the
# repository: gradsync's imports need highspy; the DeepSpeed step needs DeepSpeed (a wheel built here
# from its source, without compiled ops) and its dependencies.
GPU_WHEELS ?= highspy==1.16.0 einops==0.8.2 hjson==3.1.0 msgpack==1.2.4 ninja==1.13.2 py-cpuinfo==9.0.0 \
	pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 psutil==7.2.2 \
	typing_extensions==4.16.0
gpu-wheels: install
	$(PY) -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
		-d .gpu-wheels $(GPU_WHEELS)
	$(PY) -m pip wheel -q --disable-pip-version-check --no-deps --no-build-isolation -w .gpu-wheels \
		deepspeed==$$($(PY) -c "import importlib.metadata as m; print(m.version('deepspeed'))")

clean:
	rm -rf $(VENV) build *.egg-info
