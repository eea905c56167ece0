# OTL, every stage chained per data set: prepare -> train -> kNN and linear probe -> report.
# `make help` lists the targets; `make eurosat` is the main job, on the GPU it finds or the CPU.
#
## Main job and tests
##   eurosat                  OTL on EuroSAT and its random-init floor, then results/eurosat.md
##   eurosat-supervised       the same network and schedule on the true labels (the paper's column)
##   test                     the test suite (what CI runs)
##   setup                    the virtual environment from requirements.txt
## The paper's tables on one GPU (data from ../shared/data, SRC or the official download)
##   eurosat-gpu              table eur: the fast preset, OTL and its supervised twin
##   hmhr-gpu                 table hrs: the transfer protocol from eurosat-gpu's backbone
##   siri_whu-gpu SRC=..      table whu: the same (docs/datasets.md says where SIRI-WHU is)
##   ucmerced-gpu SRC=..      table uc: the same
##   cifar10-gpu              table ev-knn: CIFAR-10 with the cifar-fast preset
## Other data sets (PRESET=auto: the data set's protocol on CUDA, its CPU twin otherwise)
##   hmhr                     transfer protocol: OTL from make eurosat's backbone (INIT), OTL from
##                            random init, supervised from INIT; then results/hmhr_transfer.md
##   siri_whu SRC=..          the same three runs on SIRI-WHU
##   ucmerced SRC=..          the same three runs on UC Merced
##   cifar10                  from scratch, then results/cifar10.md and results/tables.md
##   cifar100 svhn            the same (downloaded)
##   aid patternnet nwpu_resisc45 SRC=..   the same from a local copy
##   eurosat-data             prepare EuroSAT into data/eurosat (EUROSAT_SRC, else ../shared/data)
## Multispectral (13 Sentinel-2 bands; SRC=EuroSATallBands.zip for all 27,000 images)
##   eurosat-ms               EuroSAT MS's sample: OTL from INIT's RGB backbone inflated to 13
##                            bands (TRANSFER_PRESET), evaluated
##   multispectral            what the bands buy: bench/multispectral.py's six rows over repeated
##                            splits, then results/multispectral.md (MS_ARGS: its flags)
##   data DATASET=.. SRC=..   prepare any registered data set into data/<DATASET>
##   eval-run RUN=..          kNN and linear probe of RUN's final and random-init checkpoints
##   tables                   results/tables.md: every table of the paper beside ours
## The paper's studies (ablations.py; docs/ablations.md); each resumes where it stopped
##   ablations                every study below, one at a time
##   ablation-beta ablation-k-labeler ablation-sinkhorn        labeler studies (minutes)
##   ablation-k ablation-uneven ablation-imbalanced ablation-labeler-in-training ablation-lct
##                            training studies (EuroSAT, 3 seeds a point; ABL_PRESET=paper: the
##                            paper's CIFAR-10 scale, for a GPU)
##   ablation-budget          image size, width and stem within 20 minutes of training on 2
##                            cores, chosen on the validation split (hours: a machine doing
##                            nothing else, as each configuration's epoch is timed once)
##   ablation-splits          five divisions of SIRI-WHU from INIT's backbone
##   ablation-label-bn        the label pass's BatchNorm mode
##   peers                    OTL beside SeLa, SimCLR, BYOL and SwAV, same network, data and
##                            schedule (needs requirements-peers.txt), then results/peers.md
##   peers-cpu                the same at the cpu preset's whole schedule, 3 seeds a method
##   peers-transfer           each method on SIRI-WHU from its own peers-cpu backbone
##   peers-tune               every method's lr x 4 and view recipes x 3, two seeds a trial, chosen
##                            on the validation split, a step past the lrs where a pick lies at their
##                            edge (120 runs and up to 10 more, minutes each on 2 cores)
## Benchmarks
##   labeler-bench            the labelers on the same outputs: time, balance, memory
##   labeler-bench-gpu        the same on a CUDA GPU
##   labeler-compare REV=..   this labeler against REV's: the same labels and T, and the time
##   train-bench-gpu          training and label-pass images/s against a plain supervised loop
## Housekeeping
##   help                     this list
##   clean-runs               delete RUNS (checkpoints, logs, evaluations)
##
## Variables: PRESET DEVICE=auto|cpu|cuda RUNS=runs DATA=data OUT=results TRAIN_ARGS="--epochs 4"
##   PREP_ARGS="--drop-duplicates" SRC=<archive or folder> EUROSAT_SRC=<EuroSAT's> INIT=<checkpoint>
##   RUN_NAME=<another run folder and report name> TRANSFER_PRESET REPORT GPU=cuda

