#!/usr/bin/env bash
# The GPU checks on a GPU machine reached through a remote-run tool that carries at most 64 MiB of
# the checkout per call and gives a few minutes a call: so the EuroSAT archive (96 MB) travels
# in two pieces over two calls.  Ignored files in the checkout that a call does not carry are
# removed there, but /tmp stays while the machine is warm, so the first piece waits in /tmp.
# Run from anywhere; it works in the repository root.
#
#   bash bench/gpu_session.sh bench  call 1 (carry .gpu/eu_part_aa and .gpu/EuroSAT_small.zip):
#                                    the first piece to /tmp; training / label-pass throughput,
#                                    the CUDA tests, ours at 1.28M x 3000 (ALL=1: the labeler
#                                    benchmark's Gaussian sweep and the published rules and
#                                    Sinkhorn too; PROFILE=1: the labeler's profile; COMPILE=1:
#                                    torch.compile's throughput)
#   D=<seconds> bash bench/gpu_session.sh train
#                                    call 2 (carry .gpu/eu_part_ab), at once after call 1 (the
#                                    machine goes back when idle): EuroSAT from the two
#                                    pieces, the fast preset trained for as many epochs (<= E_MAX,
#                                    default the preset's 208) as D seconds allow at the
#                                    throughput call 1 measured, kNN + linear, the supervised twin
#                                    when it fits too; then (PAPER=0 leaves these out) the paper
#                                    preset for 0.4 minutes of epochs, timed, and the labeler on
#                                    the trained network's outputs (its k = 128 head, and its
#                                    backbone through a fresh k = 3000 head), on the GPU and on
#                                    the host. FAST_FLAGS: more train_otl.py flags for the fast
#                                    run (e.g. "--labeler-device cpu"); EVAL=0: the training
#                                    alone (when a call's time limit is shorter), then
#   bash bench/gpu_session.sh eval   call 3, at once: the fast run's kNN + linear evaluations (and
#                                    PHASES=1's labeler stages on its head)
#   bash bench/gpu_session.sh labeler
#                                    the labeler in one call (carry .gpu/ab with an older labeler
#                                    as otl_old.py (AB= names another), .gpu/feat_eu_train from
#                                    `bench/bench_labeler.py --save-features`, and
#                                    .gpu/EuroSAT_small.zip): ours against the published rules on
#                                    the saved features' real outputs at k = 10 - 3000, the older
#                                    labeler against this one at 1.28M x 3000 and on the trained
#                                    network's own outputs, the CUDA tests, the kernels three
#                                    calls launch (profile_labeler --kernels)
#   D=<seconds> bash bench/gpu_session.sh supervised
#                                    instead of train (carry .gpu/eu_part_ab): the fast preset's
#                                    supervised twin for its epochs (E_SUP: fewer), kNN + linear;
#                                    then a 10-epoch fast OTL network and the labeler on its
#                                    outputs (stages on the GPU; the three labelers, GPU and host)
#   bash bench/gpu_session.sh stash  the transfer tables' call 1 (carry .gpu/eu_part_aa and
#                                    .gpu/EuroSAT_small.zip): the first piece to /tmp (TESTS=1:
#                                    the CUDA tests too)
#   D=<seconds> bash bench/gpu_session.sh transfer
#                                    the paper's transfer tables at the `transfer` preset (224 px,
#                                    64 epochs). The backbone first, until runs/gpu/eurosat_fast
#                                    is done (a call that ends early leaves it to the next one):
#                                    EuroSAT from the two pieces, the fast preset for
#                                    E_BACKBONE (100) epochs, its kNN + linear. Then, for each set
#                                    in .gpu/ whose report is not made yet (HMHR.zip: as found and
#                                    without its duplicates; siri_whu.zip), its three runs at once
#                                    (OTL from the backbone, OTL from random init, supervised from
#                                    the backbone), each evaluated at its start and end, and the
#                                    report. Call 2 carries .gpu/eu_part_ab and .gpu/HMHR.zip
#                                    (D=540), call 3 .gpu/siri_whu.zip (D=240), each at once after
#                                    the last: a warm machine keeps runs/ and /tmp. With the
#                                    machine's start the three take about 15 minutes of device
#                                    time; where less is at hand, call 3 waits for a later
#                                    machine (which trains the backbone again). AID (161 MB at 150 px)
#                                    needs three more calls of pieces: not planned here.
#   D=<seconds> bash bench/gpu_session.sh cifar
#                                    CIFAR-10 (carry .gpu/cifar10_jpg.zip): first, once, the
#                                    paper's alexnet-cifar protocol for 0.5 minutes of epochs,
#                                    timed (PAPER=0 leaves it out); then the cifar-fast preset
#                                    (CIFAR_EPOCHS: other epochs) for what D leaves, resumed by
#                                    the next call until it is done; then kNN (pool) and linear
#                                    (conv5) at its start and end, and its report: one call, D=590
#                                    (where it is not done, a second at once: nothing to carry,
#                                    data/ and runs/ stay).
#
# .gpu/ (ignored: add /.gpu/ to .git/info/exclude) is filled by bench/pack_gpu.py:
# ../shared/data/EuroSAT.zip in pieces (eu_part_aa, eu_part_ab; with the tree and the small
# archive, the first piece must stay under the 64 MiB a call carries), a 40-per-class
# EuroSAT_small.zip for the tests' small_data fixture, HMHR, SIRI-WHU re-encoded to fit, and a
# manifest of what each file is.  Outputs go to $OUT (what comes back).
# ZIP=<path> names a whole archive already on the machine instead.  On a machine with the
# archive beside the checkout, `make train-bench-gpu labeler-bench-gpu` and
# `make eurosat PRESET=fast` are the plain commands.  results/gpu/README.md lists what these
# stages measured and with which command.
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT" /tmp/gpu_state
START=$(date +%s)
R=${R:-runs/gpu}     # the run folders
G=${G:-.gpu}         # what the calls carry (bench/pack_gpu.py)
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)   # for the reports
left() { echo $(( D - ($(date +%s) - START) )); }
machine() {     # the GPU, torch, cores and commit to $OUT/machine.txt; the sha256 of any files named
  { nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
    $PY -c "import torch, sys; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name())"
    nproc; git rev-parse HEAD 2>/dev/null; [ $# -eq 0 ] || sha256sum "$@"; } 2>&1 | tee "$OUT/machine.txt"
}
evaluate() {    # kNN + linear on run folder $1's checkpoints $3.. (default checkpoint.pth), each
  # within $2 s; KNN_FEATURE / LINEAR_FEATURE: the layers (default the pooled features)
  local dir=$1 t=$2 ck; shift 2
  for ck in "${@:-checkpoint.pth}"; do
    timeout "$t" $PY eval_knn.py --checkpoint "$dir/$ck" --device "${DEV:-cuda}" --no-progress \
        ${KNN_FEATURE:+--feature $KNN_FEATURE} 2>&1 | tail -2
    timeout "$t" $PY eval_linear.py --checkpoint "$dir/$ck" --device "${DEV:-cuda}" --no-progress \
        ${LINEAR_FEATURE:+--feature $LINEAR_FEATURE} 2>&1 | tail -2
  done
}
cuda_tests() {  # the CUDA tests within $1 seconds; small_data reads ../shared/data/EuroSAT.zip
  # (only where no archive is there: ../shared does not travel to the GPU machine, and a
  # checkout beside the real archive keeps it)
  [ -e ../shared/data/EuroSAT.zip ] || { mkdir -p ../shared/data && cp $G/EuroSAT_small.zip ../shared/data/EuroSAT.zip; }
  timeout "$1" $PY -m pytest -q -p no:cacheprovider -k cuda tests/test_otl.py tests/test_otl_scale.py \
      tests/test_train_otl.py tests/test_bench.py -rs 2>&1 | tee "$OUT/pytest_cuda.txt" | tail -5
}
prepare() {     # prepare_data.py with these flags, its progress bars left out of the log
  $PY prepare_data.py "$@" 2>&1 | tr '\r' '\n' | grep -v "it/s\]$" | tail -3
}
eurosat_data() { # data/eurosat from ZIP, else from the first piece in /tmp and the second in .gpu/
  ZIP=${ZIP:-/tmp/EuroSAT.zip}
  [ -f "$ZIP" ] || cat /tmp/gpu_state/eu_part_aa $G/eu_part_ab > "$ZIP" || { rm -f "$ZIP"; exit 3; }
  sha256sum "$ZIP"
  prepare --dataset eurosat --source "$ZIP" --out data/eurosat --workers 16
  sha256sum data/eurosat/split.json
}
twin() {        # the fast preset's supervised twin within $1 seconds (more flags after), evaluated
  local t=$1; shift
  [ "$t" -gt 0 ] || { echo "no time left for the supervised twin ($t s)"; return 0; }
  timeout "$t" $PY train_otl.py --data data/eurosat --output $R/eurosat_fast_supervised \
      --supervised --preset fast "$@" --no-progress 2>&1 | tee "$OUT/train_fast_supervised.log" | tail -5
  evaluate $R/eurosat_fast_supervised 40
}
pack() {        # the run folders without checkpoints and features, to $OUT
  tar czf "$OUT/runs_gpu.tgz" --exclude='*.pth' --exclude='features_*' $R ${DATA:-data}/*/manifest.json
  echo "done, $(left) s left"
}

case "${1:-}" in
bench)
  cp $G/eu_part_aa /tmp/gpu_state/ 2>/dev/null || echo "no $G/eu_part_aa: the train stage will need ZIP="
  machine
  # 1. training and label-pass images/s at 112 (fast) and 224 px (paper), against a plain
  #    supervised ResNet-18 loop
  #    (SKIP_THROUGHPUT=1: the kept figures, results/gpu/train_throughput_gpu.json, instead)
  if [ "${SKIP_THROUGHPUT:-0}" = 1 ]; then
    cp results/gpu/train_throughput_gpu.json /tmp/gpu_state/
  else
    timeout 110 $PY bench/bench_train.py --device cuda --sizes 112,224 --steps 20 --warmup 5 \
        --out "$OUT/train_throughput_gpu.json" 2>&1 | tail -4
    cp "$OUT/train_throughput_gpu.json" /tmp/gpu_state/ 2>/dev/null
  fi
  # 2. the CUDA tests (skipped on CPU machines)
  cuda_tests 120
  # 3. the labeler at 1.28M x 3000 Gaussian, ours (ALL=1: the published rules and Sinkhorn at
  #    320,000 rows and the Gaussian sweep as well)
  if [ "${ALL:-0}" = 1 ]; then LB="--ks 50,100,200,500,1000 --ref-n 320000"
  else LB="--ks 1000 --ref-n 64000 --methods exact"; fi
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 130 $PY bench/bench_labeler.py --device cuda \
      --skip-real --large-inputs gaussian $LB --repeat 3 --out "$OUT/labeler_bench_gpu.json" 2>&1 \
      | tr '\r' '\n' | grep -v "it/s\]$" | tail -10
  # 4. where the exact labeler's time goes at 1.28M x 3000 (PROFILE=1)
  if [ "${PROFILE:-0}" = 1 ]; then
    timeout 60 $PY bench/profile_labeler.py --device cuda --repeat 3 --out "$OUT/labeler_profile_gpu.txt" \
        2>&1 | tail -25
  fi
  # 5. torch.compile(model) at 112 px, a minute or so of compiling (COMPILE=1)
  if [ "${COMPILE:-0}" = 1 ]; then
    timeout 110 $PY bench/bench_train.py --device cuda --sizes 112 --steps 20 --warmup 5 --compile 112 \
        --out "$OUT/train_throughput_gpu_compiled.json" 2>&1 | tail -3
  fi
  echo "bench done in $(( $(date +%s) - START )) s"
  ;;
labeler)
  FEATS=${FEATS:-$G/feat_eu_train}
  AB=${AB:-$G/ab/otl_old.py}
  machine otl.py otl_scale.py "$AB" $FEATS/*
  # 1. ours against the published rules on the real outputs at every k (the CPU's matrix)
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout "${T_BENCH:-200}" $PY bench/bench_labeler.py \
      --device cuda --features "$FEATS" --skip-large --ks 10 --real-ks 10,50,100,128,500,1000,3000 \
      --trained-ks 10,50,100,500,1000,3000 --methods exact,published --repeat 3 \
      --out "$OUT/labeler_bench_gpu_matrix.json" 2>&1 | tr '\r' '\n' | grep -v "it/s\]$" | tail -22
  # 2. the older labeler (AB) against this one, alternating, on the same inputs
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout "${T_AB:-120}" $PY bench/compare_labelers.py \
      "$AB" otl_scale.py --device cuda --inputs large --large-n 1280000 --reps 3 \
      --pt "$FEATS/trained_net_outputs.pt" --whole-only --out "$OUT/labeler_ab_head_gpu.json" 2>&1 | tail -6
  # 3. the CUDA tests
  cuda_tests "${T_TEST:-150}"
  # 4. the torch operations a call launches, counted on the GPU with the call's seconds, to check
  # the time per operation that --kernels --as-gpu on the CPU predicts
  $PY -c "import torch, utils; f = torch.load('$FEATS/trained_backbone_features.pt', weights_only=True); [torch.save(utils.fresh_head_outputs(f, k, 0).contiguous(), f'/tmp/tb_{k}.pt') for k in (100, 500)]"
  for IN in /tmp/tb_100.pt /tmp/tb_500.pt "$FEATS/trained_net_outputs.pt"; do
    timeout "${T_KERN:-25}" $PY bench/profile_labeler.py --device cuda --input "$IN" --kernels --repeat 3 \
        --json "$OUT/labeler_kernels_gpu_$(basename "$IN" .pt).json" 2>&1 | grep -E "^(seconds|exact|published)|profile_labeler"
  done
  echo "labeler done in $(( $(date +%s) - START )) s"
  ;;
train|supervised)
  : "${D:?set D to the seconds this call may use}"
  eurosat_data
  if [ "$1" = supervised ]; then
    # the supervised twin of the fast preset for its epochs (E_SUP: fewer), its kNN + linear;
    # then, with 90 s left, a fast-preset OTL network for 10 epochs and the exact labeler's
    # stages on its head's outputs (one strong view of the training split, on the GPU), and
    # the three labelers on them on the GPU and the host
    twin $(( $(left) - 60 )) ${E_SUP:+--epochs $E_SUP}
    if [ "$(left)" -gt 90 ]; then
      timeout 60 $PY train_otl.py --data data/eurosat --output $R/eurosat_fast10 --preset fast \
          --epochs 10 --no-progress 2>&1 | tail -2
      timeout $(( $(left) - 10 )) $PY bench/profile_labeler.py --device cuda --data data/eurosat \
          --checkpoint $R/eurosat_fast10/checkpoint.pth --phases --repeat 3 \
          --out "$OUT/labeler_phases_gpu_fast10.txt" 2>&1 | tail -14
      [ "$(left)" -gt 40 ] && PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout $(( $(left) - 10 )) \
          $PY bench/bench_labeler.py --device cuda --data data/eurosat --real-split train \
          --checkpoint $R/eurosat_fast10/checkpoint.pth --ks 128 --real-ks 128 --skip-large \
          --repeat 2 --cpu-too --out "$OUT/labeler_bench_gpu_fast10.json" 2>&1 | tr '\r' '\n' \
          | grep -v "it/s\]$" | tail -8
    fi
    pack
    exit 0
  fi
  # seconds kept for what follows the fast run: its two evaluations (90), and with PAPER=1 (the
  # default) the paper preset's timing and the labeler on the trained network's outputs (150)
  # (EVAL=0: the training alone, its evaluations left to `bash bench/gpu_session.sh eval` in the next
  # call, as one call may run 10 minutes at most: 20 s kept)
  if [ "${EVAL:-1}" = 0 ]; then AFTER=20; PAPER=0
  elif [ "${PAPER:-1}" = 1 ]; then AFTER=240; else AFTER=90; fi
  # epochs that fit: 2 x 21,600 training views and 2 x 21,600 label-pass views an epoch at the
  # images/s call 1 measured at 112 px, plus 10 % and 0.5 s for the labeler and the rest (a
  # training epoch runs a little slower than the benchmark's figures say); the supervised
  # twin (no label pass) only if it can run as many epochs in what is left
  # (labelling on the host, FAST_FLAGS="--labeler-device cpu": 0.15 s for the labeler and the rest)
  case "${FAST_FLAGS:-}" in *"--labeler-device cpu"*) REST=0.15 ;; *) REST=0.5 ;; esac
  read E ESUP MM < <($PY - "$(( $(left) - AFTER ))" "${E_MAX:-208}" "$REST" <<'EOF'
import json, sys
try:
    t = json.load(open("/tmp/gpu_state/train_throughput_gpu.json"))["sizes"]["112"]
    otl = (1.1 * (43200 / t["otl_train"]["views_per_s"] + 43200 / t["label_pass"]["views_per_s"])
           + float(sys.argv[3]))
    sup = 1.05 * 43200 / t["otl_train"]["views_per_s"] + 0.2
except (OSError, KeyError, ValueError):          # no measurement: a guess
    otl, sup = 6.0, 4.0
budget = float(sys.argv[1]) - 30             # start-up and margin
e = max(1, min(int(sys.argv[2]), int(budget / otl)))
esup = e if budget - e * otl >= e * sup else 0
print(e, esup, round(max(1.0, e * otl * 1.1) / 60, 2), file=sys.stdout)
print(f"epoch ~{otl:.1f} s (OTL), ~{sup:.1f} s (supervised); budget {budget:.0f} s", file=sys.stderr)
EOF
)
  echo "fast preset: $E epochs; supervised twin: $ESUP epochs; $(left) s left"
  timeout $(( $(left) - AFTER + 20 )) $PY train_otl.py --data data/eurosat --output $R/eurosat_fast \
      --preset fast --epochs "$E" --knn-monitor 20 --no-progress --max-minutes "$MM" ${FAST_FLAGS:-} \
      2>&1 | tee "$OUT/train_fast.log" | tail -12
  [ "${EVAL:-1}" = 0 ] && { echo "trained, $(left) s left"; exit 0; }
  ;&
eval)
  evaluate $R/eurosat_fast 60
  [ "${1:-}" = eval ] && { D=${D:-600}; ESUP=0; AFTER=0; PAPER=0; }
  if [ "$ESUP" -gt 0 ] && [ "$(left)" -gt $(( AFTER + 60 )) ]; then
    twin $(( $(left) - AFTER )) --epochs "$ESUP"
  fi
  # PHASES=1: where the exact labeler's time goes on the trained head's outputs (one strong view
  # of the training split, as a label pass hands it), on the GPU, if 40 s are left
  if [ "${PHASES:-0}" = 1 ] && [ "$(left)" -gt 40 ]; then
    timeout $(( $(left) - 15 )) $PY bench/profile_labeler.py --device cuda --data data/eurosat \
        --checkpoint $R/eurosat_fast/checkpoint.pth --phases --repeat 3 \
        --out "$OUT/labeler_phases_gpu_trained.txt" 2>&1 | tail -30
  fi
  if [ "${PAPER:-1}" = 1 ]; then
    # the paper preset (224 px, 300 epochs) for the epochs that 0.4 minutes hold: its epoch time
    timeout 80 $PY train_otl.py --data data/eurosat --output $R/eurosat_paper_timing --preset paper \
        --max-minutes 0.4 --no-progress 2>&1 | tee "$OUT/train_paper_timing.log" | tail -6
    # the labeler on the trained network's outputs for the training split (what a label pass
    # hands it): its own k = 128 head, and its backbone through a fresh k = 3000 head; ours, the
    # published rules and Sinkhorn-Knopp, beside a fresh network's (random_net); each on the GPU
    # and, copied, on the host (--cpu-too)
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout $(( $(left) - 15 )) $PY bench/bench_labeler.py \
        --device cuda --data data/eurosat --real-split train --checkpoint $R/eurosat_fast/checkpoint.pth \
        --ks 128 --real-ks 128,3000 --trained-ks 3000 --views --skip-large --repeat 2 --cpu-too \
        --out "$OUT/labeler_bench_gpu_real.json" 2>&1 | tr '\r' '\n' | grep -v "it/s\]$" | tail -12
  fi
  pack
  ;;
stash)
  cp $G/eu_part_aa /tmp/gpu_state/ || { echo "no $G/eu_part_aa: carry it (bench/pack_gpu.py makes it)"; exit 3; }
  machine
  [ "${TESTS:-0}" = 1 ] && cuda_tests 150
  echo "stashed in $(( $(date +%s) - START )) s"
  ;;
transfer)
  : "${D:?set D to the seconds this call may use}"
  machine
  # DEV=cpu and RUN_ARGS (more train_otl.py flags for the transfer runs) let the tests run this
  # stage small on a CPU
  DEV=${DEV:-cuda}; RUN_ARGS=${RUN_ARGS:-}; DATA=${DATA:-data}
  BB=$R/eurosat_fast
  # seconds kept for the transfer runs after the backbone (AFTER_BB): six HMHR runs at once
  AFTER_BB=${AFTER_BB:-150}
  if [ ! -f $BB/results.json ]; then      # results.json: the backbone's run is done
    [ -f data/eurosat/manifest.json ] || eurosat_data
    MM=$(awk "BEGIN { print ($(left) - $AFTER_BB - 100) / 60 }")
    echo "backbone: the fast preset for ${E_BACKBONE:-100} epochs, at most $MM min; $(left) s left"
    timeout $(( $(left) - AFTER_BB - 60 )) $PY train_otl.py --data data/eurosat --output $BB \
        --preset fast --epochs "${E_BACKBONE:-100}" --no-progress --max-minutes "$MM" \
        2>&1 | tee "$OUT/train_backbone.log" | tail -4
    evaluate $BB 40
  fi
  [ -f $BB/results.json ] || { echo "the backbone at $BB is not done: run this stage again at once (it resumes)"; pack; exit 3; }
  # <data folder>:<data set>:<report>:<archive in $G>; a set is run where its archive is here and
  # its report is not made yet (runs/ stays on a warm machine, and so may an archive an earlier
  # call carried)
  TODO=()
  for s in hmhr:hmhr:hmhr_transfer:HMHR.zip hmhr_dedup:hmhr:hmhr_transfer_dedup:HMHR.zip \
           siri_whu:siri_whu:siri_whu_transfer:siri_whu.zip; do
    IFS=: read -r dir ds rep zip <<< "$s"
    [ -f "$G/$zip" ] && [ ! -f "$R/reports/${rep}_gpu.json" ] || continue
    flags=(); [ "$dir" = hmhr_dedup ] && flags=(--drop-duplicates)
    prepare --dataset "$ds" --source "$G/$zip" --out "$DATA/$dir" ${flags[@]+"${flags[@]}"}
    TODO+=("$s")
  done
  [ ${#TODO[@]} -gt 0 ] || { echo "no transfer set left in $G/ (HMHR.zip, siri_whu.zip: bench/pack_gpu.py)"; pack; exit 0; }
  # a set's three runs, and every set's, at once: each is small, so the GPU has room for all,
  # and each run's own start-up and evaluations overlap the others' training
  T_RUN=$(( $(left) - 60 ))
  one() {         # run folder $1 on data/$2 (more train_otl.py flags after): train, then evaluate
    local run=$1 dir=$2; shift 2
    export OMP_NUM_THREADS=2     # nine processes share 16 cores
    mkdir -p "$R/$run"
    { timeout "$T_RUN" $PY train_otl.py --data "$DATA/$dir" --output "$R/$run" --preset transfer \
          --device "$DEV" --no-progress "$@" $RUN_ARGS 2>&1
      evaluate "$R/$run" 60 checkpoint.pth checkpoint0000.pth; } > "$R/$run/train.log" 2>&1
    tail -2 "$R/$run/train.log"
  }
  for s in "${TODO[@]}"; do
    IFS=: read -r dir ds rep zip <<< "$s"
    one "${dir}_from_eurosat" "$dir" --init $BB/checkpoint.pth &
    one "${dir}_scratch" "$dir" &
    one "${dir}_supervised_from_eurosat" "$dir" --supervised --init $BB/checkpoint.pth &
  done
  wait
  for s in "${TODO[@]}"; do
    IFS=: read -r dir ds rep zip <<< "$s"
    $PY report.py --dataset "$ds" --runs $R --out $R/reports --name "${rep}_gpu" \
        --rows "OTL from EuroSAT OTL=${dir}_from_eurosat" "OTL from random init=${dir}_scratch" \
        "supervised from EuroSAT OTL=${dir}_supervised_from_eurosat" \
        --machine "one $GPU; the backbone: $BB, the fast preset on EuroSAT" 2>&1
    cp "$R/reports/${rep}_gpu.md" "$OUT/" 2>/dev/null
  done
  pack
  ;;
cifar)
  : "${D:?set D to the seconds this call may use}"
  machine
  C=${DATA:-data}/cifar10
  [ -f $C/manifest.json ] || prepare --dataset cifar10 --source $G/cifar10_jpg.zip --out $C --workers 16
  # the paper's protocol (AlexNet, 224 px, 1600 epochs): its epoch time, from 0.5 minutes of it
  if [ "${PAPER:-1}" = 1 ] && [ ! -f $R/cifar10_alexnet_timing/log.jsonl ]; then
    timeout 75 $PY train_otl.py --data $C --output $R/cifar10_alexnet_timing \
        --preset alexnet-cifar --max-minutes 0.5 --no-progress 2>&1 | tee "$OUT/train_alexnet_timing.log" | tail -4
  fi
  RUN=$R/cifar10_fast
  if [ ! -f $RUN/results.json ]; then   # results.json: the run is done
    MM=$(awk "BEGIN { print ($(left) - 120) / 60 }")
    echo "cifar-fast: at most $MM min of training in this call; $(left) s left"
    timeout $(( $(left) - 90 )) $PY train_otl.py --data $C --output $RUN --preset cifar-fast \
        ${CIFAR_EPOCHS:+--epochs $CIFAR_EPOCHS} --knn-monitor 20 --no-progress --max-minutes "$MM" \
        2>&1 | tee -a "$OUT/train_cifar10_fast.log" | tail -6
  fi
  if [ -f $RUN/results.json ]; then
    KNN_FEATURE=auto LINEAR_FEATURE=conv5 evaluate $RUN 60 checkpoint.pth checkpoint0000.pth
    $PY report.py --dataset cifar10 --runs $R --out $R/reports --otl-run cifar10_fast --name cifar10_fast_gpu \
        --feature auto --linear-feature conv5 --machine "one $GPU" 2>&1
    cp $R/reports/cifar10_fast_gpu.md "$OUT/" 2>/dev/null
  else
    echo "cifar-fast is not done: run this stage again at once (it resumes from $RUN/checkpoint.pth)"
  fi
  pack
  ;;
*) echo "usage: bash bench/gpu_session.sh bench | stash | D=<seconds> bash bench/gpu_session.sh train|supervised|transfer|cifar | bash bench/gpu_session.sh eval | bash bench/gpu_session.sh labeler" >&2; exit 2 ;;
esac
