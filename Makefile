# OTL: every stage, per data set.  `make eurosat` runs prepare -> train -> kNN -> linear -> report.
#   make eurosat                    self-supervised OTL + random-init baseline + report
#   make eurosat-supervised         the same network and schedule on the true labels
#   make test                       the test suite (what CI runs)
#   make labeler-bench              ours vs the published labeler vs Sinkhorn-Knopp: time, balance, memory
#   make labeler-bench-gpu          the same on a CUDA GPU
#   make labeler-profile-gpu        where the exact labeler's time goes on a GPU (1.28M x 3000)
#   make labeler-compare REV=HEAD   a labeler change: the same labels and T as REV's, and the time
#   make labeler-matrix             the matrix: ours vs the published rules on real outputs, k = 10..3000
#   make train-bench-gpu            training and label-pass images/s against a plain supervised loop
#   make hmhr                       HMHR by the transfer protocol: OTL from EuroSAT's OTL backbone, beside scratch and supervised
#   make ucmerced|siri_whu SRC=..   the same three runs (transfer protocol; INIT=<checkpoint>: another backbone)
#   make cifar10                    CIFAR-10 with AlexNet (the CPU twin here), from ../shared/data; likewise
#     make aid|patternnet|nwpu_resisc45|cifar100|svhn SRC=<archive or folder>   (from scratch)
#   make data DATASET=.. SRC=..     prepare any registered data set (hmhr-data, cifar10-data: ../shared/data)
#   make ablations                  every study of the paper (ablations.py); one at a time:
#     make ablation-beta|k-labeler|sinkhorn    labeler studies (minutes)
#     make ablation-k|uneven|imbalanced|splits|labeler-in-training|lct   training studies (EuroSAT,
#       3 seeds, <= 4 h each on 2 CPU cores; ABL_PRESET=paper: CIFAR-10 at the paper's scale, a GPU)
#   make ablation-label-bn          the label pass's BatchNorm mode (eval or batch statistics)
# Variables: PRESET=auto|paper|fast|cpu|... (auto: the data set's protocol on CUDA, its CPU twin
#   otherwise; docs/presets.md), DEVICE=auto|cpu|cuda,
#   EUROSAT_SRC=<zip or folder>|download, RUNS=runs, TRAIN_ARGS="--epochs 4 ..." (extra flags),
#   INIT=<checkpoint> and TRANSFER_PRESET=transfer|transfer-cpu (ucmerced, siri_whu; HMHR_*: hmhr),
#   PREP_ARGS="--size 150" (extra prepare_data.py flags: AID from a 150-px copy).

PY        ?= .venv/bin/python
TRANSFER_SETS = ucmerced siri_whu
SCRATCH_SETS  = aid patternnet nwpu_resisc45 cifar10 cifar100 svhn
SETS       = $(TRANSFER_SETS) $(SCRATCH_SETS)
PRESET    ?= auto
DEVICE    ?= auto
RUNS      ?= runs
TRAIN_ARGS ?=
EUROSAT_SRC ?= $(if $(wildcard ../shared/data/EuroSAT.zip),../shared/data/EuroSAT.zip,download)
SRC_FLAG   = $(if $(filter download,$(EUROSAT_SRC)),--download,--source $(EUROSAT_SRC))
STAMP      = .venv/.installed

.PHONY: eurosat eurosat-supervised eurosat-data data hmhr hmhr-data cifar10-data $(SETS) eval-run labeler-bench labeler-matrix labeler-bench-gpu labeler-profile-gpu labeler-compare train-bench-gpu ablations $(addprefix ablation-,$(ABLATIONS)) ablation-label-bn test setup clean-runs help
.DELETE_ON_ERROR:

help:
	@sed -n '1,25p' Makefile

setup: $(STAMP)
$(STAMP): requirements.txt
	python3 -m venv .venv
	.venv/bin/python -m pip install -q -r requirements.txt
	touch $@

test: $(STAMP)
	$(PY) -m pytest -q tests

# ---------------------------------------------------------------------------- EuroSAT
eurosat-data: $(STAMP)
	$(PY) prepare_data.py --dataset eurosat $(SRC_FLAG) --out data/eurosat

