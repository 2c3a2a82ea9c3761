# The documented entry points. `make train` and `make test` set everything up on a fresh machine.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch 2.14.1 + torchvision 0.29.1: the pair that works together on these machines (pip takes them from local disk)
TORCH := torch==2.14.1 torchvision==0.29.1
STAMP := $(VENV)/.installed
# MLflow and DVCLive for their tests alone (tests/test_callbacks.py), each in a folder of its own that only its test
# puts on PYTHONPATH: installed into the venv, Ultralytics' default settings would switch them on for every run there
# (make train, make bench)
TRACKERS := $(VENV)/trackers
TRACKERS_DVCLIVE := $(VENV)/trackers-dvclive

.PHONY: install train test numerics test-fast lint format clean bench bench-defaults bench-precise-bn bench-ddp bench-smoke bench-compile bench-bn bench-startup fidelity pretrain fidelity-finetune

install: $(STAMP)

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e ".[dev]"
	$(BIN)/pip install -q --target $(TRACKERS) --upgrade "mlflow-skinny>=3"
	$(BIN)/pip install -q --target $(TRACKERS_DVCLIVE) --upgrade "dvclive>=3"
	touch $(STAMP)

# The embedded default run: shapes (generated on first use), yolo26n at 160 px, batch 8 accumulated to nbs 64.
train: install
	$(BIN)/yoloaccum train data=datasets/shapes.yaml model=yolo26n.yaml imgsz=160 batch=8 nbs=64 epochs=35 \
		workers=2 warmup_epochs=1 close_mosaic=5 project=runs/train name=shapes

# A pytest-xdist worker per core, each test file on one worker (its module fixtures are made once), one thread each;
# the longest files first (tests/conftest.py: LONGEST_FIRST), not xdist's order by number of tests.
XDIST := -n auto --dist loadfile --no-loadscope-reorder

# Everything in one session, the exactness proofs' tally named at its end ("numerics gate passed: ..."; tests/conftest.py).
# Run first and apart, the gate built the fixtures of the files it shares with the rest twice and left a core idle at
# the end of each part: 1 min 30 s more (docs/testing.md).
test: install
	$(BIN)/python -m pytest $(XDIST) --durations=25

numerics: install  # k micro-batches equal one big batch, bitwise resume, DDP equivalence, parity with Ultralytics
	$(BIN)/python -m pytest $(XDIST) -m numerics --durations=10

test-fast: install
	$(BIN)/python -m pytest $(XDIST) -m "not slow"

lint: install
	$(BIN)/ruff check yoloaccum tests benchmarks
	$(BIN)/ruff format --check yoloaccum tests benchmarks

format: install
	$(BIN)/ruff format yoloaccum tests benchmarks
	$(BIN)/ruff check --fix yoloaccum tests benchmarks

clean:
	rm -rf $(VENV) runs datasets/shapes .pytest_cache

# Benchmarks write benchmarks/results*.{md,json}; `make test` runs only their reduced forms (tests/test_bench_smoke.py).
bench-ddp: install  # no_sync's step time; validation and cache=ram with 1 and 2 ranks (docs/performance.md)
	$(BIN)/python -m torch.distributed.run --standalone --nproc_per_node=2 benchmarks/ddp.py
	$(BIN)/python benchmarks/ddp_validation.py
bench: install  # its duration on 2 CPU cores: docs/performance.md
	$(BIN)/python benchmarks/defaults.py
	$(BIN)/python benchmarks/precise_bn.py cost
	$(BIN)/python benchmarks/time_split.py
	$(BIN)/python benchmarks/bench.py

bench-defaults: install  # make bench's headline alone: both trainers at their defaults, whole process and per epoch
	$(BIN)/python benchmarks/defaults.py

bench-precise-bn: install  # precise_bn's share of an epoch on make train's recipe and BCCD
	$(BIN)/python benchmarks/precise_bn.py cost

bench-smoke: install
	$(BIN)/python benchmarks/bench.py --smoke

bench-bn: install  # bn=window (and bn_window=16) against bn=batch, side by side (docs/batchnorm.md)
	$(BIN)/python benchmarks/bn_window.py

bench-startup: install  # how fast commands that train nothing answer
	$(BIN)/python benchmarks/startup.py

bench-compile: install  # make bench's section (h) alone: compile=True against eager and Ultralytics (docs/compile.md)
	$(BIN)/python benchmarks/bench.py --compile-only

# Accuracy over seeds against a real batch of 64 and Ultralytics' trainer: benchmarks/fidelity.{md,json,png}, and on
# BCCD (when ../shared has it) benchmarks/fidelity-bccd-30/. Long
# (hours on 2 CPU cores); finished runs are kept in fidelity.json, so it continues where it stopped.
fidelity: install
	$(BIN)/python benchmarks/fidelity.py
	@if [ -f ../shared/datasets/bccd.yaml ]; then \
		$(BIN)/python benchmarks/fidelity.py --data bccd --epochs 30 --configs b64 b8 b4 b4-window b2 b2-window --seeds 0 1 2; \
	else echo "fidelity: ../shared/datasets/bccd.yaml is not here, so the BCCD runs are skipped"; fi

# The fine-tuning study's starting point: yolo26n trained on ../shared's hardhat photographs with a real batch of 64 at
# 224 px, in benchmarks/pretrained/ (the .pt outside git's tree) with its SHA-256, mAP and results.csv: restored from
# git's history where a commit there holds the recorded file, else trained (85 minutes on 2 CPU cores).
pretrain: install
	$(BIN)/python benchmarks/pretrain.py

# Fine-tuning at micro-batches 2 to 8 from make pretrain's checkpoint (made first when missing), on BCCD (seeds 0-4)
# and aquarium (seeds 0-2) from ../shared: benchmarks/records/finetune/. Hours on 2 CPU cores; finished runs are kept.
fidelity-finetune: install
	$(BIN)/python benchmarks/fidelity_finetune.py
