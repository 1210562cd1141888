#!/usr/bin/env bash
# The memory seam, proven on the CPU (docs/architecture.md, "Memory a backend owns"): every
# strategy, a checkpoint resume and the parameter server run with DTRAIN_CHECKED_MEMORY=1, where
# the CPU backend's memory faults when the host touches it outside the backend's own calls and
# every collective goes through the staging copies a GPU needs. The epoch lines must be the bytes
# of the same run without the check (the synchronous strategies); the asynchronous parameter
# server must train and exit 0.
#   checked_memory.sh CASE DTRAIN SCRATCH
set -euo pipefail
source "$(dirname "$0")/common.sh"
small=experiments/fashion_mnist_small.yaml
[ -f data/fashion_mnist_small.h5 ] || fail "data/fashion_mnist_small.h5 is missing (tools/setup makes it)"

# Epoch lines of one run: unchecked into $scratch/plain.out, checked into $scratch/checked.out;
# the launcher (empty, or mpirun -n N) comes first.
both() {
  local launcher=$1; shift
  for mode in plain checked; do
    local flag=0; [ "$mode" = checked ] && flag=1
    rm -rf "$scratch/run_$mode"
    DTRAIN_CHECKED_MEMORY=$flag $launcher "$dtrain" run "$small" --set train.epochs=2 --set train.steps_per_epoch=8 \
      "$@" --run-dir "$scratch/run_$mode" >"$scratch/$mode.log" 2>&1 || { cat "$scratch/$mode.log" >&2; fail "$mode run failed"; }
    grep '^Epoch' "$scratch/$mode.log" >"$scratch/$mode.out" || true
  done
  [ -s "$scratch/plain.out" ] || fail "no epoch lines"
  diff "$scratch/plain.out" "$scratch/checked.out" >&2 || fail "the checked run's epoch lines differ"
}
mpi() { echo "mpirun -n $1 -x DTRAIN_CHECKED_MEMORY"; }

case "$case_name" in
  one_process)
    # 1 thread: the checked mode computes each replica as one lane (train.parallelism: batch
    # needs memory the host shares), so the unchecked run is given the same.
    both "" --set train.threads=1
    both "" --set 'strategy={kind: one_device, device: cpu:0}' --set train.threads=1
    both "" --set 'strategy={kind: mirrored, devices: [cpu:0, cpu:1, cpu:2]}'
    both "" --set 'strategy={kind: central_storage, devices: [cpu:0, cpu:1], parameter_device: cpu:1}'
    # Batch normalization (synchronized: its sums cross the replicas in backward) and dropout.
    small=experiments/fashion_mnist_bn_dropout.yaml
    both "" --set 'strategy={kind: mirrored, devices: [cpu:0, cpu:1]}' --set data.source=hdf5 \
      --set data.path=data/fashion_mnist_small.h5 --set model.layers.1.batch_normalization.synchronized=true
    ;;
  multi_worker)
    both "$(mpi 2)" --set 'strategy={kind: multi_worker_mirrored, communication: {overlap: true}}' --set train.threads=1
    both "$(mpi 2)" --set 'strategy={kind: multi_worker_mirrored, communication: {implementation: ring, bytes_per_pack: 4096}}' --set train.threads=1
    both "$(mpi 2)" --set 'strategy={kind: multi_worker_mirrored, devices: [cpu:0, cpu:1]}'
    ;;
  resume)
    for mode in plain checked; do
      flag=0; [ "$mode" = checked ] && flag=1
      rm -rf "$scratch/r_$mode"
      DTRAIN_CHECKED_MEMORY=$flag "$dtrain" run "$small" --set train.epochs=1 --set train.steps_per_epoch=8 \
        --set train.threads=1 --run-dir "$scratch/r_$mode" >/dev/null 2>&1 || fail "$mode first run failed"
      DTRAIN_CHECKED_MEMORY=$flag "$dtrain" resume "$scratch/r_$mode" --set train.epochs=2 >"$scratch/$mode.log" 2>&1 ||
        { cat "$scratch/$mode.log" >&2; fail "$mode resume failed"; }
      grep '^Epoch' "$scratch/$mode.log" >"$scratch/$mode.out"
      checkpoint=$(ls "$scratch/r_$mode"/checkpoints/ckpt-*.h5 | sort -V | tail -1)
      DTRAIN_CHECKED_MEMORY=$flag "$dtrain" eval --checkpoint "$checkpoint" 2>&1 | grep -E "^Test" >>"$scratch/$mode.out" ||
        fail "$mode eval failed"
    done
    diff "$scratch/plain.out" "$scratch/checked.out" >&2 || fail "the checked resume differs"
    ;;
  parameter_server)
    rm -rf "$scratch/ps"
    DTRAIN_CHECKED_MEMORY=1 mpirun -n 4 -x DTRAIN_CHECKED_MEMORY "$dtrain" run "$small" --set train.epochs=1 \
      --set train.steps_per_epoch=8 --set 'strategy={kind: parameter_server, roles: {chief: 1, worker: 2, ps: 1}}' \
      --run-dir "$scratch/ps" >"$scratch/ps.log" 2>&1 || { cat "$scratch/ps.log" >&2; fail "the checked parameter-server run failed"; }
    grep -q '^Epoch 1,' "$scratch/ps.log" || fail "no epoch line from the checked parameter-server run"
    ;;
  *) fail "unknown case" ;;
esac
echo "PASS [$case_name]"
