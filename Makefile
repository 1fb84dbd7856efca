# commlib: `make test` and `make bench` set everything up in .venv (no system MPI needed).
PYTHON  ?= python3
VENV    := .venv
PY      := $(VENV)/bin/python
MPIEXEC := $(VENV)/bin/mpiexec
EXTRAS  ?= mpich,torch,horovod,jax,tune,test,bench,dev
STAMP   := $(VENV)/.installed-$(shell cat setup.cfg pyproject.toml constraints.txt | cksum | cut -d' ' -f1)
RESULTS ?= benchmarks/results/latest
# the emulated cluster of `make bench` (benchmarks/cluster): ranks, link rate, extra options
RANKS   ?= 4
RATE    ?= 1gbit
CLUSTER ?=
# a hung MPI test run is killed after this many seconds
MPI_TEST_TIMEOUT ?= 900
# processes of the single-process run (pytest-xdist; each its own world of one)
TEST_WORKERS ?= 2
# XLA's compiled programs on disk, shared by the test runs (the 4-rank run compiles much of what
# the 2-rank run did: its JAX tests took 140 s cold, 86 s after it); `make clean` removes it
JAX_CACHE := $(CURDIR)/.jax-cache
test-serial test-mpi: export JAX_COMPILATION_CACHE_DIR := $(JAX_CACHE)
test-serial test-mpi: export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS := 0

.PHONY: setup test test-serial test-mpi lint bench bench-local bench-cluster bench-train clean

setup: $(STAMP)

# setup.cfg states ranges; constraints.txt pins the versions these machines run
$(STAMP): setup.cfg pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --disable-pip-version-check -q -c constraints.txt -e ".[$(EXTRAS)]"
	rm -f $(VENV)/.installed-*
	touch $@

lint: $(STAMP)
	$(PY) -m ruff check .

test-serial: $(STAMP)
	$(PY) -m pytest --with-mpi -q -p no:cacheprovider -n $(TEST_WORKERS)

test-mpi: $(STAMP)
	PYTHON=$(abspath $(PY)) timeout -k 10 $(MPI_TEST_TIMEOUT) $(MPIEXEC) -n 2 tests/mpi_pytest.sh -q
	PYTHON=$(abspath $(PY)) timeout -k 10 $(MPI_TEST_TIMEOUT) $(MPIEXEC) -n 4 tests/mpi_pytest.sh -q

test: lint test-serial test-mpi

# the emulated cluster (benchmarks/cluster, issue 3) joins `make bench` once it lands
bench: bench-local $(if $(wildcard benchmarks/cluster/__main__.py),bench-cluster bench-train)

bench-local: $(STAMP)
	mkdir -p $(RESULTS)
	timeout -k 10 1800 $(MPIEXEC) -n $(RANKS) $(PY) -m benchmarks.collectives \
		--json $(RESULTS)/collectives-local.json --plot $(RESULTS)/collectives-local.png
	timeout -k 10 600 $(MPIEXEC) -n 2 $(PY) -m benchmarks.syncbn --json $(RESULTS)/syncbn-2ranks.json
	timeout -k 10 600 $(MPIEXEC) -n 2 $(PY) -m benchmarks.jax_steps --json $(RESULTS)/jax-steps-2ranks.json
	timeout -k 10 900 $(PY) -m benchmarks.instructions --json $(RESULTS)/instructions.json

bench-cluster: $(STAMP)
	mkdir -p $(RESULTS)
	$(PY) -m benchmarks.cluster --ranks $(RANKS) --rate $(RATE) --timeout 1700 $(CLUSTER) -- \
		$(abspath $(PY)) -m benchmarks.collectives --min-bytes 65536 --rounds 2 --no-torch \
		--json $(RESULTS)/collectives-cluster.json --plot $(RESULTS)/collectives-cluster.png

# training steps against their overlap bounds, DDP/gloo vs AllReduce vs DeAR, over a sweep of link
# rates on one emulated cluster per rank count (2 ranks: one core each; then $(RANKS)); issue 12 item 5
TRAIN_RATES ?= 100mbit 250mbit 500mbit 1gbit
TRAIN_RANKS ?= 2 $(RANKS)
TRAIN   ?=
bench-train: $(STAMP)
	mkdir -p $(RESULTS)
	set -e; for n in $(sort $(TRAIN_RANKS)); do \
		$(PY) -m benchmarks.cluster --ranks $$n --rate 1gbit --prefix tr- --timeout 1200 $(CLUSTER) -- \
			$(abspath $(PY)) -m benchmarks.train --rates $(TRAIN_RATES) $(TRAIN) \
			--json $(RESULTS)/train-$${n}ranks-sweep.json --plot $(RESULTS)/train-$${n}ranks-sweep.png; \
	done

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache .pytest-rank*.log $(JAX_CACHE)