PY         ?= .venv/bin/python
PRESET     ?= auto
DEVICE     ?= auto
RUNS       ?= runs
DATA       ?= data
OUT        ?= results
TRAIN_ARGS ?=
PREP_ARGS  ?=
SRC        ?=
EUROSAT_SRC ?=
INIT       ?= $(RUNS)/eurosat/checkpoint.pth
RUN_NAME   ?=
GPU        ?= cuda
# the transfer sets' preset: auto takes `transfer` on CUDA and `transfer-cpu` on the CPU; it must
# match INIT's backbone (a `fast` or `paper` backbone: transfer)
TRANSFER_PRESET ?= auto
STAMP       = .venv/.installed

TRANSFER_SETS = hmhr siri_whu ucmerced
SCRATCH_SETS  = cifar10 cifar100 svhn aid patternnet nwpu_resisc45
# the studies of `make ablations`; tests/test_makefile.py holds them to ablations.STUDIES
LABELER_STUDIES = beta k-labeler sinkhorn
TRAINING_STUDIES = k uneven imbalanced labeler-in-training lct budget
STUDIES = $(LABELER_STUDIES) $(TRAINING_STUDIES) splits label-bn
GPU_TABLES = eurosat-gpu $(addsuffix -gpu,$(TRANSFER_SETS)) cifar10-gpu

.PHONY: help setup test eurosat eurosat-supervised eurosat-data data eval-run tables eurosat-ms multispectral \
        $(TRANSFER_SETS) $(SCRATCH_SETS) $(GPU_TABLES) ablations $(addprefix ablation-,$(STUDIES)) peers \
        peers-cpu peers-transfer peers-tune \
        labeler-bench labeler-bench-gpu labeler-compare train-bench-gpu clean-runs
.DELETE_ON_ERROR:

help:
	@sed -n 's/^## \{0,1\}//p' Makefile

setup: $(STAMP)
$(STAMP): requirements.txt
	python3 -m venv .venv
	.venv/bin/python -m pip install -q -r requirements.txt
	touch $@

test: $(STAMP)
	$(PY) -m pytest -q tests

# Where a data set comes from: $2 when given, else its copy in ../shared/data, else the official
# download (checksummed; prepare_data.py says which sets have one)
SHARED_eurosat = EuroSAT.zip
SHARED_cifar10 = cifar10_jpg.zip
SHARED_hmhr    = HMHR.zip
SHARED_eurosat_ms = EuroSAT_MS_sample.zip
source = $(if $2,--source $2,$(if $(and $(SHARED_$1),$(wildcard ../shared/data/$(SHARED_$1))),--source ../shared/data/$(SHARED_$1),--download))
# a run folder and report name: RUN_NAME, else $1
name = $(or $(RUN_NAME),$1)

# ---------------------------------------------------------------------------- EuroSAT
eurosat-data: $(STAMP)
	$(PY) prepare_data.py --dataset eurosat $(call source,eurosat,$(EUROSAT_SRC)) --out $(DATA)/eurosat $(PREP_ARGS)

eurosat: eurosat-data
	$(PY) train_otl.py --data $(DATA)/eurosat --output $(RUNS)/$(call name,eurosat) --preset $(PRESET) --device $(DEVICE) $(TRAIN_ARGS)
	$(MAKE) --no-print-directory eval-run RUN=$(RUNS)/$(call name,eurosat)
	$(PY) report.py --dataset eurosat --runs $(RUNS) --otl-run $(call name,eurosat) --name $(call name,eurosat) --out $(OUT)

