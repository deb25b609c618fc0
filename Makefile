# The two commands a new user needs; each runs the (idempotent) setup first.
#   make train   set up, then train the embedded default on 2 ranks
#   make test    set up (with --with-test-systems: the Debian packages of the Slurm, podman
#                and multi-node tests; with --with mlflow: the MLflow client and a server for
#                the tracking tests), then run the whole test suite
#   (make test-fast: the single-process tests only, while you work)
# Without Horovod or a compiler: make setup SETUP_ARGS=--no-horovod (or export SETUP_ARGS, so
# every target sets up that way; launch/setup.sh --help lists the options). train and doctor
# still launch with horovodrun, which that setup does not install.
VENV ?= .venv
BIN := $(VENV)/bin
NP ?= 2
SETUP_ARGS ?=

.PHONY: setup setup-tests train test test-fast lint doctor

setup:
	bash launch/setup.sh $(SETUP_ARGS)

setup-tests:
	bash launch/setup.sh $(SETUP_ARGS) --with-test-systems --with mlflow

train: setup
	PATH="$(CURDIR)/$(BIN):$$PATH" horovodrun -np $(NP) python -m hvdtrain $(ARGS)

# Two pytest workers (tests/conftest.py: test_group): one runs the tests that mostly wait
# (Slurm, the nodes, podman) beside the other's computing ones; TEST_WORKERS=0 runs in one.
TEST_WORKERS ?= 2
test: setup-tests
	$(BIN)/python -m pytest -n $(TEST_WORKERS) $(PYTEST_ARGS)

# The venv, made by setup only where it is missing: test-fast needs the venv, not setup's
# checks of what is installed (the installed Horovod's own check takes seconds on every call).
$(BIN)/python:
	bash launch/setup.sh $(SETUP_ARGS)

# The single-process layer, tests/unit: no ranks, daemons, containers or cluster. Every test
# outside tests/unit is marked distributed, multinode or slow, so the marker filter alone would
# select the same set; a unit test marked slow (a fresh Python: what it loads, flake8) runs in
# make test.
test-fast: $(BIN)/python
	$(BIN)/python -m pytest tests/unit -m "not distributed and not multinode and not slow" \
		$(PYTEST_ARGS)

lint: setup
	$(BIN)/python -m flake8 hvdtrain tests
	$(BIN)/python -m mypy

doctor: setup
	PATH="$(CURDIR)/$(BIN):$$PATH" horovodrun -np $(NP) python -m hvdtrain doctor
