#!/usr/bin/env bash
# Checkpoints, eval and exact resume, end to end with the real binary:
#   tests/integration/checkpoint.sh CASE DTRAIN_BINARY SCRATCH_DIR
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh" "$@"

small=experiments/fashion_mnist_small.yaml
# One thread: slower epochs give the kill points room, and the thread layout must match between
# the reference and the interrupted runs for bitwise equality.
common=(--set train.epochs=3 --set train.threads=1 --set train.progress=none)

reference() {  # trains the uninterrupted 3-epoch reference into $scratch/ref
  "$dtrain" run "$small" "${common[@]}" --run-dir "$scratch/ref" >"$scratch/ref.out" || fail "reference run failed"
  [ -f "$scratch/ref/checkpoints/ckpt-96.h5" ] || fail "no final checkpoint ckpt-96.h5: $(ls "$scratch/ref/checkpoints")"
}

same_weights() {  # run_dir: its final checkpoint equals the reference's, bit for bit
  local final="$1/checkpoints/ckpt-96.h5"
  [ -f "$final" ] || fail "$1 has no final checkpoint"
  h5diff "$scratch/ref/checkpoints/ckpt-96.h5" "$final" /model /model || fail "$1: final weights differ from the uninterrupted run"
  h5diff "$scratch/ref/checkpoints/ckpt-96.h5" "$final" /optimizer /optimizer || fail "$1: optimizer state differs"
  # Every epoch line the resumed run printed equals the uninterrupted run's, mid-epoch ones included.
  grep '^Epoch' "$1.resume.out" | while read -r line; do
    grep -qxF "$line" "$scratch/ref.out" || fail "$1: resumed run printed '$line', not in the reference"
  done || exit 1
  grep -q '^Epoch 3' "$1.resume.out" || fail "$1: no epoch 3 after resume"
}

# Starts a run in the background that holds after global step $2 (epoch 2 is steps 33-64) and
# waits until it holds there: a signal or kill then lands at that step on any machine.
start_and_hold() {  # run_dir step
  hold_env "$1.hold" "$2"
  env "${hold[@]}" "$dtrain" run "$small" "${common[@]}" --run-dir "$1" >"$1.out" 2>"$1.err" &
  pid=$!
  wait_held "$1.hold" 1 "$pid"
}

