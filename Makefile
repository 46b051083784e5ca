# commsched developer entry points. Everything runs from the venv in .venv.
#   make test     venv + Horovod (cached wheel) + the whole test suite
#   make demo     run the demo
#   make venv     create/update .venv (quick when nothing changed)
#   make horovod  build Horovod 0.28.1 once per machine, or install it from the cache
#   make lint     ruff
#   make faults   the kill matrix (20 seeded kills per backend) -> faults.json
#   make soak     2,000 steps per backend: RSS, threads, store keys -> soak.json
#   make clean    build artefacts and caches in the tree (distclean: also .venv)

SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Whole-run limit for 'make test' (seconds); each test also has pytest-timeout (pyproject.toml).
TEST_TIMEOUT ?= 3600
PYTEST_ARGS ?=

VENV_STAMP := $(VENV)/.stamp-venv
VENV_DEPS := setup.py pyproject.toml $(wildcard requirements/*.txt) \
	scripts/setup_venv.sh scripts/commsched_mxnet_numpy_compat.py

export VENV PYTHON

.PHONY: venv horovod test demo lint clean distclean faults soak

venv: $(VENV_STAMP)

$(VENV_STAMP): $(VENV_DEPS)
	@scripts/setup_venv.sh
	@touch $@

# The script checks its own stamp, so this is a second or two when up to date.
horovod: venv
	@scripts/build_horovod.sh

test: venv horovod
	timeout --kill-after=30 $(TEST_TIMEOUT) $(PY) -m pytest tests \
		-p no:cacheprovider --import-mode=importlib $(PYTEST_ARGS)

faults: venv horovod
	$(PY) scripts/faults.py --kills 20 --out faults.json

soak: venv horovod
	$(PY) scripts/soak.py --steps 2000 --out soak.json

demo: venv
	$(PY) -m commsched.demo

lint: venv
	$(PY) -m ruff check .

clean:
	rm -rf build dist *.egg-info .ruff_cache .hypothesis .pytest_cache
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
