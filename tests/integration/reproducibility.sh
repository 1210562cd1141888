#!/usr/bin/env bash
# reproducibility: replica_invariant (docs/reproducibility.md): the same bits whatever computed
# them. One epoch of tests/integration/replica_invariant.yaml (batch normalization synchronized and
# ghost, dropout, L2, a global batch of 50 in micro-batches of 8) under every layout below must end
# on the same checkpoint, byte for byte (h5diff without tolerance: variables, optimizer slots, the
# running figures), and print the same epoch line.
#   reproducibility.sh CASE DTRAIN SCRATCH
set -euo pipefail
source "$(dirname "$0")/common.sh"
exp=tests/integration/replica_invariant.yaml
[ -f data/fashion_mnist_small.h5 ] || fail "data/fashion_mnist_small.h5 is missing (tools/setup makes it)"
mwm() { echo "strategy={kind: multi_worker_mirrored, $1}"; }

# run NAME LAUNCHER [--set ...]: one epoch into $scratch/NAME, its epoch line into NAME.epoch.
run() {
  local name=$1 launcher=$2; shift 2
  $launcher "$dtrain" run "$exp" --run-dir "$scratch/$name" "$@" >"$scratch/$name.out" 2>&1 ||
    fail "$name failed: $(tail -5 "$scratch/$name.out")"
  grep '^Epoch' "$scratch/$name.out" >"$scratch/$name.epoch" || fail "$name printed no epoch line"
}
# same REFERENCE NAME: NAME's last checkpoint and epoch line are REFERENCE's.
same() {
  local a b
  a=$(ls "$scratch/$1"/checkpoints/ckpt-*.h5 | sort -V | tail -1)
  b=$(ls "$scratch/$2"/checkpoints/ckpt-*.h5 | sort -V | tail -1)
  [ "$(basename "$a")" = "$(basename "$b")" ] || fail "$2 ended at $(basename "$b"), $1 at $(basename "$a")"
  for group in /model /optimizer /state/metrics; do
    h5diff -r "$a" "$b" "$group" "$group" >"$scratch/h5diff.out" 2>&1 ||
      fail "$2: $group differs from $1: $(head -20 "$scratch/h5diff.out")"
  done
  for scalar in epoch step_in_epoch global_step epoch_loss_sum epoch_samples; do
    h5diff "$a" "$b" "/state/$scalar" "/state/$scalar" >/dev/null || fail "$2: /state/$scalar differs from $1"
  done
  cmp -s "$scratch/$1.epoch" "$scratch/$2.epoch" ||
    fail "$2's epoch line differs: $(cat "$scratch/$2.epoch") against $(cat "$scratch/$1.epoch")"
  echo "ok: $2 = $1: $(cat "$scratch/$2.epoch")"
}