eurosat-supervised: eurosat-data
	$(PY) train_otl.py --data $(DATA)/eurosat --output $(RUNS)/$(call name,eurosat)_supervised --supervised --preset $(PRESET) --device $(DEVICE) $(TRAIN_ARGS)
	$(MAKE) --no-print-directory eval-run RUN=$(RUNS)/$(call name,eurosat)_supervised
	$(PY) report.py --dataset eurosat --runs $(RUNS) --otl-run $(call name,eurosat) --name $(call name,eurosat) --out $(OUT)

# kNN and linear probe of RUN's last checkpoint and of its random-init snapshot (checkpoint0000.pth);
# FEATURE: the layer (eval_knn.py --feature), LINEAR_FEATURE: the linear probe's
FEATURE        ?= pool
LINEAR_FEATURE ?= $(FEATURE)
eval-run:
	$(PY) eval_knn.py --checkpoint $(RUN)/checkpoint.pth --device $(DEVICE) --feature $(FEATURE)
	$(PY) eval_linear.py --checkpoint $(RUN)/checkpoint.pth --device $(DEVICE) --feature $(LINEAR_FEATURE)
	$(PY) eval_knn.py --checkpoint $(RUN)/checkpoint0000.pth --device $(DEVICE) --feature $(FEATURE)
	$(PY) eval_linear.py --checkpoint $(RUN)/checkpoint0000.pth --device $(DEVICE) --feature $(LINEAR_FEATURE)

# ---------------------------------------------------------------------------- EuroSAT MS
# 13-band GeoTIFFs: prepared with every band at 16 bits, then OTL from INIT (make eurosat's RGB
# run, made first if missing) with its first conv inflated to 13 bands (train_otl.py --init)
MS_ARGS ?=
eurosat-ms: $(STAMP)
	$(PY) prepare_data.py --dataset eurosat_ms $(call source,eurosat_ms,$(SRC)) --out $(DATA)/$(call name,eurosat_ms) $(PREP_ARGS)
	test -f $(INIT) || $(MAKE) --no-print-directory eurosat RUN_NAME= PREP_ARGS=
	$(PY) train_otl.py --data $(DATA)/$(call name,eurosat_ms) --output $(RUNS)/$(call name,eurosat_ms)_from_eurosat --init $(INIT) --preset $(TRANSFER_PRESET) --device $(DEVICE) $(TRAIN_ARGS)
	$(MAKE) --no-print-directory eval-run RUN=$(RUNS)/$(call name,eurosat_ms)_from_eurosat

multispectral: $(STAMP)
	test -f $(INIT) || $(MAKE) --no-print-directory eurosat RUN_NAME= PREP_ARGS=
	$(PY) bench/multispectral.py --init $(INIT) $(if $(SRC),--source $(SRC)) --work $(RUNS)/multispectral --out $(OUT)/multispectral --device $(DEVICE) $(MS_ARGS)

# ---------------------------------------------------------------------------- other data sets
data: $(STAMP)
	$(PY) prepare_data.py --dataset $(DATASET) $(call source,$(DATASET),$(SRC)) --out $(DATA)/$(DATASET) $(PREP_ARGS)

