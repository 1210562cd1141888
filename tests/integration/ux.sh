#!/usr/bin/env bash
# What a user sees around a run: logs under mpirun, `dtrain init`, `dtrain plot` and train.plot.
#   tests/integration/ux.sh CASE DTRAIN_BINARY SCRATCH_DIR
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh" "$@"

small=experiments/fashion_mnist_small.yaml
short=(--set train.epochs=2 --set train.steps_per_epoch=3 --set train.threads=1)
# A PNG file: the 8-byte signature, then a non-empty picture.
is_png() { [ -s "$1" ] && [ "$(head -c 8 "$1" | od -An -tx1 | tr -d ' \n')" = "89504e470d0a1a0a" ]; }

case "$case_name" in
  mpi_log)
    # OpenMPI gives each rank a pseudo-terminal even when mpirun writes into a file: progress
    # auto must still draw no bar there. TERM is set as on a user's machine, or auto would not
    # draw a bar for a reason other than the launcher.
    TERM=xterm mpirun -n 2 --oversubscribe "$dtrain" run "$small" "${short[@]}" \
      --set 'strategy={kind: multi_worker_mirrored}' --set train.progress=auto --run-dir "$scratch/run" \
      >"$scratch/log" 2>"$scratch/err" || fail "mpirun failed: $(tail -5 "$scratch/err")"
    cat "$scratch/log"
    [ "$(grep -c 'Epoch' "$scratch/log")" -eq 2 ] || fail "wanted 2 epoch lines"
    grep 'Epoch' "$scratch/log" | grep -Ev '^Epoch [0-9]+, Loss: ' && fail "an epoch line does not start its own line"
    if grep -q $'\r' "$scratch/log" || grep -q $'\x1b' "$scratch/log"; then fail "carriage return or escape code in the log"; fi
    ;;
  bar_on_terminal)
    # The other side of the rule: one process on a real terminal (script(1) gives it one) draws a bar.
    TERM=xterm script -qec "'$dtrain' run '$small' --set train.epochs=1 --set train.steps_per_epoch=20 --set train.threads=1 --run-dir '$scratch/run'" \
      "$scratch/typescript" >/dev/null </dev/null || fail "run on a terminal failed"
    grep -q $'\r' "$scratch/typescript" || fail "no progress bar on a terminal: $(cat -v "$scratch/typescript" | head -5)"
    grep -aq '20/20 \[' "$scratch/typescript" || fail "the bar did not reach 20/20"
    ;;
  init_strategies)
    # Each strategy's template validates as written, and trains a step on the small data.
    one_step=(--set data.source=hdf5 --set data.path=data/fashion_mnist_small.h5 --set train.epochs=1
              --set train.steps_per_epoch=1 --set train.threads=1)
    for kind in default one_device mirrored central_storage multi_worker_mirrored parameter_server; do
      file="$scratch/$kind.yaml"
      "$dtrain" init --strategy "$kind" -o "$file" >/dev/null || fail "init --strategy $kind failed"
      grep -q "kind: $kind" "$file" || fail "$kind: no strategy kind in $file"
      for todo in strategy dataset model 'loss reduction' metrics epochs; do
        grep -q "# TODO($todo)" "$file" || fail "$kind: no TODO($todo) in $file"
      done
      "$dtrain" validate "$file" >"$scratch/$kind.validate" || fail "$kind: validate failed"
      if [ "$kind" = multi_worker_mirrored ] || [ "$kind" = parameter_server ]; then
        n=2
        [ "$kind" = parameter_server ] && n=5
        grep -q "mpirun -n $n dtrain run FILE" "$file" || fail "$kind: the header does not say mpirun -n $n"
        mpirun -n $n --oversubscribe "$dtrain" run "$file" "${one_step[@]}" --run-dir "$scratch/run_$kind" \
          >"$scratch/$kind.out" 2>&1 || fail "$kind: mpirun -n $n failed: $(tail -5 "$scratch/$kind.out")"
      else
        "$dtrain" run "$file" "${one_step[@]}" --run-dir "$scratch/run_$kind" >"$scratch/$kind.out" 2>&1 \
          || fail "$kind: run failed: $(tail -5 "$scratch/$kind.out")"
      fi
      grep -q '^Epoch 1, Loss: ' "$scratch/$kind.out" || fail "$kind: no epoch line: $(cat "$scratch/$kind.out")"
    done
    "$dtrain" init --model mlp >"$scratch/mlp.yaml" || fail "init --model mlp failed"
    "$dtrain" validate "$scratch/mlp.yaml" >/dev/null || fail "the mlp template does not validate"
    ;;
  init_default_trains)
    # The default template exactly as written, on the Fashion-MNIST tools/setup installs: only
    # shortened to two steps.
    "$dtrain" init -o "$scratch/first.yaml" >/dev/null || fail "init failed"
    "$dtrain" run "$scratch/first.yaml" --set train.steps_per_epoch=2 --set train.epochs=1 --run-dir "$scratch/run" \
      >"$scratch/out" 2>&1 || fail "the default template does not train: $(tail -5 "$scratch/out")"
    cat "$scratch/out"
    grep -Eq '^Epoch 1, Loss: [0-9.]+, Accuracy: [0-9.]+, Test Loss: [0-9.]+, Test Accuracy: [0-9.]+$' "$scratch/out" \
      || fail "no epoch line"
    grep -q '(2 steps' "$scratch/out" || fail "not the two steps asked for"
    ;;
  local_strategy_under_mpirun)
    # A strategy that runs in one process, under mpirun -n 2: every rank would train alone into
    # one run directory. Refused at start: exit 2, one line naming the strategy's place, nothing
    # written.
    expect_refused() {  # name what-regex -- command...
      local name=$1 regex=$2; shift 3
      "$@" >"$scratch/$name.out" 2>"$scratch/$name.err"
      local rc=$?
      cat "$scratch/$name.err"
      [ "$rc" -eq 2 ] || fail "$name: exit $rc, wanted 2"
      [ "$(grep -c 'dtrain' "$scratch/$name.err")" -eq 1 ] || fail "$name: wanted one line from dtrain: $(cat "$scratch/$name.err")"
      grep -Eq "^dtrain: error: $regex.*mpirun started 2 processes: .* use strategy kind multi_worker_mirrored \(or parameter_server\), or run without mpirun$" \
        "$scratch/$name.err" || fail "$name: message: $(cat "$scratch/$name.err")"
      [ -s "$scratch/$name.out" ] && fail "$name: printed on stdout: $(cat "$scratch/$name.out")"
      return 0
    }
    mpi2=(mpirun -n 2 --oversubscribe "$dtrain")
    expect_refused default "experiments/fashion_mnist_small\.yaml:6:[0-9]+: strategy kind default runs in one process" \
      -- "${mpi2[@]}" run "$small" "${short[@]}" --run-dir "$scratch/run"
    [ -e "$scratch/run" ] && fail "the refused run wrote $scratch/run"
    for kind in one_device mirrored central_storage; do
      expect_refused "$kind" "--set strategy=\{kind: $kind\}: strategy kind $kind runs in one process" \
        -- "${mpi2[@]}" run "$small" "${short[@]}" --set "strategy={kind: $kind}" --run-dir "$scratch/run_$kind"
      [ -e "$scratch/run_$kind" ] && fail "the refused $kind run wrote its run directory"
    done
    # One process under mpirun is a job of one: it trains.
    mpirun -n 1 "$dtrain" run "$small" "${short[@]}" --set train.progress=none --run-dir "$scratch/one" \
      >"$scratch/one.out" 2>&1 || fail "mpirun -n 1 failed: $(tail -5 "$scratch/one.out")"
    [ "$(grep -c '^Epoch' "$scratch/one.out")" -eq 2 ] || fail "mpirun -n 1 did not train its 2 epochs"
    # resume and bench refuse alike; eval splits the test set over the processes and prints once.
    cp -r "$scratch/one" "$scratch/resumed"
    expect_refused resume "$scratch/resumed/checkpoints/ckpt-6\.h5:/experiment:[0-9]+:[0-9]+: strategy kind default" \
      -- "${mpi2[@]}" resume "$scratch/resumed" --set train.epochs=3
    cmp "$scratch/one/metrics.jsonl" "$scratch/resumed/metrics.jsonl" || fail "the refused resume changed metrics.jsonl"
    expect_refused bench "experiments/fashion_mnist_small\.yaml:6:[0-9]+: strategy kind default" \
      -- "${mpi2[@]}" bench "$small" --steps 2 --warmup 1
    "${mpi2[@]}" eval --checkpoint "$scratch/one/checkpoints/ckpt-6.h5" >"$scratch/eval.out" 2>&1 \
      || fail "eval under mpirun -n 2 failed: $(cat "$scratch/eval.out")"
    [ "$(grep -c '^Test Loss: ' "$scratch/eval.out")" -eq 1 ] || fail "eval did not print once: $(cat "$scratch/eval.out")"
    "$dtrain" eval --checkpoint "$scratch/one/checkpoints/ckpt-6.h5" >"$scratch/eval1.out" 2>&1 || fail "eval failed"
    [ "$(grep '^Test Loss: ' "$scratch/eval.out")" = "$(grep '^Test Loss: ' "$scratch/eval1.out")" ] \
      || fail "eval over 2 processes differs from one: $(cat "$scratch/eval.out" "$scratch/eval1.out")"
    ;;
  init_overwrite)
    "$dtrain" init -o "$scratch/e.yaml" >/dev/null || fail "first init failed"
    echo "# mine" >"$scratch/e.yaml"
    "$dtrain" init -o "$scratch/e.yaml" >/dev/null 2>"$scratch/err"
    rc=$?
    [ "$rc" -eq 2 ] || fail "exit $rc over an existing file, wanted 2"
    grep -q 'e.yaml exists.*--force' "$scratch/err" || fail "message: $(cat "$scratch/err")"
    [ "$(cat "$scratch/e.yaml")" = "# mine" ] || fail "the existing file was changed"
    "$dtrain" init -o "$scratch/e.yaml" --force >/dev/null || fail "--force failed"
    grep -q '^name: e' "$scratch/e.yaml" || fail "--force did not replace the file"
    "$dtrain" init --strategy tpu >/dev/null 2>&1
    [ $? -eq 2 ] || fail "an unknown strategy is not exit 2"
    ;;
  plot)
    "$dtrain" run "$small" "${short[@]}" --set train.progress=none --run-dir "$scratch/a" >/dev/null || fail "run a failed"
    "$dtrain" run "$small" "${short[@]}" --set train.progress=none --set data.validation_split=0.2 \
      --set optimizer.learning_rate=0.003 --run-dir "$scratch/b" >/dev/null || fail "run b failed"
    "$dtrain" plot "$scratch/a" -o "$scratch/one.png" 2>"$scratch/err" || fail "plot of one run failed"
    is_png "$scratch/one.png" || fail "one.png is not a PNG"
    [ ! -s "$scratch/err" ] || fail "plot to one.png said: $(cat "$scratch/err")"
    "$dtrain" plot "$scratch/a" -o "$scratch/one.jpg" >/dev/null 2>"$scratch/err" || fail "plot to one.jpg failed"
    grep -q "warning: -o $scratch/one.jpg: dtrain plot writes a PNG image" "$scratch/err" || fail "no warning for .jpg: $(cat "$scratch/err")"
    "$dtrain" plot "$scratch/a" "$scratch/b" -o "$scratch/two.png" || fail "plot of two runs failed"
    is_png "$scratch/two.png" || fail "two.png is not a PNG"
    "$dtrain" plot "$scratch/a" >/dev/null || fail "plot without -o failed"
    is_png "$scratch/a/curves.png" || fail "no RUN_DIR/curves.png by default"
    ls "$scratch" "$scratch/a" | grep -q partial && fail "a temporary file was left behind"
    ;;
  plot_errors)
    mkdir -p "$scratch/empty"
    "$dtrain" plot "$scratch/empty" -o "$scratch/x.png" 2>"$scratch/err"
    rc=$?
    [ "$rc" -eq 2 ] || fail "exit $rc for a directory without metrics.jsonl, wanted 2"
    grep -q "$scratch/empty: no metrics.jsonl" "$scratch/err" || fail "message: $(cat "$scratch/err")"
    mkdir -p "$scratch/run" "$scratch/nobin"
    echo '{"epoch": 1, "global_step": 3, "loss": 2.1, "train_samples_per_s": 100.0}' >"$scratch/run/metrics.jsonl"
    PATH="$scratch/nobin" "$dtrain" plot "$scratch/run" -o "$scratch/x.png" 2>"$scratch/err"
    rc=$?
    [ "$rc" -eq 2 ] || fail "exit $rc without gnuplot, wanted 2"
    grep -q 'gnuplot is not installed; run tools/setup' "$scratch/err" || fail "message: $(cat "$scratch/err")"
    [ -e "$scratch/x.png" ] && fail "a picture was written without gnuplot"
    # An empty log, a directory in its place and an epoch out of range: exit 2, one line naming
    # the file (and the line), never SIGFPE nor gnuplot's own complaint.
    check_refused() {  # what, expected text
      local rc
      "$dtrain" plot "$scratch/bad" -o "$scratch/x.png" 2>"$scratch/err"
      rc=$?
      [ "$rc" -eq 2 ] || fail "$1: exit $rc, wanted 2 ($(cat "$scratch/err"))"
      [ "$(wc -l <"$scratch/err")" -eq 1 ] || fail "$1: wanted one line: $(cat "$scratch/err")"
      grep -qF "$2" "$scratch/err" || fail "$1: message: $(cat "$scratch/err")"
    }
    mkdir -p "$scratch/bad"
    : >"$scratch/bad/metrics.jsonl"
    check_refused "empty metrics.jsonl" "$scratch/bad/metrics.jsonl: holds no epoch record"
    for epoch in 9223372036854775807 -5; do
      printf '{"epoch": %s, "global_step": 3, "loss": 2.1}\n' "$epoch" >"$scratch/bad/metrics.jsonl"
      check_refused "epoch $epoch" "$scratch/bad/metrics.jsonl:1: epoch"
    done
    rm "$scratch/bad/metrics.jsonl" && mkdir "$scratch/bad/metrics.jsonl"
    check_refused "a directory as metrics.jsonl" "$scratch/bad/metrics.jsonl: is a directory"
    ;;
  train_plot)
    "$dtrain" run "$small" "${short[@]}" --set train.progress=none --set train.plot=true --run-dir "$scratch/run" \
      >/dev/null || fail "run with train.plot failed"
    is_png "$scratch/run/curves.png" || fail "no curves.png after the run"
    # Without gnuplot the run still succeeds, with one warning.
    PATH="$scratch/nobin" "$dtrain" run "$small" "${short[@]}" --set train.progress=none --set train.plot=true \
      --run-dir "$scratch/run2" >"$scratch/out" 2>"$scratch/err" || fail "a plot failure failed the run"
    [ "$(grep -c 'warning: train.plot' "$scratch/err")" -eq 1 ] || fail "wanted one warning: $(cat "$scratch/err")"
    [ "$(grep -c '^Epoch' "$scratch/out")" -eq 2 ] || fail "the run did not finish its epochs"
    ;;
  *) fail "unknown case" ;;
esac
echo "ok [$case_name]"
