# The two commands a new user runs: `make test` and `make train`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# pytest-xdist workers for both test legs (`auto`: one per core); JOBS=0 runs in one process.
JOBS   ?= auto
PYTEST := -m pytest -q -n $(JOBS) --dist loadgroup
# The test tiers (pytest markers; docs/development.md): `make test` runs the first, `make test-all` both,
# the Python 3.12 leg every test whose result depends on the stack (`stack`, either tier). TIERS overrides.
TIERS_TEST   := tier1
TIERS_ALL    := tier1 or tier2
TIERS_PY312  := stack

# The second test leg: Python 3.12 at the newest jax the resolver gives, with MaxText installed for real
# (`make test-py312`). A python3.12 on PATH that runs, else pyenv's; `make -s python312` prints it.
VENV312   ?= .venv312
PYTHON312 ?= $(shell for p in "$$(command -v python3.12)" "$$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3; do \
	  [ -x "$$p" ] && "$$p" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null && { echo "$$p"; break; }; \
	done)
STAMP312  := $(VENV312)/.installed

.PHONY: test test-all test-py312 test-tpu python312 train bench bench-py312 quality docs clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test]"
	# libtpu at exactly the installed jax version: TPU ahead-of-time compile tests.
	$(PY) -m pip install -q "jax[tpu]==$$($(PY) -c 'import jax; print(jax.__version__)')"
	touch $(STAMP)

test: $(STAMP)
	JAX_PLATFORMS=cpu TPU_SKIP_MDS_QUERY=1 $(PY) $(PYTEST) -m "$(or $(TIERS),$(TIERS_TEST))" $(PYTEST_ARGS)

test-all: $(STAMP)
	JAX_PLATFORMS=cpu TPU_SKIP_MDS_QUERY=1 $(PY) $(PYTEST) -m "$(or $(TIERS),$(TIERS_ALL))" $(PYTEST_ARGS)

# On a TPU host (docs/kernels.md): the kernels' float64-oracle tests with the Mosaic kernels instead of the
# interpreter, in one process (the chip takes one program at a time), recorded for the docs. It refuses to
# run without a TPU backend. The sharded-vs-single-device conventions need the 8-device CPU mesh a TPU host's
# single chip is not: they stay with the CPU legs. TPU_PYTHON: the host's interpreter with recloss and pytest.
TPU_PYTHON ?= $(PY)
TPU_TESTS  := tests/test_bce.py tests/test_softmax.py tests/test_bce_pallas.py tests/test_softmax_pallas.py \
              tests/test_conventions.py
TPU_RECORD ?= docs/figures/tpu/tests.json
test-tpu:
	JAX_PLATFORMS=tpu,cpu JAX_DEFAULT_MATMUL_PRECISION=highest $(TPU_PYTHON) -m pytest -q -p no:cacheprovider \
	  -p no:xdist -m "tier1 or tier2" -k "pallas and not sharded_equals_single_device" $(TPU_TESTS) --tpu-record $(TPU_RECORD) $(PYTEST_ARGS)

python312:
	@test -n "$(PYTHON312)" || { echo "no Python 3.12 found (python3.12 on PATH, or pyenv's versions/3.12.*)" >&2; exit 1; }
	@echo "$(PYTHON312)"

$(STAMP312): pyproject.toml
	@test -n "$(PYTHON312)" || { echo "no Python 3.12 found (python3.12 on PATH, or pyenv's versions/3.12.*)" >&2; exit 1; }
	test -x $(VENV312)/bin/python || $(PYTHON312) -m venv $(VENV312)
	echo '*' > $(VENV312)/.gitignore
	$(VENV312)/bin/python -m pip install -q --upgrade pip
	$(VENV312)/bin/python -m pip install -q -e ".[test,tpu,maxtext,bench]"
	touch $(STAMP312)

# RECLOSS_REQUIRE_MAXTEXT=1: the MaxText tests fail, rather than skip, when MaxText does not import.
test-py312: $(STAMP312)
	$(VENV312)/bin/python -c 'import jax, maxtext, tokamax, importlib.metadata as m; print("py312 leg:", *(f"{p} {m.version(p)}" for p in ("jax", "libtpu", "maxtext", "tokamax")))'
	RECLOSS_REQUIRE_MAXTEXT=1 JAX_PLATFORMS=cpu TPU_SKIP_MDS_QUERY=1 $(VENV312)/bin/python $(PYTEST) \
	  -m "$(or $(TIERS),$(TIERS_PY312))" $(PYTEST_ARGS)