# One chain per run folder: train (resumes if interrupted), evaluate the final checkpoint and
# the random-init snapshot (checkpoint0000.pth), then the report.
eurosat: eurosat-data
	@$(PY) -c "import utils; d = utils.pick_device('$(DEVICE)'); p = utils.preset_for('$(PRESET)', d); \
	  print('=' * 72 + f'\n  make eurosat: PRESET={p} on {d}' + (' (the CPU preset: docs/presets.md says what it gives up)' if p == 'cpu' else '') + '\n' + '=' * 72)"
	$(PY) train_otl.py --data data/eurosat --output $(RUNS)/eurosat --preset $(PRESET) --device $(DEVICE) $(TRAIN_ARGS)
	$(MAKE) --no-print-directory eval-run RUN=$(RUNS)/eurosat
	$(PY) report.py --dataset eurosat --runs $(RUNS) --out results

eurosat-supervised: eurosat-data
	$(PY) train_otl.py --data data/eurosat --output $(RUNS)/eurosat_supervised --supervised --preset $(PRESET) --device $(DEVICE) $(TRAIN_ARGS)
	$(MAKE) --no-print-directory eval-run RUN=$(RUNS)/eurosat_supervised
	$(PY) report.py --dataset eurosat --runs $(RUNS) --out results

# evaluate the last checkpoint of RUN and its random-init snapshot (FEATURE: eval_knn.py --feature)
# (LINEAR_FEATURE: the linear probe's, FEATURE's by default)
FEATURE ?= pool
LINEAR_FEATURE ?= $(FEATURE)
eval-run:
	$(PY) eval_knn.py --checkpoint $(RUN)/checkpoint.pth --device $(DEVICE) --feature $(FEATURE)
	$(PY) eval_linear.py --checkpoint $(RUN)/checkpoint.pth --device $(DEVICE) --feature $(LINEAR_FEATURE)
	$(PY) eval_knn.py --checkpoint $(RUN)/checkpoint0000.pth --device $(DEVICE) --feature $(FEATURE)
	$(PY) eval_linear.py --checkpoint $(RUN)/checkpoint0000.pth --device $(DEVICE) --feature $(LINEAR_FEATURE)

# ---------------------------------------------------------------------------- other data sets
# Any data set of prepare_data.py's registry (eurosat ucmerced siri_whu aid patternnet
# nwpu_resisc45 hmhr cifar10 cifar100 svhn imagenet folder) from a local archive or folder:
#   make data DATASET=ucmerced SRC=path/to/UCMerced_LandUse.zip
data: $(STAMP)
	$(PY) prepare_data.py --dataset $(DATASET) --source $(SRC) --out data/$(DATASET) $(PREP_ARGS)

HMHR_DATA   ?= data/hmhr
HMHR_PREP   ?=
hmhr-data: $(STAMP)
	$(PY) prepare_data.py --dataset hmhr --source $(or $(SRC),../shared/data/HMHR.zip) --out $(HMHR_DATA) $(HMHR_PREP)

# HMHR, the paper's transfer protocol: OTL from a backbone pretrained by OTL on EuroSAT (HMHR_INIT,
# by default this folder's make eurosat run, made first if missing), OTL from random init, and
# supervised from the same backbone; each evaluated, then results/hmhr_transfer.md.
# HMHR_PRESET: TRANSFER_PRESET by default (transfer on CUDA, where make eurosat trains a
# paper-preset backbone; transfer-cpu for a cpu-preset one).
# HMHR keeps its duplicates as found (10 of the 106 test images have a copy in the training
# split); HMHR_PREP=--drop-duplicates HMHR_DATA=data/hmhr_dedup HMHR_REPORT=hmhr_transfer_dedup
# RUNS=runs/dedup runs the same without them.
HMHR_INIT   ?= $(RUNS)/eurosat/checkpoint.pth
HMHR_PRESET ?= $(TRANSFER_PRESET)
HMHR_REPORT ?= hmhr_transfer
hmhr: hmhr-data
hmhr: T_DATA = $(HMHR_DATA)
hmhr: T_PREFIX = hmhr
hmhr: T_PRESET = $(HMHR_PRESET)
hmhr: T_INIT = $(HMHR_INIT)
hmhr: T_REPORT = $(HMHR_REPORT)

