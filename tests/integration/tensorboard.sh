#!/usr/bin/env bash
# train.tensorboard: a real run's event files read back with Python's protobuf
# (tests/integration/tfevents.py checks every record's CRCs and the values against metrics.jsonl).
#   tests/integration/tensorboard.sh CASE DTRAIN_BINARY SCRATCH_DIR
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh" "$@"
read_events=tests/integration/tfevents.py
small=experiments/fashion_mnist_small.yaml

case "$case_name" in
  events_match_metrics)
    # Every step's loss, validation figures, 2 epochs of 8 steps.
    "$dtrain" run "$small" --set train.epochs=2 --set train.steps_per_epoch=8 --set data.validation_split=0.2 \
      --set train.tensorboard=true --set train.log_every_steps=1 --run-dir "$scratch/run" >"$scratch/out" || fail "run failed"
    cat "$scratch/out"
    /usr/bin/python3 "$read_events" "$scratch/run" --step-every 1 --learning-rate 0.001 || fail "event files"
    # The default run writes none.
    "$dtrain" run "$small" --set train.epochs=1 --set train.steps_per_epoch=2 --run-dir "$scratch/plain" >/dev/null || fail "run failed"
    [ ! -e "$scratch/plain/tensorboard" ] || fail "tensorboard/ written without train.tensorboard"
    # --overwrite replaces the old run's event files too (else TensorBoard would mix both runs).
    "$dtrain" run "$small" --set train.epochs=1 --set train.steps_per_epoch=2 --set train.tensorboard=true \
      --set train.log_every_steps=0 --run-dir "$scratch/run" --overwrite >/dev/null || fail "--overwrite run failed"
    /usr/bin/python3 "$read_events" "$scratch/run" --files 1 || fail "event files after --overwrite"
    ;;
  resume)
    # A resumed run writes a file of its own; the first one stays as it was.
    "$dtrain" run "$small" --set train.epochs=1 --set train.steps_per_epoch=6 --set train.tensorboard=true \
      --set train.log_every_steps=4 --run-dir "$scratch/run" >/dev/null || fail "run failed"
    first=$(ls "$scratch/run/tensorboard")
    sum=$(md5sum <"$scratch/run/tensorboard/$first")
    "$dtrain" resume "$scratch/run" --set train.epochs=3 >"$scratch/out" || fail "resume failed"
    cat "$scratch/out"
    [ "$(md5sum <"$scratch/run/tensorboard/$first")" = "$sum" ] || fail "the resumed run changed the first event file"
    /usr/bin/python3 "$read_events" "$scratch/run" --files 2 --resumed-at 6 --step-every 4 || fail "event files"
    ;;
  chief_only)
    OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl=self,vader OMP_NUM_THREADS=1 \
      mpirun --oversubscribe -n 2 "$dtrain" run "$small" --set strategy.kind=multi_worker_mirrored \
      --set data.batch_size_per_replica=32 --set train.epochs=1 --set train.steps_per_epoch=4 \
      --set train.tensorboard=true --set train.log_every_steps=2 --run-dir "$scratch/run" >"$scratch/out" || fail "mpirun failed"
    cat "$scratch/out"
    /usr/bin/python3 "$read_events" "$scratch/run" --files 1 --step-every 2 || fail "event files (one, the chief's)"
    ;;
  read_by_tensorboard)
    # TensorBoard's own reader (build/venv, made by tools/setup) over a 2-rank run and its resume.
    python=${DTRAIN_VENV:-build/venv}/bin/python
    "$python" -c "import tensorboard" 2>/dev/null ||
      fail "no tensorboard in ${DTRAIN_VENV:-build/venv}: run tools/setup (it installs tools/requirements.txt there)"
    since=$(date +%s.%N)
    OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl=self,vader OMP_NUM_THREADS=1 \
      mpirun --oversubscribe -n 2 "$dtrain" run "$small" --set strategy.kind=multi_worker_mirrored \
      --set data.batch_size_per_replica=32 --set data.validation_split=0.2 --set train.epochs=1 \
      --set train.steps_per_epoch=4 --set train.tensorboard=true --set train.log_every_steps=2 \
      --run-dir "$scratch/run" >"$scratch/out" || fail "mpirun failed"
    OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl=self,vader OMP_NUM_THREADS=1 \
      mpirun --oversubscribe -n 2 "$dtrain" resume "$scratch/run" --set train.epochs=3 >>"$scratch/out" ||
      fail "the resume under mpirun failed"
    until=$(date +%s.%N)
    cat "$scratch/out"
    "$python" tests/integration/tb_reader.py "$scratch/run" --since "$since" --until "$until" ||
      fail "TensorBoard's reader disagrees with metrics.jsonl"
    ;;
  *) fail "unknown case" ;;
esac
echo "PASS [$case_name]"