# The paper's transfer protocol for a small set: OTL from INIT's backbone (make eurosat's run,
# made first if missing), OTL from random init, and supervised from INIT, each evaluated, then
# results/<set>_transfer.md.  HMHR without its duplicates:
#   make hmhr PREP_ARGS=--drop-duplicates RUN_NAME=hmhr_dedup REPORT=hmhr_transfer_dedup
$(TRANSFER_SETS): $(STAMP)
	$(PY) prepare_data.py --dataset $@ $(call source,$@,$(SRC)) --out $(DATA)/$(call name,$@) $(PREP_ARGS)
	test -f $(INIT) || $(MAKE) --no-print-directory eurosat RUN_NAME= PREP_ARGS=
	$(PY) train_otl.py --data $(DATA)/$(call name,$@) --output $(RUNS)/$(call name,$@)_from_eurosat --init $(INIT) --preset $(TRANSFER_PRESET) --device $(DEVICE) $(TRAIN_ARGS)
	$(PY) train_otl.py --data $(DATA)/$(call name,$@) --output $(RUNS)/$(call name,$@)_scratch --preset $(TRANSFER_PRESET) --device $(DEVICE) $(TRAIN_ARGS)
	$(PY) train_otl.py --data $(DATA)/$(call name,$@) --output $(RUNS)/$(call name,$@)_supervised_from_eurosat --supervised --init $(INIT) --preset $(TRANSFER_PRESET) --device $(DEVICE) $(TRAIN_ARGS)
	$(MAKE) --no-print-directory eval-run RUN=$(RUNS)/$(call name,$@)_from_eurosat
	$(MAKE) --no-print-directory eval-run RUN=$(RUNS)/$(call name,$@)_scratch
	$(MAKE) --no-print-directory eval-run RUN=$(RUNS)/$(call name,$@)_supervised_from_eurosat
	$(PY) report.py --dataset $@ --runs $(RUNS) --out $(OUT) --name $(or $(REPORT),$(call name,$@)_transfer) \
	  --rows "OTL from EuroSAT OTL=$(call name,$@)_from_eurosat" "OTL from random init=$(call name,$@)_scratch" \
	  "supervised from EuroSAT OTL=$(call name,$@)_supervised_from_eurosat"

# From scratch, then the report and the overview.  The natural-image tables evaluate kNN on the
# 128-d embedding where the model has one (auto) and the linear probe on conv5 (a ResNet's last
# stage: the pooled features), as the paper does.
#   make cifar10 PRESET=resnet50-cifar RUN_NAME=cifar10_resnet50    the ResNet-50 table's run
$(SCRATCH_SETS): $(STAMP)
	$(PY) prepare_data.py --dataset $@ $(call source,$@,$(SRC)) --out $(DATA)/$@ $(PREP_ARGS)
	$(PY) train_otl.py --data $(DATA)/$@ --output $(RUNS)/$(call name,$@) --preset $(PRESET) --device $(DEVICE) $(TRAIN_ARGS)
	$(MAKE) --no-print-directory eval-run RUN=$(RUNS)/$(call name,$@) FEATURE=auto LINEAR_FEATURE=$(if $(filter cifar10 cifar100 svhn,$@),conv5,auto)
	$(PY) report.py --dataset $@ --runs $(RUNS) --out $(OUT) --otl-run $(call name,$@) --name $(call name,$@) --feature auto --linear-feature $(if $(filter cifar10 cifar100 svhn,$@),conv5,auto)
	$(PY) report.py --overview --out $(OUT)

tables:
	$(PY) report.py --overview --out $(OUT)

# ---------------------------------------------------------------------------- on one GPU
# Each of the paper's tables that one GPU reruns, in one command (GPU=cuda:1: another device)
eurosat-gpu:
	$(MAKE) --no-print-directory eurosat eurosat-supervised PRESET=fast DEVICE=$(GPU) RUN_NAME=eurosat_fast

$(addsuffix -gpu,$(TRANSFER_SETS)): %-gpu:
	test -f $(RUNS)/eurosat_fast/checkpoint.pth || $(MAKE) --no-print-directory eurosat-gpu RUN_NAME= PREP_ARGS=
	$(MAKE) --no-print-directory $* INIT=$(RUNS)/eurosat_fast/checkpoint.pth TRANSFER_PRESET=transfer DEVICE=$(GPU) RUN_NAME=$(or $(RUN_NAME),$*_gpu)

cifar10-gpu:
	$(MAKE) --no-print-directory cifar10 PRESET=cifar-fast DEVICE=$(GPU) RUN_NAME=cifar10_fast

# ---------------------------------------------------------------------------- studies
# Each writes $(OUT)/ablations/<study>.json, .md and .png.  ABL_ARGS: more ablations.py flags.
ABL_PRESET ?= study
ABL_ARGS   ?=
ablations: $(addprefix ablation-,$(STUDIES))