# The transfer protocol's three runs, one recipe for hmhr and the small sets (ucmerced, siri_whu:
# their T_* below), each target saying what by its T_* variables: T_PREP (prepare the data, if
# the recipe does it), then on T_DATA with T_PRESET: T_PREFIX_from_eurosat (OTL from T_INIT's
# backbone, make eurosat first if it is missing), T_PREFIX_scratch (OTL from random init) and
# T_PREFIX_supervised_from_eurosat (supervised from T_INIT); eval-run each, then
# results/T_REPORT.md (report.py --rows).
hmhr $(TRANSFER_SETS):
	$(T_PREP)
	test -f $(T_INIT) || $(MAKE) --no-print-directory eurosat
	$(PY) train_otl.py --data $(T_DATA) --output $(RUNS)/$(T_PREFIX)_from_eurosat --preset $(T_PRESET) --init $(T_INIT) --device $(DEVICE) $(TRAIN_ARGS)
	$(PY) train_otl.py --data $(T_DATA) --output $(RUNS)/$(T_PREFIX)_scratch --preset $(T_PRESET) --device $(DEVICE) $(TRAIN_ARGS)
	$(PY) train_otl.py --data $(T_DATA) --output $(RUNS)/$(T_PREFIX)_supervised_from_eurosat --supervised --preset $(T_PRESET) --init $(T_INIT) --device $(DEVICE) $(TRAIN_ARGS)
	for r in $(T_PREFIX)_from_eurosat $(T_PREFIX)_scratch $(T_PREFIX)_supervised_from_eurosat; do $(MAKE) --no-print-directory eval-run RUN=$(RUNS)/$$r || exit 1; done
	$(PY) report.py --dataset $@ --runs $(RUNS) --out results --name $(T_REPORT) --rows "OTL from EuroSAT OTL=$(T_PREFIX)_from_eurosat" "OTL from random init=$(T_PREFIX)_scratch" "supervised from EuroSAT OTL=$(T_PREFIX)_supervised_from_eurosat"

cifar10-data: $(STAMP)
	$(PY) prepare_data.py --dataset cifar10 $(if $(SRC),--source $(SRC),$(if $(wildcard ../shared/data/cifar10_jpg.zip),--source ../shared/data/cifar10_jpg.zip,--download)) --out data/cifar10

# make <set> [SRC=<archive or folder>] for the paper's other data sets: prepare (from SRC, else
# from ../shared/data where it is there, else --download where the set has a checksummed
# source), then
# - ucmerced, siri_whu (TRANSFER_SETS): the paper's transfer protocol, as make hmhr: OTL from the
#   backbone INIT (default this folder's make eurosat run, made first if missing), OTL from random
#   init and supervised from INIT, each with TRANSFER_PRESET (transfer on CUDA, transfer-cpu
#   otherwise: it must match INIT's backbone, the cpu or the paper preset's) and evaluated, then
#   results/<set>_transfer.md;
# - the rest (SCRATCH_SETS): OTL from scratch with PRESET (auto: the data set's protocol, paper or
#   alexnet-cifar on CUDA and their CPU twins otherwise: docs/presets.md), kNN and linear probe of
#   the final and the random-init network (kNN on the 128-d embedding when the model has one;
#   natural images: the linear probe on conv5, as the paper), then results/<set>.md and the
#   overview results/tables.md.
#   make cifar10                           AlexNet on CUDA (its CPU twin cifar-cpu: ResNet-18), from ../shared/data
#   make ucmerced SRC=UCMerced_LandUse.zip ResNet-18 from make eurosat's backbone, three runs
#   make ucmerced SRC=... INIT=runs/x/checkpoint.pth TRANSFER_PRESET=transfer    another backbone
#   make cifar10 PRESET=resnet50-cifar RUN_NAME=cifar10_resnet50    the ResNet-50 table's run
# RUN_NAME names the run folder (the transfer sets: the prefix of their three, and of the report).
# ImageNet has no preset of its own: make data DATASET=imagenet SRC=..., then train_otl.py.
SHARED_cifar10 = cifar10_jpg.zip
RUN_NAME ?=
INIT     ?= $(RUNS)/eurosat/checkpoint.pth
# DEVICE=auto asks torch (utils.pick_device, as make eurosat's banner), once, only when used
TRANSFER_DEVICE = $(eval TRANSFER_DEVICE := $(if $(filter auto,$(DEVICE)),$$(shell $(PY) -c "import utils; print(utils.pick_device('auto').type)" 2>/dev/null),$(DEVICE)))$(TRANSFER_DEVICE)
TRANSFER_PRESET ?= $(if $(filter cuda%,$(TRANSFER_DEVICE)),transfer,transfer-cpu)
PREPARE_SET = $(PY) prepare_data.py --dataset $@ $(if $(SRC),--source $(SRC),$(if $(and $(SHARED_$@),$(wildcard ../shared/data/$(SHARED_$@))),--source ../shared/data/$(SHARED_$@),--download)) --out data/$@ $(PREP_ARGS)
$(SETS): NAME = $(or $(RUN_NAME),$@)
# the paper's natural-image tables: kNN on the embedding (auto), the linear probe on conv5 (a
# ResNet's conv5 is its last stage: the pooled features)
$(SCRATCH_SETS): LIN_FEATURE = $(if $(filter cifar10 cifar100 svhn,$@),conv5,auto)
$(TRANSFER_SETS): $(STAMP)
$(TRANSFER_SETS): T_PREP = $(PREPARE_SET)
$(TRANSFER_SETS): T_DATA = data/$@
$(TRANSFER_SETS): T_PREFIX = $(NAME)
$(TRANSFER_SETS): T_PRESET = $(TRANSFER_PRESET)
$(TRANSFER_SETS): T_INIT = $(INIT)
$(TRANSFER_SETS): T_REPORT = $(NAME)_transfer