case "$case_name" in
  one_process)
    run one_thread "" --set train.threads=1
    run two_threads "" --set train.threads=2
    run operations "" --set train.threads=2 --set train.parallelism=operations
    run one_device "" --set 'strategy={kind: one_device, device: cpu:0}'
    for n in 2 3 4; do
      devices=$(seq -s ', ' -f 'cpu:%g' 0 $((n - 1)))
      run "mirrored$n" "" --set "strategy={kind: mirrored, devices: [$devices]}"
    done
    run mirrored_to_one "" --set 'strategy={kind: mirrored, devices: [cpu:0, cpu:1, cpu:2], cross_device_ops: reduction_to_one_device}'
    run central_storage "" --set 'strategy={kind: central_storage, devices: [cpu:0, cpu:1, cpu:2], parameter_device: cpu:1}'
    for name in two_threads operations one_device mirrored2 mirrored3 mirrored4 mirrored_to_one central_storage; do
      same one_thread "$name"
    done
    # Without a synchronized layer each lane computes several micro-batches in turn (a lane per
    # thread, not per micro-batch): the same bits again, on 1 and 2 threads and 3 replicas.
    ghost=(--set model.layers.1.batch_normalization.synchronized=false)
    run ghost_one_thread "" "${ghost[@]}" --set train.threads=1
    run ghost_two_threads "" "${ghost[@]}" --set train.threads=2
    run ghost_mirrored3 "" "${ghost[@]}" --set 'strategy={kind: mirrored, devices: [cpu:0, cpu:1, cpu:2]}'
    same ghost_one_thread ghost_two_threads
    same ghost_one_thread ghost_mirrored3
    # A held mode line in the header, so that a log says which mode made it.
    grep -q "reproducibility replica_invariant, micro-batch 8" "$scratch/one_thread.out" || fail "header: $(head -1 "$scratch/one_thread.out")"
    ;;
  multi_worker)
    run alone "" --set train.threads=1
    for n in 2 3 4; do
      run "ranks$n" "mpirun -n $n" --set train.threads=1 --set "$(mwm "communication: {overlap: false}")"
      same alone "ranks$n"
    done
    run ranks2_overlap "mpirun -n 2" --set train.threads=1 \
      --set "$(mwm "communication: {implementation: ring, bytes_per_pack: 4096, overlap: true}")"
    run ranks3_mpi "mpirun -n 3" --set train.threads=1 --set "$(mwm "communication: {implementation: mpi}")"
    run ranks2_local2 "mpirun -n 2" --set "$(mwm "devices: [cpu:0, cpu:1]")"
    run ranks2_local3 "mpirun -n 2" --set "$(mwm "devices: [cpu:0, cpu:1, cpu:2]")"
    for name in ranks2_overlap ranks3_mpi ranks2_local2 ranks2_local3; do same alone "$name"; done
    ghost=(--set model.layers.1.batch_normalization.synchronized=false)
    run ghost_alone "" "${ghost[@]}" --set train.threads=2
    run ghost_ranks3 "mpirun -n 3" "${ghost[@]}" --set train.threads=1 --set "$(mwm "communication: {overlap: true}")"
    same ghost_alone ghost_ranks3
    ;;
  elastic_resume)
    # 4 ranks, 2 epochs of 40 steps, checkpoints every 10 steps; the reference runs uninterrupted.
    common=(--set train.epochs=2 --set train.threads=1 --set checkpoint.every_steps=10 --set checkpoint.max_to_keep=20)
    run ref "mpirun -n 4" "${common[@]}" --set "$(mwm "communication: {timeout_seconds: 60}")"
    # The same run, killed mid-epoch: every rank holds after step 25, one dies there.
    victim_run="$scratch/killed"
    hold_env "$victim_run.hold" 25
    env "${hold[@]}" timeout 300 mpirun -n 4 "$dtrain" run "$exp" "${common[@]}" \
      --set "$(mwm "communication: {timeout_seconds: 60}")" --run-dir "$victim_run" >"$victim_run.out" 2>&1 &
    launcher=$!
    wait_held "$victim_run.hold" 4 "$launcher"
    [ -e "$victim_run/checkpoints/ckpt-20.h5" ] || fail "checkpoint ckpt-20.h5 was never written"
    victim=$(rank_pid "$victim_run" 2 || true)
    [ -n "$victim" ] || fail "rank 2 not found"
    kill -9 "$victim"
    wait "$launcher" && fail "mpirun returned 0 after a rank was killed"
    rm -f "$victim_run"/checkpoints/ckpt-2[1-9].h5  # what the others may have saved while dying: none is due
    # Resumed from step 20 (epoch 1, step 20 of 40) on 2 ranks, and in one process on 3 replicas,
    # with the batch keys an elastic resume sets (the global batch they resolve to is the
    # checkpoint's, so nothing changes, and nothing says it does).
    cp -r "$victim_run" "$scratch/on2" && cp -r "$victim_run" "$scratch/on3"
    mpirun -n 2 "$dtrain" resume "$scratch/on2" >"$scratch/on2.out" 2>&1 || fail "resume on 2 ranks: $(tail -5 "$scratch/on2.out")"
    "$dtrain" resume "$scratch/on3" --set 'strategy={kind: mirrored, devices: [cpu:0, cpu:1, cpu:2]}' \
      --set data.batch_size_per_replica=null --set data.global_batch_size=50 \
      >"$scratch/on3.out" 2>&1 || fail "resume on 3 replicas: $(tail -5 "$scratch/on3.out")"
    for name in on2 on3; do
      grep -q "Resuming from .*ckpt-20.h5" "$scratch/$name.out" || fail "$name did not resume from step 20: $(head -5 "$scratch/$name.out")"
      grep -q "replica_invariant keeps the bits" "$scratch/$name.out" || fail "$name: no word of the layout change: $(head -5 "$scratch/$name.out")"
      grep -q "change.* the results" "$scratch/$name.out" && fail "$name warns that the layout change changes the results"
      grep '^Epoch' "$scratch/$name.out" >"$scratch/$name.epoch"
      grep '^Epoch 2' "$scratch/ref.out" >"$scratch/ref.epoch"
      grep '^Epoch 2' "$scratch/$name.out" >"$scratch/$name.epoch"
      same ref "$name"
    done
    ;;
  elastic_batch_keys)
    # A run written with batch_size_per_replica (25 on 2 replicas), resumed elastically as
    # docs/reproducibility.md says: --set data.batch_size_per_replica=null --set
    # data.global_batch_size=50, the checkpoint's global batch, here on 3 replicas. Nothing changes
    # and resume says nothing does; and once the resume has rewritten config.yaml with those keys,
    # the run's earlier checkpoints are still its own (a resume that died before its first save
    # goes on from them).
    per=(--set data.global_batch_size=null --set data.batch_size_per_replica=25 --set train.threads=1
         --set 'strategy={kind: mirrored, devices: [cpu:0, cpu:1]}')
    run ref "" "${per[@]}" --set train.epochs=2
    run part "" "${per[@]}"
    elastic=(--set train.epochs=2 --set data.batch_size_per_replica=null --set data.global_batch_size=50
             --set 'strategy={kind: mirrored, devices: [cpu:0, cpu:1, cpu:2]}')
    "$dtrain" resume "$scratch/part" "${elastic[@]}" >"$scratch/resumed.out" 2>&1 || fail "resume: $(tail -5 "$scratch/resumed.out")"
    grep -q "change.* the results" "$scratch/resumed.out" && fail "the batch keys are said to change the results: $(head -3 "$scratch/resumed.out")"
    grep -q "^dtrain: warning" "$scratch/resumed.out" && fail "a warning: $(grep '^dtrain: warning' "$scratch/resumed.out")"
    grep '^Epoch' "$scratch/resumed.out" >"$scratch/resumed.epoch"
    grep '^Epoch 2' "$scratch/ref.out" >"$scratch/ref.epoch"
    cp -r "$scratch/part" "$scratch/resumed"
    same ref resumed
    # The resumed run's own checkpoint gone (it died before saving): the epoch-1 checkpoint, its
    # experiment written with batch_size_per_replica, is still the run's, whose config.yaml the
    # resume rewrote with global_batch_size (each resume passes its overrides again).
    last=$(ls "$scratch/part"/checkpoints/ckpt-*.h5 | sort -V | tail -1)
    rm "$last"
    grep -q "global_batch_size: 50" "$scratch/part/config.yaml" || fail "the resume did not write its experiment"
    "$dtrain" resume "$scratch/part" "${elastic[@]}" \
      >"$scratch/again.out" 2>&1 || fail "resume after the resumed run's checkpoint was lost: $(tail -5 "$scratch/again.out")"
    grep -q "Resuming from .*$(basename "$(ls "$scratch/part"/checkpoints/ckpt-*.h5 | sort -V | head -1)")" "$scratch/again.out" \
      || fail "did not resume from the epoch-1 checkpoint: $(head -5 "$scratch/again.out")"
    grep '^Epoch' "$scratch/again.out" >"$scratch/again.epoch"
    cp -r "$scratch/part" "$scratch/again"
    same ref again
    ;;
  pinned_isa)
    # reproducibility.isa: avx2 caps oneDNN's kernels (the header says so) and keeps the mode's
    # invariance; the run is then the same on every machine with AVX2 (docs/reproducibility.md).
    grep -qw avx2 /proc/cpuinfo || { echo "skipped: this CPU has no AVX2"; exit 0; }
    run pinned "" --set reproducibility.isa=avx2 --set train.threads=1
    run pinned3 "" --set reproducibility.isa=avx2 --set 'strategy={kind: mirrored, devices: [cpu:0, cpu:1, cpu:2]}'
    run pinned_ranks2 "mpirun -n 2" --set reproducibility.isa=avx2 --set "$(mwm "communication: {overlap: false}")"
    same pinned pinned3
    same pinned pinned_ranks2
    grep -q "isa avx2 |" "$scratch/pinned.out" || fail "the header does not name the capped ISA: $(head -1 "$scratch/pinned.out")"
    # Across machines: the variables and slots of this capped run, as h5dump prints them, were
    # these bytes on a 2-core AMD EPYC with AVX-512 (b0c7eb6ef4ed23b9 before the small dense
    # layers' own loops, also on a 16-core Intel Xeon, Sapphire Rapids, AMX, on 2026-11-26; the
    # loops' AVX2 build is the same code on every such CPU, but the Xeon has not rerun it yet). A
    # machine that differs breaks the claim of docs/reproducibility.md.
    digest=$(h5dump -m '%.9g' -g /model -g /optimizer "$scratch/pinned/checkpoints/ckpt-40.h5" | tail -n +2 |
             sha256sum | cut -c1-16)
    [ "$digest" = 330e1695e6f2f7df ] ||
      fail "capped to AVX2, this CPU ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)) computes other bits ($digest) than the AMD EPYC did (330e1695e6f2f7df)"
    # A cap the CPU does not reach is refused at the key.
    set +e; "$dtrain" run "$exp" --set reproducibility.isa=avx512_core_amx --run-dir "$scratch/r" >"$scratch/amx.out" 2>&1
    rc=$?; set -e
    if grep -q "does not have the avx512_core_amx" "$scratch/amx.out"; then
      [ "$rc" -eq 2 ] || fail "exit $rc for a cap the CPU lacks"
      grep -q "error: --set reproducibility.isa=avx512_core_amx: " "$scratch/amx.out" || fail "not located: $(cat "$scratch/amx.out")"
    else
      [ "$rc" -eq 0 ] || fail "an AMX machine refused the AMX cap: $(tail -3 "$scratch/amx.out")"
    fi
    ;;
  loss_figure)
    # The printed loss of a regularized model is the data loss plus the regularization loss of the
    # weights the step's gradients were taken at, in this mode as in fast: with a batch
    # normalization synchronized (so that both normalize over the whole batch) they print the same
    # loss to rounding. The figure once read the weights after the step's update: 4e-4 higher here.
    # Under central_storage with the variables on another replica's thread, that read also raced
    # with the update.
    common=(--set train.steps_per_epoch=3 --set 'model.layers.0.conv2d.kernel_regularizer={l2: 0.05}'
            --set model.layers.5.batch_normalization.synchronized=true)
    run invariant "" "${common[@]}" --set train.threads=1
    run fast "" "${common[@]}" --set train.threads=1 --set reproducibility=null
    run central "" "${common[@]}" --set 'strategy={kind: central_storage, devices: [cpu:0, cpu:1, cpu:2], parameter_device: cpu:2}'
    same invariant central
    python3 - "$scratch/invariant/metrics.jsonl" "$scratch/fast/metrics.jsonl" <<'PY' || fail "the loss figures differ"
