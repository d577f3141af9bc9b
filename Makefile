# specsamp make targets. `make help` lists them.
PYTHON ?= python

.PHONY: help install test test-all bench bench-gpu gmm beyond figures tables sweep-local clean

help:  ## list targets
	@grep -E '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/'

install:  ## install the package with every extra (what CI does)
	$(PYTHON) -m pip install -e ".[all]"

test:  ## default test run (slow tests excluded)
	$(PYTHON) -m pytest -q

test-all:  ## every test, slow ones included
	$(PYTHON) -m pytest -q -m ""

bench:  ## CPU benchmarks: sampler executions and coupling throughput
	$(PYTHON) -m specsamp.bench

bench-gpu:  ## wall-clock per image, standard vs RMC vs D-GRS (tiny on CPU: make bench-gpu ARGS="--device cpu --tiny")
	$(PYTHON) -m specsamp.bench_gpu $(ARGS)

gmm:  ## section 5.1: the 84-cell grid (Hydra multirun), its CSV and the Monte Carlo of Figure 6, in results/gmm/
	$(PYTHON) run.py +experiment=gmm_grid
	$(PYTHON) -m experiments.gmm collect
	$(PYTHON) -m experiments.gmm acceptance

beyond:  ## levers beyond the paper on the GMM (x0 draft, markmax, optimal trees): results/gmm/beyond.csv
	$(PYTHON) -m experiments.beyond run

figures:  ## rebuild every figure in results/ from the committed tables (no sampling)
	$(PYTHON) -m experiments.figures

tables:  ## aggregate a sweep directory into a CSV: make tables SWEEP=multirun/gmm_grid
	$(PYTHON) -m specsamp.report collect $(SWEEP)

clean:  ## remove run outputs (not results/)
	rm -rf outputs multirun

SWEEP_NAME ?= local-demo
# d=16, T=16, 16 trajectories: four cells that differ (about 1.67, 1.87, 1.70, 2.08x), a few seconds each
SWEEP_ARGS ?= model.dim=16 steps=16 n_samples=16 K=1,2 L=2,3
JOBS ?= 2
sweep-local:  ## submitit sweep on this machine, then its table: make sweep-local SWEEP_NAME=demo SWEEP_ARGS="K=2,3 L=2,3" JOBS=2
	$(PYTHON) run.py -m hydra/launcher=local hydra.sweeper.max_batch_size=$(JOBS) sweep_name=$(SWEEP_NAME) $(SWEEP_ARGS); \
	status=$$?; $(PYTHON) -m specsamp.report collect multirun/$(SWEEP_NAME); exit $$status