$(SCRATCH_SETS): $(STAMP)
	$(PREPARE_SET)
	$(PY) train_otl.py --data data/$@ --output $(RUNS)/$(NAME) --preset $(PRESET) --device $(DEVICE) $(TRAIN_ARGS)
	$(MAKE) --no-print-directory eval-run RUN=$(RUNS)/$(NAME) FEATURE=auto LINEAR_FEATURE=$(LIN_FEATURE)
	$(PY) report.py --dataset $@ --runs $(RUNS) --out results --otl-run $(NAME) --name $(NAME) --feature auto --linear-feature $(LIN_FEATURE)
	$(PY) report.py --overview --out results

# ------------------------------------------------------------------------- benchmarks
# The labelers on the same outputs (gaussian N = 50,000, k = 50..1000; EuroSAT outputs of a fresh and
# of the trained network when data/eurosat and runs/eurosat exist; 1.28M x 3000 streamed in chunks).
labeler-bench: eurosat-data
	$(PY) bench/bench_labeler.py --out results/labeler_bench.json --plot results/labeler_bench.png

# the matrix (results/labeler_matrix_v34.md): ours against the published rules on random and
# trained networks' outputs, EuroSAT and CIFAR-10, all images and the training split, k = 10 .. 3000;
# six runs, then the table over them (about an hour on 2 cores).  Needs the trained networks of
# `make eurosat` and `make cifar10`; MATRIX_V names the files.
MATRIX_V ?= new
MATRIX_RUN = $(PY) bench/bench_labeler.py --skip-large --ks 10 --methods exact,published
MATRIX_E = --data data/eurosat --net cpu --checkpoint $(RUNS)/eurosat/checkpoint.pth
MATRIX_C = --data data/cifar10 --net alexnet-cifar-cpu --checkpoint $(RUNS)/cifar10/checkpoint.pth --real-split train
MATRIX_OUT = $(foreach s,eurosat_small_k eurosat_train_small_k cifar10_small_k eurosat_large_k eurosat_train_large_k cifar10_large_k,results/labeler_bench_$(MATRIX_V)_$(s).json)
labeler-matrix: eurosat-data cifar10-data
	@for f in $(RUNS)/eurosat/checkpoint.pth $(RUNS)/cifar10/checkpoint.pth; do test -f $$f || \
	  { echo "$$f is missing: the matrix needs the trained networks of make eurosat and make cifar10"; exit 1; }; done
	$(MATRIX_RUN) $(MATRIX_E) --real-ks 10,50,100,128 --trained-ks 10,50,100 --fresh 5 --out $(word 1,$(MATRIX_OUT))
	$(MATRIX_RUN) $(MATRIX_E) --real-split train --real-ks 10,50,100,128 --trained-ks 10,50,100 --fresh 5 --out $(word 2,$(MATRIX_OUT))
	$(MATRIX_RUN) $(MATRIX_C) --real-ks 10,50,100,128 --trained-ks 10,50,100 --fresh 5 --out $(word 3,$(MATRIX_OUT))
	$(MATRIX_RUN) $(MATRIX_E) --real-ks 500,1000,3000 --trained-ks 500,1000,3000 --out $(word 4,$(MATRIX_OUT))
	$(MATRIX_RUN) $(MATRIX_E) --real-split train --real-ks 500,1000,3000 --trained-ks 500,1000,3000 --out $(word 5,$(MATRIX_OUT))
	$(MATRIX_RUN) $(MATRIX_C) --real-ks 500,1000,3000 --trained-ks 500,1000,3000 --out $(word 6,$(MATRIX_OUT))
	$(PY) bench/bench_labeler.py --summary $(MATRIX_OUT) --matrix-plot results/labeler_matrix_$(MATRIX_V).png \
	  > results/labeler_matrix_$(MATRIX_V).md
	@tail -n 1 results/labeler_matrix_$(MATRIX_V).md