# the labeler studies take CIFAR-10's training split; the training studies train on EuroSAT at the
# study scale and on CIFAR-10 at the paper's (ablations.py --help)
$(addprefix ablation-,$(LABELER_STUDIES)): ablation-%:
	$(MAKE) --no-print-directory data DATASET=cifar10
	$(PY) ablations.py $* --preset $(ABL_PRESET) --device $(DEVICE) $(ABL_ARGS)

$(addprefix ablation-,$(TRAINING_STUDIES)): ablation-%:
	$(MAKE) --no-print-directory $(if $(filter paper,$(ABL_PRESET)),data DATASET=cifar10,eurosat-data)
	$(PY) ablations.py $* --preset $(ABL_PRESET) --device $(DEVICE) $(ABL_ARGS)

# five divisions of SIRI-WHU (make data DATASET=siri_whu SRC=.. first), OTL and supervised from INIT
ablation-splits: $(STAMP)
	@test -f $(DATA)/siri_whu/manifest.json || { echo "$(DATA)/siri_whu is not prepared: make data DATASET=siri_whu SRC=<the SIRI-WHU folder> first (docs/datasets.md says where it is)"; exit 1; }
	test -f $(INIT) || $(MAKE) --no-print-directory eurosat RUN_NAME= PREP_ARGS=
	$(PY) ablations.py splits --init $(INIT) --preset $(ABL_PRESET) --device $(DEVICE) $(ABL_ARGS)

ablation-label-bn: eurosat-data
	$(PY) ablations.py label-bn --data $(DATA)/eurosat --output $(RUNS)/label_bn --device $(DEVICE)

# OTL and the methods a user would pick instead, on EuroSAT at the study scale, 3 seeds each
peers: eurosat-data
	$(PY) ablations.py peers --preset $(ABL_PRESET) --device $(DEVICE) --out $(OUT) $(ABL_ARGS)

# the same at the cpu preset's whole schedule (make eurosat's), 3 seeds a method (PEER_SEEDS)
peers-cpu: eurosat-data
	$(PY) ablations.py peers --preset cpu --device $(DEVICE) --out $(OUT) $(ABL_ARGS)

# every method tuned alike at the study scale, chosen on the validation split (docs/peers.md)
peers-tune: eurosat-data
	$(PY) ablations.py peers-tune --preset $(ABL_PRESET) --device $(DEVICE) --out $(OUT) $(ABL_ARGS)

# the transfer protocol on SIRI-WHU (make data DATASET=siri_whu SRC=.. first) from each method's
# own peers-cpu backbone, each method training on with its own loss
peers-transfer: peers-cpu
	@test -f $(DATA)/siri_whu/manifest.json || { echo "$(DATA)/siri_whu is not prepared: make data DATASET=siri_whu SRC=<the SIRI-WHU folder> first (docs/datasets.md says where it is)"; exit 1; }
	$(PY) ablations.py peers-transfer --preset cpu --device $(DEVICE) --out $(OUT) $(ABL_ARGS)

# ---------------------------------------------------------------------------- benchmarks
# The labelers on the same outputs (Gaussian N = 50,000, k = 50..1000; EuroSAT outputs of a fresh
# and of the trained network where data/eurosat and runs/eurosat exist; 1.28M x 3000 streamed).
labeler-bench: eurosat-data
	$(PY) bench/bench_labeler.py --out $(OUT)/labeler_bench.json

labeler-bench-gpu: $(STAMP)
	PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True $(PY) bench/bench_labeler.py --device cuda --skip-real \
	  --ref-n 640000 --out $(OUT)/labeler_bench_gpu.json

# otl_scale.py's labeler against REV's (a commit, or a path to another otl_scale.py): the same
# labels and T on Gaussian, collapsed and grouped inputs at k = 2 - 3000, and the time of each
REV ?= HEAD
labeler-compare: $(STAMP)
	$(PY) bench/compare_labelers.py $(REV) otl_scale.py --inputs small,stream,large --expect-same

train-bench-gpu: $(STAMP)
	$(PY) bench/bench_train.py --device cuda --sizes 224,112,64 --out $(OUT)/train_throughput_gpu.json

clean-runs:
	rm -rf $(RUNS)
