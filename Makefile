# specsamp make targets. `make help` lists them.
PYTHON ?= python

.PHONY: help install lint format test test-all bench bench-latency bench-rev bench-samplers bench-presets bench-auto gpu-check bench-gpu gmm beyond figures tables sweep-local clean train-digits train-digits-cfg digits bench-digits train-patches patches

help:  ## list targets
	@grep -E '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/'

install:  ## install the package with every extra (what CI does)
	$(PYTHON) -m pip install -e ".[all]"

lint:  ## ruff's lint and format check (rules and width in pyproject.toml), then the dead-code scan (vulture); CI runs it before the tests
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .
	$(PYTHON) -m vulture

format:  ## rewrite the tree: ruff's safe fixes (import order, pyupgrade...), ruff's format, then list what is left to fix by hand
	$(PYTHON) -m ruff check --fix-only .
	$(PYTHON) -m ruff format .
	$(PYTHON) -m ruff check .

test:  ## default test run (slow tests excluded), with the line coverage of specsamp/
	$(PYTHON) -m pytest -q --cov --cov-report=term-missing -n auto --maxprocesses=4 --dist worksteal

test-all:  ## every test, slow ones included
	$(PYTHON) -m pytest -q -m ""

bench:  ## CPU benchmarks (overhead, scaling, grid vs numpy, memory, coupling, ops and syncs per round, compile=true against eager on a batch), about 5 min; full size: make bench ARGS=--full
	$(PYTHON) -m benchmarks.bench $(ARGS)

bench-latency:  ## latency on the digits network, n = 1..8 images, standard vs each arm, real CPU and calls padded to 2, 5, 20 ms: results/digits/latency.csv, then where a round's own time goes (about 8 min; both name the CPU)
	OMP_NUM_THREADS=1 $(PYTHON) -m benchmarks.latency --out results/digits/latency.csv $(ARGS)
	OMP_NUM_THREADS=1 $(PYTHON) -m benchmarks.roundcost

bench-rev:  ## the sampler's latency here against git revision REV, interleaved in one sitting (digits, one image, one thread): make bench-rev REV=0e196ae
	$(PYTHON) -m benchmarks.revlatency $(REV) $(ARGS)

bench-samplers:  ## DDPM (1000, 100 steps), Euler ancestral (50) and stochastic flow matching (28) against the scheduler's own loop on the digits network and the mixture: calls, acceptance per depth and one-image wall clock, X
	OMP_NUM_THREADS=1 $(PYTHON) -m benchmarks.samplers --search --n 16 --out results/samplers.json $(ARGS)

bench-presets:  ## the samplers people run at 20-30 steps (Euler a and DPM++ 2M SDE on Karras levels, flow Euler a at 28) against their original loops on digits, patches32 and the mixture: calls, acceptance per depth, one-image wall clock real and padded to 5 and 20 ms (about 12 min)
	OMP_NUM_THREADS=1 $(PYTHON) -m benchmarks.presets --out results/presets.json $(ARGS)

bench-auto:  ## auto against the loop, the grid's best setting and ParaDiGMS (DDPM), interleaved per cell: results/auto.json, .csv (the committed cells, about 35 min; others: ARGS="--cells digits/ddpm:100/1/pad5")
	OMP_NUM_THREADS=1 $(PYTHON) -m benchmarks.auto --cells committed --out results/auto.json $(ARGS)

gpu-check:  ## GPU check from the working tree with python3 (< 5 min on one large GPU): one JSON per section and summary.txt in $OUT or ./gpu_check/ (rehearsal: ARGS="--device cpu --tiny")
	python3 -m benchmarks.gpu_check $(ARGS)

bench-gpu: gpu-check  ## alias of gpu-check

gmm:  ## section 5.1: the 84-cell grid (Hydra multirun, two processes), its CSV and the Monte Carlo of Figure 6, in results/gmm/
	@# two halves of about equal cost side by side (one core each); every cell keeps its own directory
	$(PYTHON) run.py +experiment=gmm_grid sampler=dgrs 'K=range(1,6)' & half=$$!; \
	$(PYTHON) run.py +experiment=gmm_grid sampler=rmc && $(PYTHON) run.py +experiment=gmm_grid sampler=dgrs K=6,7; \
	status=$$?; wait $$half && test $$status -eq 0
	$(PYTHON) -m experiments.gmm collect
	$(PYTHON) -m experiments.gmm acceptance