# the same on a GPU (Gaussian inputs; the published labeler on 640,000 rows, which its float64
# copies fit in 80 GB)
labeler-bench-gpu: $(STAMP)
	PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True $(PY) bench/bench_labeler.py --device cuda --skip-real \
	  --ref-n 640000 --repeat 3 --out results/labeler_bench_gpu.json --plot results/labeler_bench_gpu.png

labeler-profile-gpu: $(STAMP)
	$(PY) bench/profile_labeler.py --device cuda --out results/labeler_profile_gpu.txt

# otl_scale.py's tuned labeler against REV's (a commit, or a path to another otl_scale.py): bit-for-bit
# labels and T on Gaussian, collapsed and grouped inputs at k = 2 - 3000 and the time of each,
# 320,000 x 3000 included (about 3 minutes on 2 cores); fails if any case differs
REV ?= HEAD
labeler-compare: $(STAMP)
	$(PY) bench/compare_labelers.py $(REV) otl_scale.py --inputs small,stream,large --expect-same

# images/s of the OTL step, the label pass and augmentation at 224, 112 and 64 px, and of a plain
# supervised ResNet-18 loop (the ceiling); torch.compile timed at 112 px
train-bench-gpu: $(STAMP)
	$(PY) bench/bench_train.py --device cuda --sizes 224,112,64 --compile 112 --out results/train_throughput_gpu.json

# ------------------------------------------------------------------------- experiments
# The paper's studies (ablations.py --help; docs/ablations.md): each resumes where it stopped and
# writes results/ablations/<study>.json, .md, .png.  ABL_ARGS: extra ablations.py flags.
ABL_PRESET ?= study
ABL_ARGS   ?=
ABL_LABELER = beta k-labeler sinkhorn
ABL_TRAIN   = k uneven imbalanced labeler-in-training lct
ABLATIONS   = $(ABL_LABELER) $(ABL_TRAIN) splits
ablations: $(addprefix ablation-,$(ABLATIONS))

# the labeler studies take CIFAR-10's training split as input; the training studies train on
# EuroSAT at study scale and on CIFAR-10 at the paper's (ablations.py's SCALES)
$(addprefix ablation-,$(ABL_LABELER)): ablation-%: cifar10-data
	$(PY) ablations.py $* --preset $(ABL_PRESET) --device $(DEVICE) $(ABL_ARGS)

$(addprefix ablation-,$(ABL_TRAIN)): ablation-%: $(if $(filter paper,$(ABL_PRESET)),cifar10-data,eurosat-data)
	$(PY) ablations.py $* --preset $(ABL_PRESET) --device $(DEVICE) $(ABL_ARGS)

# splits: five divisions of SIRI-WHU (prepared by make siri_whu SRC=.. or make data
# DATASET=siri_whu SRC=..), OTL and supervised from INIT (make eurosat's run, made if missing)
ablation-splits: $(STAMP)
	@test -f data/siri_whu/manifest.json || { echo "data/siri_whu is not prepared: make data DATASET=siri_whu SRC=<the SIRI-WHU folder> first (docs/datasets.md says where it is)"; exit 1; }
	test -f $(INIT) || $(MAKE) --no-print-directory eurosat
	$(PY) ablations.py splits --init $(INIT) --preset $(ABL_PRESET) --device $(DEVICE) $(ABL_ARGS)

# The label pass's BatchNorm mode on a fresh cpu-preset network (docs/label_bn.md)
ablation-label-bn: eurosat-data
	$(PY) ablations.py label-bn --data data/eurosat --output $(RUNS)/label_bn --device $(DEVICE)

clean-runs:
	rm -rf $(RUNS)