case "$case_name" in
  kill9_resume)
    reference
    for point in 1 2 3; do
      run="$scratch/killed$point"
      # A random step of epoch 2: the run goes on from the checkpoint of epoch 1.
      step=$((33 + RANDOM % 31))
      start_and_hold "$run" "$step"
      kill -9 "$pid"
      wait "$pid" 2>/dev/null
      lines=$(wc -l <"$run/metrics.jsonl")
      [ "$lines" -eq 1 ] || fail "killed at global step $step, but $lines epochs were logged"
      echo "kill point $point: killed at global step $step, after $lines epoch logged"
      "$dtrain" resume "$run" >"$run.resume.out" 2>"$run.resume.err" || fail "resume failed: $(cat "$run.resume.err")"
      grep -q "^Resuming from" "$run.resume.out" || fail "resume did not say where it started"
      same_weights "$run"
    done
    ;;
  sigterm_resume|sigint_resume)
    reference
    sig=TERM
    [ "$case_name" = sigint_resume ] && sig=INT
    run="$scratch/stopped_$sig"
    step=$((33 + RANDOM % 31))
    start_and_hold "$run" "$step"
    kill -s "$sig" "$pid"
    wait "$pid"
    rc=$?
    cat "$run.err"
    [ "$rc" -eq 4 ] || fail "SIG$sig: exit code $rc, wanted 4 (interrupted, checkpoint saved)"
    # The signal released the hold, and the loop stopped at that very step and saved it.
    grep -q "stopped at epoch 2, step $((step - 32)) of it; checkpoint .*ckpt-$step.h5" "$run.err" \
      || fail "SIG$sig at global step $step: not stopped there"
    grep -q "continue with: dtrain resume $run" "$run.err" || fail "SIG$sig: no resume command printed"
    "$dtrain" resume "$run" >"$run.resume.out" 2>"$run.resume.err" || fail "resume failed: $(cat "$run.resume.err")"
    cat "$run.resume.out"
    same_weights "$run"
    ;;
  eval_bn_dropout)
    # Evaluation runs in inference mode: no dropout, batch normalization by its moving statistics,
    # which the checkpoint holds: dtrain eval prints the Test figures training printed, and a resume
    # continues exactly (moving statistics and dropout masks included).
    bn=experiments/fashion_mnist_bn_dropout.yaml
    small_data=(--set data.source=hdf5 --set data.path=data/fashion_mnist_small.h5 --set data.shuffle_buffer=2000)
    "$dtrain" run "$bn" "${small_data[@]}" "${common[@]}" --run-dir "$scratch/bn" >"$scratch/bn.out" \
      || fail "training the bn/dropout experiment failed"
    h5dump -n "$scratch/bn/checkpoints/ckpt-96.h5" | grep -q "/model/batch_normalization/moving_variance" \
      || fail "the checkpoint holds no moving_variance"
    "$dtrain" eval --checkpoint "$scratch/bn/checkpoints/ckpt-96.h5" >"$scratch/eval.out" || fail "eval failed"
    want=$(grep '^Epoch 3' "$scratch/bn.out" | sed -E 's/.*(Test Loss: .*)$/\1/')
    grep -qF "$want" "$scratch/eval.out" || fail "eval printed '$(grep Test "$scratch/eval.out")', training printed '$want'"
    # Resumed after epoch 1, and from the middle of epoch 2 (step 50 of 96): the same final weights
    # and moving statistics, bit for bit, so the dropout masks followed the samples and the step.
    "$dtrain" run "$bn" "${small_data[@]}" "${common[@]}" --set train.epochs=1 --set checkpoint.every_steps=25 \
      --set checkpoint.max_to_keep=5 --run-dir "$scratch/bn_part" >/dev/null || fail "the one-epoch run failed"
    "$dtrain" run "$bn" "${small_data[@]}" "${common[@]}" --set checkpoint.every_steps=25 --set checkpoint.max_to_keep=5 \
      --run-dir "$scratch/bn_steps" >/dev/null || fail "the run with step checkpoints failed"
    [ -f "$scratch/bn_steps/checkpoints/ckpt-50.h5" ] || fail "no mid-epoch checkpoint ckpt-50.h5"
    rm "$scratch/bn_steps/checkpoints/ckpt-75.h5" "$scratch/bn_steps/checkpoints/ckpt-96.h5"
    "$dtrain" resume "$scratch/bn_part" --set train.epochs=3 >"$scratch/bn_part.resume.out" || fail "resume failed"
    "$dtrain" resume "$scratch/bn_steps" --checkpoint "$scratch/bn_steps/checkpoints/ckpt-50.h5" \
      >"$scratch/bn_steps.resume.out" || fail "resume from the middle of epoch 2 failed"
    for run in bn_part bn_steps; do
      h5diff "$scratch/bn/checkpoints/ckpt-96.h5" "$scratch/$run/checkpoints/ckpt-96.h5" /model /model \
        || fail "$run: the resumed run's weights and moving statistics differ from the uninterrupted run's"
    done
    # The resumed epoch's speed counts what this run trained: 14 of epoch 2's 32 steps (ckpt-50
    # stood at its step 18), 13 x 64 samples and the short last batch's 16, not the epoch's 2,000 in
    # the time of those.
    grep -q "^  train .* samples/s (14 steps, " "$scratch/bn_steps.resume.out" \
      || fail "the resumed epoch's throughput line: $(grep 'samples/s' "$scratch/bn_steps.resume.out" | head -1)"
    grep '"epoch": 2,' "$scratch/bn_steps/metrics.jsonl" | grep -q '"train_samples": 848,' \
      || fail "metrics.jsonl's resumed epoch: $(grep '"epoch": 2,' "$scratch/bn_steps/metrics.jsonl")"
    # eval counts epochs from 1 as the epoch lines do.
    grep -q "^Checkpoint .*ckpt-96.h5 (after epoch 3, global step 96)" "$scratch/eval.out" \
      || fail "eval's checkpoint line: $(head -1 "$scratch/eval.out")"
    ;;
  eval_matches_training)
    reference
    "$dtrain" eval --checkpoint "$scratch/ref/checkpoints/ckpt-96.h5" >"$scratch/eval.out" || fail "eval failed"
    cat "$scratch/eval.out"
    want=$(grep '^Epoch 3' "$scratch/ref.out" | sed -E 's/.*(Test Loss: .*)$/\1/')
    grep -qF "$want" "$scratch/eval.out" || fail "eval printed '$(grep Test "$scratch/eval.out")', training printed '$want'"
    h5dump -n "$scratch/ref/checkpoints/ckpt-96.h5" >"$scratch/dump" || fail "h5dump cannot open the checkpoint"
    grep -q "/model/conv2d/kernel" "$scratch/dump" || fail "h5dump shows no /model/conv2d/kernel"
    grep -q "/optimizer/" "$scratch/dump" || fail "h5dump shows no optimizer slots"
    ;;
  across_strategies)
    # Mirrored training, then default-strategy eval and resume; and the other way round.
    mirrored=(--set strategy.kind=mirrored --set "strategy.devices=[cpu:0, cpu:1]" --set train.threads=2)
    "$dtrain" run "$small" --set train.epochs=2 --set train.progress=none "${mirrored[@]}" --run-dir "$scratch/m" >"$scratch/m.out" || fail "mirrored run failed"
    ckpt=$(ls "$scratch"/m/checkpoints/ckpt-*.h5 | sort -V | tail -1)
    "$dtrain" eval --checkpoint "$ckpt" >"$scratch/m.eval" || fail "eval of a mirrored checkpoint failed"
    want=$(grep '^Epoch 2' "$scratch/m.out" | sed -E 's/.*(Test Loss: .*)$/\1/')
    grep -qF "$want" "$scratch/m.eval" || fail "eval '$(grep Test "$scratch/m.eval")' differs from training's '$want'"
    "$dtrain" resume "$scratch/m" --set "strategy={kind: default}" --set train.epochs=3 >"$scratch/m.resume" 2>"$scratch/m.resume.err" \
      || fail "default-strategy resume of a mirrored run failed: $(cat "$scratch/m.resume.err")"
    grep -q "warning: strategy={kind: default}" "$scratch/m.resume.err" || fail "no warning that the override changes the results"
    grep -q '^Epoch 3' "$scratch/m.resume" || fail "no epoch 3 after resume"
    "$dtrain" run "$small" --set train.epochs=1 --set train.progress=none --run-dir "$scratch/d" >/dev/null || fail "default run failed"
    "$dtrain" resume "$scratch/d" "${mirrored[@]}" --set train.epochs=2 >"$scratch/d.resume" 2>&1 || fail "mirrored resume of a default run failed"
    grep -q '| strategy mirrored | replicas 2' "$scratch/d.resume" || fail "resume did not use the mirrored strategy"
    grep -q '^Epoch 2' "$scratch/d.resume" || fail "no epoch 2 after resume"
    ;;
  bf16_resume)
    # mixed_bfloat16: exact resume (bit-identical weights and optimizer state), eval prints what
    # training printed, and the float32 checkpoints restore under float32 too.
    "$dtrain" info | grep -q "^precision mixed_bfloat16: available" || { echo "SKIP: this CPU has no bfloat16"; exit 77; }
    common+=(--set precision=mixed_bfloat16)
    reference
    grep -q '| precision mixed_bfloat16$' "$scratch/ref.out" || fail "the header does not name the precision"
    "$dtrain" run "$small" "${common[@]}" --set train.epochs=1 --run-dir "$scratch/part" >/dev/null || fail "one-epoch run failed"
    "$dtrain" resume "$scratch/part" --set train.epochs=3 >"$scratch/part.resume.out" || fail "resume failed"
    same_weights "$scratch/part"
    h5dump -d /model/conv2d/kernel -H "$scratch/ref/checkpoints/ckpt-96.h5" | grep -q H5T_IEEE_F32LE \
      || fail "the checkpoint's variables are not float32"
    "$dtrain" eval --checkpoint "$scratch/ref/checkpoints/ckpt-96.h5" >"$scratch/eval.out" || fail "eval failed"
    want=$(grep '^Epoch 3' "$scratch/ref.out" | sed -E 's/.*(Test Loss: .*)$/\1/')
    grep -qF "$want" "$scratch/eval.out" || fail "eval printed '$(grep Test "$scratch/eval.out")', training printed '$want'"
    "$dtrain" eval --checkpoint "$scratch/ref/checkpoints/ckpt-96.h5" --set precision=float32 >"$scratch/eval32.out" \
      || fail "eval under float32 failed"
    grep -q 'Test Accuracy' "$scratch/eval32.out" || fail "eval under float32 printed no test figures"
    "$dtrain" resume "$scratch/part" --set precision=float32 --set train.epochs=4 >"$scratch/f32.resume.out" 2>&1 \
      || fail "resume under float32 failed: $(tail -3 "$scratch/f32.resume.out")"
    grep -q '^Epoch 4' "$scratch/f32.resume.out" || fail "no epoch 4 under float32"
    ;;
  truncated_checkpoint)
    reference
    newest="$scratch/ref/checkpoints/ckpt-96.h5"
    head -c 20000 "$newest" >"$scratch/cut" && mv "$scratch/cut" "$newest"
    "$dtrain" eval --checkpoint "$newest" >/dev/null 2>"$scratch/eval.err"
    rc=$?
    cat "$scratch/eval.err"
    [ "$rc" -eq 2 ] || fail "eval of a truncated checkpoint: exit $rc, wanted 2"
    [ "$(wc -l <"$scratch/eval.err")" -eq 1 ] || fail "wanted a one-line error"
    grep -q "ckpt-96.h5" "$scratch/eval.err" || fail "the error does not name the file"
    "$dtrain" resume "$scratch/ref" --set train.epochs=4 >"$scratch/resume.out" 2>"$scratch/resume.err" || fail "resume failed: $(cat "$scratch/resume.err")"
    cat "$scratch/resume.err"
    grep -q "skipping .*ckpt-96.h5" "$scratch/resume.err" || fail "resume did not say it skipped the bad checkpoint"
    grep -q "^Resuming from .*ckpt-64.h5" "$scratch/resume.out" || fail "resume did not use the previous checkpoint"
    grep -q '^Epoch 4' "$scratch/resume.out" || fail "no epoch 4"
    ;;
  *)
    fail "unknown case"
    ;;
esac
echo "ok [$case_name]"