beyond:  ## levers beyond the paper: GMM table and headline rows (results/gmm/beyond.csv, headline.csv, blockverify_*.csv), the digits network's levers table and figure (results/digits/levers.csv, levers_frontier.png)
	$(PYTHON) -m experiments.beyond run
	$(PYTHON) -m experiments.beyond headline
	$(PYTHON) -m experiments.blockverify --out results/gmm
	$(PYTHON) -m experiments.digits levers
	$(PYTHON) -m experiments.beyond figures
	$(PYTHON) -m experiments.digits figures

train-digits:  ## retrain the digits denoiser and classifier (seeded, one thread; the denoiser took 489 s on one CPU thread) into specsamp/data/
	$(PYTHON) -m experiments.train_digits

train-digits-cfg:  ## retrain the digits denoiser with label dropout 0.1 (model=digits_cfg, classifier-free guidance; seeded, one thread, about 4.5 min) into specsamp/data/
	$(PYTHON) -m experiments.train_digits --label-dropout 0.1

digits:  ## the digits network: Figure 4, FID table, two-sample tests, levers and figures in results/digits/ (18.5 min measured on 2 CPU cores)
	$(PYTHON) run.py +experiment=digits_fig4
	$(PYTHON) run.py +experiment=digits_fid
	$(PYTHON) -m experiments.digits collect
	$(PYTHON) -m experiments.digits levers
	$(PYTHON) -m experiments.digits figures

train-patches:  ## retrain the patches32 denoiser (3x32x32 crops of scikit-learn's photographs; seeded, one thread) into specsamp/data/
	$(PYTHON) -m experiments.train_patches

PATCHES_N ?= 1000
patches:  ## the patches32 network: Figure 4, two-sample tests (PATCHES_N images per arm, 1,000 as committed), levers and figures in results/patches32/
	@# the two rules side by side (one core each); every cell keeps its own directory
	$(PYTHON) run.py +experiment=patches_fig4 sampler=dgrs & half=$$!; \
	$(PYTHON) run.py +experiment=patches_fig4 sampler=rmc; status=$$?; wait $$half && test $$status -eq 0
	$(PYTHON) -m experiments.patches collect
	$(PYTHON) -m experiments.patches two_sample --n $(PATCHES_N)
	$(PYTHON) -m experiments.patches levers
	$(PYTHON) -m experiments.patches figures

bench-digits:  ## wall clock per image on the digits network, standard vs tree execution: results/digits/wallclock.csv
	$(PYTHON) benchmarks/digits_wallclock.py --out results/digits/wallclock.csv

figures:  ## rebuild every figure in results/ from the committed tables (no sampling)
	$(PYTHON) -m experiments.figures

tables:  ## aggregate a sweep directory into a CSV: make tables SWEEP=multirun/gmm_grid
	@test -n "$(SWEEP)" || { echo "error: SWEEP is unset: name the sweep directory, e.g. make tables SWEEP=multirun/gmm_grid (sweeps live in multirun/<sweep_name>)" >&2; exit 2; }
	$(PYTHON) -m specsamp.runner.report collect $(SWEEP)

clean:  ## remove run outputs (not results/)
	rm -rf outputs multirun

SWEEP_NAME ?= local-demo
# d=16, T=16, 16 trajectories: four cells that differ (K=1,2 x L=2,3: about 1.69, 1.91, 1.66, 1.97x), a few seconds each
SWEEP_ARGS ?= model.dim=16 steps=16 n_samples=16 K=1,2 L=2,3
JOBS ?= 2
sweep-local:  ## submitit sweep on this machine, then its table: make sweep-local SWEEP_NAME=demo SWEEP_ARGS="K=2,3 L=2,3" JOBS=2
	$(PYTHON) run.py -m hydra/launcher=local hydra.sweeper.max_batch_size=$(JOBS) sweep_name=$(SWEEP_NAME) $(SWEEP_ARGS); \
	status=$$?; $(PYTHON) -m specsamp.runner.report collect multirun/$(SWEEP_NAME); exit $$status

.PHONY: refine
refine:  ## Picard-refined vs plain drafts on the mixture, digits and patches32 (results/{gmm,digits,patches32}/refine.csv; about 15 minutes on 2 CPU cores)
	$(PYTHON) -m experiments.refine
