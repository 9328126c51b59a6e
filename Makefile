# The two commands a new user runs: `make test` and `make train`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: test train bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test]"
	# libtpu at exactly the installed jax version: TPU ahead-of-time compile tests.
	$(PY) -m pip install -q "jax[tpu]==$$($(PY) -c 'import jax; print(jax.__version__)')"
	touch $(STAMP)

test: $(STAMP)
	JAX_PLATFORMS=cpu TPU_SKIP_MDS_QUERY=1 $(PY) -m pytest -q $(PYTEST_ARGS)

train: $(STAMP)
	JAX_PLATFORMS=cpu TPU_SKIP_MDS_QUERY=1 $(VENV)/bin/recloss-train configs/base.yml $(TRAIN_ARGS)

bench: $(STAMP)
	JAX_PLATFORMS=cpu TPU_SKIP_MDS_QUERY=1 $(VENV)/bin/recloss-bench $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