train: $(STAMP)
	JAX_PLATFORMS=cpu TPU_SKIP_MDS_QUERY=1 $(VENV)/bin/recloss-train configs/base.yml $(TRAIN_ARGS)

bench: $(STAMP)
	JAX_PLATFORMS=cpu TPU_SKIP_MDS_QUERY=1 $(VENV)/bin/recloss-bench $(BENCH_ARGS)

# The same on the Python 3.12 venv, where Tokamax (the softmax peer rows) installs.
bench-py312: $(STAMP312)
	JAX_PLATFORMS=cpu TPU_SKIP_MDS_QUERY=1 $(VENV312)/bin/recloss-bench $(BENCH_ARGS)

# The per-chip HBM tables (README.md's headline, docs/benchmarks.md): one record per (jax, libtpu) stack, docs/figures/hbm/jax-<jax>_libtpu-<libtpu>.json,
# written by `python -m tools.hbm_figures --topology ... --record docs/figures/hbm` on each leg (minutes of v6e compiles each;
# tools/ is this repository's figure machinery, not shipped),
# then rendered into README.md's marked block (the docs render theirs at build time). FIGURE_VENVS=.venv312 re-records one leg;
# tests/test_figures.py checks the README against the records and recompiles a few rows against them.
.PHONY: figures
FIGURE_VENVS ?= $(VENV) $(VENV312)
figures: $(addsuffix /.installed,$(FIGURE_VENVS))
	for v in $(FIGURE_VENVS); do \
	  JAX_PLATFORMS=cpu TPU_SKIP_MDS_QUERY=1 $$v/bin/python -m tools.hbm_figures --topology v6e-8 --record docs/figures/hbm && \
	  JAX_PLATFORMS=cpu TPU_SKIP_MDS_QUERY=1 $$v/bin/python -m tools.hbm_figures --topology v6e-8 --objective softmax \
	    --shapes table2 --record docs/figures/hbm || exit 1; \
	done
	$(PY) -m tools.figures

# The pod-step tables (docs/sharding.md): the whole train step compiled per row, on each leg, into
# docs/figures/pod/jax-<jax>_libtpu-<libtpu>.json (~1 min a row; tests/test_pod_step.py checks against them).
.PHONY: pod-figures
pod-figures: $(addsuffix /.installed,$(FIGURE_VENVS))
	for v in $(FIGURE_VENVS); do \
	  JAX_PLATFORMS=cpu TPU_SKIP_MDS_QUERY=1 $$v/bin/python -m tools.pod_figures --record docs/figures/pod || exit 1; \
	done

# The quality-vs-cost table (docs/choosing-a-loss.md): one recloss-train run per loss on the same
# data, model, steps and seed. DATA=path/to/log.csv runs it on an interactions file instead of the
# synthetic data; QUALITY_ARGS adds key=value overrides or --hbm (v6e-8 per-chip HBM per row).
quality: $(STAMP)
	JAX_PLATFORMS=cpu TPU_SKIP_MDS_QUERY=1 $(PY) -m tools.quality configs/base.yml \
	  $(if $(DATA),dataset_type=interactions dataset_path=$(DATA)) $(QUALITY_ARGS)

# Single-point mutants of the library, each run against the first-tier tests named to catch it in a clean copy
# of the tree (tools/mutants.py; ≤ 20 minutes on 2 cores), the run appended to docs/figures/data/mutants.json,
# which docs/development.md renders. MUTANTS_ARGS: e.g. --only NAME,NAME --seed N --no-record.
.PHONY: mutants
mutants: $(STAMP)
	$(PY) -m tools.mutants $(MUTANTS_ARGS)

# The documentation site, offline, warnings as errors (-W -n: broken internal links and references fail).
# Benchmark tables are filled from docs/figures/ at build time (docs/_ext/recloss_figures.py).
docs: $(STAMP)
	JAX_PLATFORMS=cpu $(PY) -m sphinx -W -n --keep-going -q -b html docs docs/_build/html
	@echo "docs: docs/_build/html/index.html"

clean:
	rm -rf $(VENV) $(VENV312) .pytest_cache build *.egg-info docs/_build docs/_autosummary