import json, sys
a, b = (json.loads(open(p).readline())["loss"] for p in sys.argv[1:])
print(f"replica_invariant loss {a!r}, fast {b!r}")
sys.exit(abs(a - b) > 1e-6 * abs(b))
PY
    ;;
  refusals)
    # What the mode cannot cover says so at reproducibility.mode, with exit 2.
    expect() {
      local want=$1; shift
      set +e; "$dtrain" "$@" >"$scratch/out" 2>&1; local rc=$?; set -e
      [ "$rc" -eq 2 ] || fail "exit $rc, not 2: $*: $(cat "$scratch/out")"
      grep -q "$want" "$scratch/out" || fail "'$want' not in: $(cat "$scratch/out")"
    }
    expect "replica_invariant.yaml:.*data.distribute: split_global_batch" run "$exp" --set data.distribute=per_replica \
      --run-dir "$scratch/r1"
    expect "micro_batch_size applies to mode replica_invariant only" validate experiments/fashion_mnist_small.yaml \
      --set reproducibility.micro_batch_size=4
    expect "raise micro_batch_size to at least" run "$exp" --set reproducibility.micro_batch_size=1 \
      --set data.global_batch_size=1000 --run-dir "$scratch/r2"
    # Micro-batches of one sample under a batch normalization of flat features that is not
    # synchronized: warned of (it would learn nothing below it), at the mode.
    "$dtrain" run "$exp" --set reproducibility.micro_batch_size=1 --set data.global_batch_size=4 \
      --set train.steps_per_epoch=2 --set 'model.layers=[{flatten: {}}, {dense: {units: 8}},
      {batch_normalization: {}}, {dense: {units: 10}}]' --run-dir "$scratch/r3" >"$scratch/out" 2>&1 \
      || fail "the run with micro-batches of one failed: $(cat "$scratch/out")"
    grep -q "warning: .*replica_invariant.yaml:[0-9]*:[0-9]*: reproducibility.micro_batch_size 1 normalizes layer 'batch_normalization' over one sample" \
      "$scratch/out" || fail "no warning of one-sample batch normalization: $(cat "$scratch/out")"
    "$dtrain" run "$exp" --set reproducibility.micro_batch_size=2 --set data.global_batch_size=4 \
      --set train.steps_per_epoch=2 --set 'model.layers=[{flatten: {}}, {dense: {units: 8}},
      {batch_normalization: {}}, {dense: {units: 10}}]' --run-dir "$scratch/r4" >"$scratch/out" 2>&1 \
      || fail "the run with micro-batches of two failed: $(cat "$scratch/out")"
    grep -q "warning" "$scratch/out" && fail "a warning for micro-batches of two: $(cat "$scratch/out")"
    true
    ;;
  *) fail "unknown case" ;;
esac
