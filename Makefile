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

demo: install
	$(VENV)/bin/gradsync simulate --model resnet50 --workers 8 --cluster asc-wfbp-10gbe --schedulers all
	$(VENV)/bin/gradsync plan --model resnet50 --workers 8 --cluster asc-wfbp-10gbe --scheduler mg_wfbp --timeline demo-timeline.png

test: install
	$(PY) -m pytest -q

bench: install
	$(PY) benchmarks/planner_speed.py
	$(PY) benchmarks/reproduce_planners.py > /dev/null && echo "wrote benchmarks/results/reproduce_planners.md"
	$(PY) benchmarks/overhead.py

clean:
	rm -rf $(VENV) build *.egg-info
