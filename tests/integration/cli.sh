#!/usr/bin/env bash
# Integration checks of the dtrain CLI, run by CTest from the source directory:
#   tests/integration/cli.sh CASE DTRAIN_BINARY SCRATCH_DIR
# Each case exits non-zero with a message saying what differed.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh" "$@"

# expect_error CODE REGEX -- ARGS...: runs dtrain, wants exit CODE and exactly one stderr line
# matching REGEX, and no crash.
expect_error() {
  local code=$1 regex=$2; shift 3
  "$dtrain" "$@" >"$scratch/out" 2>"$scratch/err"
  local rc=$?
  cat "$scratch/err"
  [ "$rc" -eq "$code" ] || fail "exit code $rc, wanted $code, for: $*"
  [ "$(wc -l <"$scratch/err")" -eq 1 ] || fail "wanted a one-line error, got: $(cat "$scratch/err")"
  grep -Eq -- "$regex" "$scratch/err" || fail "error does not match /$regex/: $(cat "$scratch/err")"
}

# What `dtrain run` of a gpu:N says where the machine lacks that GPU: the device and how many GPUs
# the machine has where the build has what the run needs ($1, a line of `dtrain info`), else $2.
refusal_without_gpu() {
  if "$dtrain" info | grep -q "$1"; then
    echo "device gpu:[0-9]+: this machine has [0-9]+ CUDA devices?.*; use one of those or cpu:N devices"
  else
    echo "$2"
  fi
}

# A tiny MNIST-style IDX directory: 10 images of 28x28 and labels 0..9, uncompressed.
make_idx_dir() {
  local dir=$1
  mkdir -p "$dir"
  for prefix in train t10k; do
    { printf '\x00\x00\x08\x03\x00\x00\x00\x0a\x00\x00\x00\x1c\x00\x00\x00\x1c'; head -c 7840 /dev/zero; } >"$dir/$prefix-images-idx3-ubyte"
    { printf '\x00\x00\x08\x01\x00\x00\x00\x0a'; printf '\x00\x01\x02\x03\x04\x05\x06\x07\x08\x09'; } >"$dir/$prefix-labels-idx1-ubyte"
  done
}

# make_memory_cgroup BYTES: a new memory cgroup limited to BYTES (v1, or v2 where the memory
# controller is delegated), its directory on stdout, and $scratch/in_cgroup.sh, which runs dtrain
# inside it; non-zero (saying why on stdout) where this machine lets the test make none.
make_memory_cgroup() {
  local bytes=$1 dir limit_file
  if [ -w /sys/fs/cgroup/memory ] && [ -e /sys/fs/cgroup/memory/memory.limit_in_bytes ]; then
    dir=/sys/fs/cgroup/memory/dtrain_test_$$ limit_file=memory.limit_in_bytes
  elif [ -w /sys/fs/cgroup ] && grep -qw memory /sys/fs/cgroup/cgroup.subtree_control 2>/dev/null; then
    dir=/sys/fs/cgroup/dtrain_test_$$ limit_file=memory.max
  else
    echo "no writable memory controller"; return 1
  fi
  mkdir -p "$dir" 2>/dev/null && echo "$bytes" >"$dir/$limit_file" 2>/dev/null || { echo "cannot make $dir"; return 1; }
  printf '#!/usr/bin/env bash\necho $$ >%q/cgroup.procs || exit 99\nexec %q "$@"\n' "$dir" "$dtrain" >"$scratch/in_cgroup.sh"
  chmod +x "$scratch/in_cgroup.sh"
  echo "$dir"
}

small=experiments/fashion_mnist_small.yaml
epoch_re='^Epoch [0-9]+, Loss: [0-9]+\.[0-9]{4}, Accuracy: [0-9]+\.[0-9]{2}, Test Loss: [0-9]+\.[0-9]{4}, Test Accuracy: [0-9]+\.[0-9]{2}$'

case "$case_name" in
  help)
    "$dtrain" --help >"$scratch/out" || fail "--help exited non-zero"
    grep -q "Examples:" "$scratch/out" || fail "--help shows no examples"
    grep -q "Exit codes" "$scratch/out" || fail "--help does not document exit codes"
    "$dtrain" --version | grep -Eq '^dtrain [0-9]+\.[0-9]+\.[0-9]+$' || fail "--version"
    expect_error 2 "" -- frobnicate
    ;;
  info)
    "$dtrain" info >"$scratch/out" || fail "info exited non-zero"
    cat "$scratch/out"
    for what in oneDNN "CPU ISA" threads MPI CUDA NCCL HDF5; do grep -q "$what" "$scratch/out" || fail "info lacks $what"; done
    ;;
  validate)
    "$dtrain" validate experiments/fashion_mnist.yaml --set train.epochs=3 >"$scratch/out" || fail "validate failed"
    grep -q "epochs: 3" "$scratch/out" || fail "validate did not apply --set"
    grep -q "Total params: 121930" "$scratch/out" || fail "seed CNN should have 121930 parameters"
    # The resolved config is itself a valid experiment.
    "$dtrain" validate "$scratch/out" >/dev/null || fail "resolved config does not validate"
    ;;
  train_small)
    "$dtrain" run "$small" --set train.epochs=2 --run-dir "$scratch/run" >"$scratch/out" || fail "run failed"
    cat "$scratch/out"
    grep -Eq '^dtrain .* \| experiment fashion_mnist_small \| strategy default \| replicas 1 .* \| global batch 64 \| learning rate 0.001 \| threads [0-9]+( \([^)]*\))? \| oneDNN .* isa ' "$scratch/out" \
      || fail "header line"
    [ "$(grep -Ec "$epoch_re" "$scratch/out")" -eq 2 ] || fail "wanted 2 epoch lines in the template's layout"
    grep -Eq '^  train [0-9.]+ samples/s' "$scratch/out" || fail "no samples/s line"
    [ "$(wc -l <"$scratch/run/metrics.jsonl")" -eq 2 ] || fail "metrics.jsonl should have one line per epoch"
    grep -q '"test_accuracy"' "$scratch/run/metrics.jsonl" || fail "metrics.jsonl lacks test_accuracy"
    "$dtrain" validate "$scratch/run/config.yaml" >/dev/null || fail "run dir config.yaml does not validate"
    # Learning happens: test accuracy after 2 epochs on 2,000 images is far above chance (10 %).
    acc=$(grep -E "^Epoch 2," "$scratch/out" | sed -E 's/.*Test Accuracy: ([0-9.]+)/\1/')
    awk -v a="$acc" 'BEGIN { exit !(a > 60) }' || fail "test accuracy $acc after 2 epochs"
    ;;
  validation_split)
    "$dtrain" run "$small" --set train.epochs=1 --set data.validation_split=0.25 --run-dir "$scratch/run" >"$scratch/out" || fail "run failed"
    cat "$scratch/out"
    grep -Eq '^Epoch 1, Loss: [0-9.]+, Accuracy: [0-9.]+, Validation Loss: [0-9.]+, Validation Accuracy: [0-9.]+, Test Loss: [0-9.]+, Test Accuracy: [0-9.]+$' "$scratch/out" \
      || fail "validation figures missing from the epoch line"
    grep -q '(24 steps' "$scratch/out" || fail "1500 training samples at batch 64 make 24 steps"
    # More steps than one pass makes are cut to it, with a warning.
    "$dtrain" run "$small" --set train.epochs=1 --set data.validation_split=0.25 --set train.steps_per_epoch=100 \
      --set train.progress=none --run-dir "$scratch/long" >"$scratch/out" 2>"$scratch/err" || fail "run failed"
    grep -q '(24 steps' "$scratch/out" || fail "steps_per_epoch 100 did not train the 24 steps of one pass"
    grep -q "warning: --set train.steps_per_epoch=100: train.steps_per_epoch 100 is more than the 24 steps of one pass over the 1500 training samples" \
      "$scratch/err" || fail "no warning for steps_per_epoch past the data: $(cat "$scratch/err")"
    ;;
  deterministic)
    for i in 1 2; do
      "$dtrain" run "$small" --set train.epochs=2 --set train.threads=2 --run-dir "$scratch/run$i" | grep '^Epoch' >"$scratch/epochs$i" \
        || fail "run $i failed"
    done
    cat "$scratch/epochs1"
    diff "$scratch/epochs1" "$scratch/epochs2" || fail "the same seed printed different numbers"
    "$dtrain" run "$small" --set train.epochs=1 --set train.threads=2 --set seed=7 --run-dir "$scratch/run3" | grep '^Epoch' >"$scratch/epochs3"
    ! diff -q <(head -1 "$scratch/epochs1") "$scratch/epochs3" >/dev/null || fail "another seed printed the same numbers"
    ;;
  order)
    # dtrain order: the training order per epoch as .npy, read by numpy (TensorFlow follows it in
    # tests/anchors, step for step); file order without a shuffle; the held-out split left out.
    "$dtrain" order "$small" --epochs 3 -o "$scratch/order.npy" >"$scratch/out" || fail "dtrain order failed: $(cat "$scratch/out")"
    grep -q "^Wrote the training order of $small to $scratch/order.npy: 3 epochs x 2000 samples" "$scratch/out" \
      || fail "order printed $(cat "$scratch/out")"
    "$dtrain" order "$small" --epochs 1 --set data.shuffle_buffer=0 --set data.validation_split=0.25 \
      -o "$scratch/plain.npy" >/dev/null || fail "dtrain order without a shuffle failed"
    /usr/bin/python3 - "$scratch/order.npy" "$scratch/plain.npy" <<'PY' || fail "the order files are not what they should be"
import sys, numpy as np
order, plain = np.load(sys.argv[1]), np.load(sys.argv[2])
assert order.dtype == np.int64 and order.shape == (3, 2000), (order.dtype, order.shape)
assert all(np.array_equal(np.sort(row), np.arange(2000)) for row in order), "an epoch is not a permutation"
assert not np.array_equal(order[0], order[1]) and not np.array_equal(order[0], np.arange(2000)), "no shuffle"
assert plain.shape == (1, 1500) and np.array_equal(plain[0], np.arange(1500)), plain[0][:10]
print("3 shuffled epochs of 2000 and file order of 1500")
PY
    expect_error 3 "order.npy" -- order "$small" -o /proc/order.npy
    # An empty training split has no order: refused at data.path, as run refuses it, no file written.
    /usr/bin/python3 - "$scratch/empty.h5" <<'PY' || fail "cannot write the empty split"
import sys, h5py, numpy as np
with h5py.File(sys.argv[1], "w") as f:
    for split, n in (("train", 0), ("test", 3)):
        f.create_dataset(f"{split}/x", data=np.zeros((n, 28, 28, 1), np.uint8))
        f.create_dataset(f"{split}/y", data=np.zeros((n,), np.int32))
PY
    for output in "-o $scratch/empty.npy" "--run-dir $scratch/empty_run"; do
      expect_error 2 "^dtrain: error: --set data\.path=$scratch/empty\.h5: the training split is empty" -- \
        $([ "${output:0:2}" = -o ] && echo order || echo run) "$small" --set "data.path=$scratch/empty.h5" $output
    done
    [ ! -e "$scratch/empty.npy" ] || fail "an order file was written for an empty training split"
    expect_error 2 "epochs" -- order "$small" --epochs 0 -o "$scratch/x.npy"
    ;;
  regression_toy)
    "$dtrain" run experiments/regression_toy.yaml --run-dir "$scratch/run" >"$scratch/out" || fail "run failed"
    cat "$scratch/out"
    # First step by hand: w = kernel, b = 0, prediction w*1, loss (1-w)^2 + 1e-4 w^2: the epoch
    # loss must fall monotonically towards 0.
    awk -F'Loss: ' '/^Epoch/ { split($2, a, ","); l = a[1] + 0; if (NR > 2 && l >= prev) bad = 1; prev = l } END { exit bad || prev > 0.01 }' "$scratch/out" \
      || fail "loss does not fall to < 0.01"
    ;;
  bad_unknown_key)
    sed 's/^  epochs: 10/  epoch: 10/' experiments/fashion_mnist.yaml >"$scratch/exp.yaml"
    expect_error 2 "exp\.yaml:[0-9]+:[0-9]+: .*unknown key 'epoch'.*did you mean 'epochs'" -- run "$scratch/exp.yaml"
    ;;
  bad_type)
    sed 's/^  epochs: 10/  epochs: ten/' experiments/fashion_mnist.yaml >"$scratch/exp.yaml"
    expect_error 2 "exp\.yaml:[0-9]+:[0-9]+: .*epochs.*integer" -- run "$scratch/exp.yaml"
    expect_error 2 "--set train.epochs=0" -- run experiments/fashion_mnist.yaml --set train.epochs=0
    expect_error 2 "no-such\.yaml" -- run "$scratch/no-such.yaml"
    ;;
  bad_data_dir)
    expect_error 2 "/nonexistent/fmnist.*(no such|not found|does not exist)" -- run experiments/fashion_mnist.yaml --set data.path=/nonexistent/fmnist --run-dir "$scratch/run"
    ;;
  bad_idx_truncated)
    make_idx_dir "$scratch/idx"
    "$dtrain" run experiments/fashion_mnist.yaml --set data.source=idx --set data.path="$scratch/idx" --set train.epochs=1 \
      --set data.shuffle_buffer=10 --run-dir "$scratch/ok" >/dev/null || fail "the valid tiny IDX set does not train"
    head -c 5000 "$scratch/idx/train-images-idx3-ubyte" >"$scratch/cut" && mv "$scratch/cut" "$scratch/idx/train-images-idx3-ubyte"
    expect_error 2 "train-images-idx3-ubyte.*truncated" -- run experiments/fashion_mnist.yaml --set data.source=idx --set data.path="$scratch/idx" --run-dir "$scratch/run"
    ;;
  bad_idx_magic)
    make_idx_dir "$scratch/idx"
    printf '\x12\x34\x08\x03' | dd of="$scratch/idx/t10k-images-idx3-ubyte" conv=notrunc bs=1 count=4 2>/dev/null
    expect_error 2 "t10k-images-idx3-ubyte.*magic" -- run experiments/fashion_mnist.yaml --set data.source=idx --set data.path="$scratch/idx" --run-dir "$scratch/run"
    ;;
  bad_hdf5)
    head -c 100000 data/fashion_mnist_small.h5 >"$scratch/cut.h5"
    expect_error 2 "cut\.h5" -- run "$small" --set data.path="$scratch/cut.h5" --run-dir "$scratch/run"
    # Errors of the data are located at the key that chose the file (here data.path, line 10) and
    # name the file: an empty /train, labels of one dtype for /train and another for /test.
    /usr/bin/python3 - "$scratch" <<'EOF' || fail "cannot write the HDF5 files"
import sys, h5py, numpy as np
for name, n_train, test_y in (("empty", 0, np.zeros(5, np.int32)), ("mixed", 5, np.zeros(5, np.float32))):
    with h5py.File(f"{sys.argv[1]}/{name}.h5", "w") as f:
        f["train/x"], f["train/y"] = np.zeros((n_train, 28, 28, 1), np.float32), np.zeros(n_train, np.int32)
        f["test/x"], f["test/y"] = np.zeros((5, 28, 28, 1), np.float32), test_y
EOF
    for name in empty mixed; do
      sed "s|^  path: .*|  path: $scratch/$name.h5|" "$small" >"$scratch/$name.yaml"
    done
    expect_error 2 "empty\.yaml:10:9: the training split is empty \(HDF5 /train: 0 examples.*empty\.h5\)" -- \
      run "$scratch/empty.yaml" --run-dir "$scratch/run"
    expect_error 2 "mixed\.yaml:10:9: train targets are i32 \(\) but test targets are f32 .*mixed\.h5" -- \
      run "$scratch/mixed.yaml" --run-dir "$scratch/run"
    # A path of blanks, or one that starts with ~ (which only a shell expands), is refused by validate.
    expect_error 2 "^dtrain: error: --set data.path=' ': data.path: must be a path, not only blanks" -- \
      validate "$small" --set "data.path=' '"
    sed 's|^  path: .*|  path: ~/fashion_mnist_small.h5|' "$small" >"$scratch/home.yaml"
    expect_error 2 "home\.yaml:10:9: data.path: must be a path dtrain can open: it does not expand '~'" -- \
      validate "$scratch/home.yaml"
    ;;
  bn_first_short_batch)
    # Synchronized batch normalization as the first layer (no input gradient, so no backward
    # collective) and a last batch of 2 over 3 replicas: the replica without samples must make
    # the same collectives as the others (it made one more, and the ring refused the mismatch).
    cat >"$scratch/bn_first.yaml" <<'YAML'
name: bn_first
seed: 3
strategy: {kind: mirrored, devices: [cpu:0, cpu:1, cpu:2]}
data: {source: hdf5, path: data/fashion_mnist_small.h5, batch_size_per_replica: 37, shuffle_buffer: 0}
model:
  input_shape: [28, 28, 1]
  layers:
    - batch_normalization: {synchronized: true}
    - flatten: {}
    - dense: {units: 10}
loss: {kind: sparse_categorical_crossentropy, from_logits: true, reduction: none}
optimizer: {kind: sgd, learning_rate: 0.01}
metrics: [accuracy]
train: {epochs: 1}
YAML
    "$dtrain" run "$scratch/bn_first.yaml" --run-dir "$scratch/run" >"$scratch/out" 2>&1 || { cat "$scratch/out" >&2; fail "the run failed"; }
    grep -q "^Epoch 1," "$scratch/out" || fail "no epoch line"
    ;;
  limits)
    # Sizes, counts and thread numbers the machine or the types cannot hold are refused by validate
    # (exit 2, one line, file:line:column of the key), never a crash, an overflow or a hang.
    v=(validate "$small")
    expect_error 2 "--set train.threads=100000: .*at most [0-9]+" -- "${v[@]}" --set train.threads=100000
    expect_error 2 "--set train.threads=2147483647: .*at most" -- "${v[@]}" --set train.threads=2147483647
    sed 's/^  input_shape: .*/  input_shape: [28, 4294967296, 1]/' "$small" >"$scratch/wide.yaml"
    expect_error 2 "wide\.yaml:[0-9]+:[0-9]+: model\.input_shape: .*memory" -- validate "$scratch/wide.yaml"
    sed 's/^  input_shape: .*/  input_shape: [9223372036854775807, 28, 1]/' "$small" >"$scratch/huge.yaml"
    expect_error 2 "huge\.yaml:[0-9]+:[0-9]+: model\.input_shape: .*more than 8 EB" -- validate "$scratch/huge.yaml"
    sed 's/^  input_shape: .*/  input_shape: [1, 1, 1, 1, 1, 1, 1, 1]/' "$small" >"$scratch/rank.yaml"
    expect_error 2 "rank\.yaml:[0-9]+:[0-9]+: model\.input_shape: .*at most 7 dimensions" -- validate "$scratch/rank.yaml"
    for units in 1000000000 2147483647; do
      sed "s/^    - dense: {units: 64, activation: relu}/    - dense: {units: $units, activation: relu}/" "$small" >"$scratch/units.yaml"
      expect_error 2 "units\.yaml:22:7: layer 'dense'.*memory" -- validate "$scratch/units.yaml"
    done
    # A variable larger than memory with its slots is refused before it is allocated (it took
    # minutes to allocate and initialize, then failed): within seconds.
    SECONDS=0
    expect_error 2 "regression_toy\\.yaml:18:7: layer 'dense': variable 'kernel' of shape \\(1, 2147483647\\) needs" -- \
      validate experiments/regression_toy.yaml --set model.layers.0.dense.units=2147483647
    [ "$SECONDS" -le 10 ] || fail "a variable too large for memory took ${SECONDS}s to refuse"
    sed 's/^    - conv2d: {filters: 32,/    - conv2d: {filters: 10000000,/' "$small" >"$scratch/filters.yaml"
    expect_error 2 "filters\.yaml(:17:7: layer 'conv2d'|:11:27: data.batch_size_per_replica).*memory" -- validate "$scratch/filters.yaml"
    # Memory a batch decides: named at both keys that decide it, the batch's (in the file or its
    # --set) and the layer whose outputs take the most, with the option that sizes them.
    sed 's/^    - conv2d: {filters: 32,/    - conv2d: {filters: 1000000,/' "$small" >"$scratch/filters.yaml"
    both="filters\.yaml:11:27: data\.batch_size_per_replica 64: .*memory; layer 'conv2d' \([^ ]*filters\.yaml:17:7\) takes the most.*fewer filters"
    expect_error 2 "$both" -- validate "$scratch/filters.yaml"
    expect_error 2 "$both" -- run "$scratch/filters.yaml" --run-dir "$scratch/filters_run"
    [ ! -e "$scratch/filters_run" ] || fail "the run wrote its directory before refusing the batch"
    # The whole run's memory from the declared shapes, before anything is allocated: a dense layer
    # each of whose copies fits (16 bytes a parameter: value, gradient, Adam's two slots) but whose
    # two lanes' copies and slots (24 bytes a parameter) do not, whatever this machine's memory.
    memory_kb=$(awk '/^MemTotal:/ {print $2}' /proc/meminfo)
    units=$((memory_kb * 1024 / 20 / 1600))  # 1600 inputs: the small CNN's flattened (5, 5, 64)
    sed "s/^    - dense: {units: 64, activation: relu}/    - dense: {units: $units, activation: relu}/" "$small" >"$scratch/lanes.yaml"
    SECONDS=0
    lanes=(--set train.threads=2 --set train.parallelism=batch)
    refused="lanes\.yaml:22:7: layer 'dense': this run needs about .* more than (this machine's|the .* memory limit of this process's cgroup).*: 2 copies of the model's .*; layer 'dense' holds the most parameters .*give it fewer units"
    expect_error 2 "$refused" -- validate "$scratch/lanes.yaml" "${lanes[@]}"
    expect_error 2 "$refused" -- run "$scratch/lanes.yaml" "${lanes[@]}" --run-dir "$scratch/lanes_run"
    [ "$SECONDS" -le 10 ] || fail "a run too large for memory took ${SECONDS}s to refuse"
    [ ! -e "$scratch/lanes_run" ] || fail "the run wrote its directory before refusing"
    # Under a container's memory limit (a cgroup's, here made by the test where it may make one), the
    # limit decides, and is named: each of this model's variables fits 512 MB (410 MB with its
    # gradient and slots), the run does not (two lanes' copies, the slots and a checkpoint's image:
    # about 1.2 GB), though this machine holds it.
    if cg=$(make_memory_cgroup $((512 << 20))); then
      sed "s/^    - dense: {units: 64, activation: relu}/    - dense: {units: 16000, activation: relu}/" "$small" >"$scratch/contained.yaml"
      contained="contained\.yaml:22:7: layer 'dense': this run needs about [0-9.]+ [MG]B of memory, more than the 512\.0 MB memory limit of this process's cgroup: 2 copies"
      outside=$dtrain
      dtrain=$scratch/in_cgroup.sh  # expect_error runs $dtrain: here the wrapper that enters the cgroup
      expect_error 2 "$contained" -- validate "$scratch/contained.yaml" "${lanes[@]}"
      SECONDS=0
      expect_error 2 "$contained" -- run "$scratch/contained.yaml" "${lanes[@]}" --run-dir "$scratch/contained_run"
      [ "$SECONDS" -le 10 ] || fail "a run too large for its cgroup took ${SECONDS}s to refuse"
      [ ! -e "$scratch/contained_run" ] || fail "the run wrote its directory before refusing"
      dtrain=$outside
      # The kernel lets go of a cgroup a moment after its last process has ended.
      for _ in $(seq 1 100); do rmdir "$cg" 2>/dev/null && break; sleep 0.05; done
    else
      echo "note: no memory cgroup could be made here ($cg); the cgroup limit case is skipped"
    fi
    # A stop signal while the model is being built ends the run there, exit 4, nothing saved: the
    # run holds before building its model (DTRAIN_TEST_HOLD_AT_STEP=0) until the signal.
    hold_env "$scratch/build_hold" 0
    env "${hold[@]}" "$dtrain" run "$small" --run-dir "$scratch/stopped_run" >/dev/null 2>"$scratch/stopped.err" &
    pid=$!
    wait_held "$scratch/build_hold" 1 "$pid"
    kill -TERM "$pid"
    wait "$pid"
    rc=$?
    [ "$rc" -eq 4 ] || fail "SIGTERM while building the model: exit $rc, wanted 4: $(cat "$scratch/stopped.err")"
    grep -q "^dtrain: error: stopped by a signal while the model's variables were made (layer 'conv2d'), before the first step: nothing was trained or saved" \
      "$scratch/stopped.err" || fail "no clear line for the stop while building: $(cat "$scratch/stopped.err")"
    [ ! -e "$scratch/stopped_run/checkpoints" ] || fail "a run stopped before its first step made checkpoints"
    printf '%s\n' 'model: {input_shape: [28, 28, 1], layers: [{flatten: {}}, {dense: {units: 10}}]}' \
      'data: {source: synthetic}' 'loss: {kind: sparse_categorical_crossentropy, from_logits: true}' >"$scratch/syn.yaml"
    expect_error 2 "--set data.train_size=1000000000: data\.train_size: .*memory" -- \
      validate "$scratch/syn.yaml" --set data.train_size=1000000000
    expect_error 2 "--set data\.batch_size_per_replica=9223372036854775807: data\.batch_size_per_replica 9223372036854775807: .*memory" -- \
      validate "$small" --set data.batch_size_per_replica=9223372036854775807
    expect_error 2 "--set data.test_size=0: .*>= 1" -- validate "$scratch/syn.yaml" --set data.test_size=0
    # A layer that does not fit its input is reported at the layer.
    sed 's/^    - conv2d: {filters: 32, kernel_size: 3,/    - conv2d: {filters: 32, kernel_size: 30,/' "$small" >"$scratch/kernel.yaml"
    expect_error 2 "kernel\.yaml:17:7: layer 'conv2d': kernel 30x30 does not fit" -- validate "$scratch/kernel.yaml"
    # A loss the last layer cannot feed is refused by validate, at the loss.
    expect_error 2 "fashion_mnist_small\.yaml:[0-9]+:[0-9]+: loss binary_crossentropy .* gives 10" -- \
      "${v[@]}" --set loss.kind=binary_crossentropy --set data.source=fashion_mnist
    # With hdf5 the labels are known once loaded: run refuses it at start, before training.
    expect_error 2 "fashion_mnist_small\\.yaml:[0-9]+:[0-9]+: loss binary_crossentropy .* gives 10" -- \
      run "$small" --set loss.kind=binary_crossentropy --run-dir "$scratch/binary"
    [ ! -e "$scratch/binary/metrics.jsonl" ] || fail "binary_crossentropy with 10 units trained before it was refused"
    expect_error 2 "syn\.yaml:3:1: loss sparse_categorical_crossentropy needs one output per class: .* has 10 classes" -- \
      validate "$scratch/syn.yaml" --set model.layers.1.dense.units=5
    # An empty experiment is the file's fault, not the --set's.
    : >"$scratch/empty.yaml"
    expect_error 2 "^dtrain: error: [^ ]*empty\.yaml:1:1: missing required key 'model'" -- \
      validate "$scratch/empty.yaml" --set train.epochs=1
    # So is a top level that is not a map, whatever a --set then looks for in it.
    printf '%s\n' '- a' '- b' >"$scratch/list.yaml"
    expect_error 2 "^dtrain: error: [^ ]*list\.yaml:1:1: expected a map of settings at the top level .*got a list" -- \
      validate "$scratch/list.yaml" --set train.epochs=1
    # Errors found once the data is loaded are located at the key that decides them.
    expect_error 2 "^dtrain: error: --set model\.input_shape=\[28,28\]: model\.input_shape \(28, 28\) does not match" -- \
      run "$small" --set 'model.input_shape=[28,28]' --set 'model.layers=[{flatten: {}}, {dense: {units: 10}}]' \
      --run-dir "$scratch/shape"
    expect_error 2 "^dtrain: error: --set data\.validation_split=0\.9999: data\.validation_split 0\.9999 of 2000 training examples leaves 0" -- \
      run "$small" --set data.validation_split=0.9999 --run-dir "$scratch/split"
    # Per-replica pipelines cannot split a remainder: refused by validate and run, at the batch key.
    for command in validate run; do
      expect_error 2 "^dtrain: error: --set data\.global_batch_size=7: the global batch size 7 does not divide among 2 replicas" -- \
        $command "$small" --set data.batch_size_per_replica=null --set data.global_batch_size=7 --set data.distribute=per_replica \
        --set "strategy={kind: mirrored, devices: [cpu:0, cpu:1]}" $([ $command = run ] && echo --run-dir "$scratch/per_replica")
      [ ! -e "$scratch/per_replica" ] || fail "the refused per_replica run made its run directory"
    done
    # Billion laughs: ten levels of aliases expand past the budget at once.
    { echo 'a: &a [x, x, x, x, x, x, x, x, x]'
      prev=a
      for l in b c d e f g h i j; do
        printf '%s: &%s [*%s, *%s, *%s, *%s, *%s, *%s, *%s, *%s, *%s]\n' $l $l $prev $prev $prev $prev $prev $prev $prev $prev $prev
        prev=$l
      done; } >"$scratch/laughs.yaml"
    expect_error 2 "laughs\.yaml:[0-9]+:[0-9]+: YAML aliases expand to more than" -- validate "$scratch/laughs.yaml"
    # Integer overflow in batch sizes (UBSan found these): a huge batch is one batch of everything.
    "$dtrain" run "$small" --set train.epochs=1 --set train.steps_per_epoch=1 --set train.threads=1 --set train.progress=none \
      --set data.eval_batch_size=9223372036854775807 --run-dir "$scratch/eval_batch" >"$scratch/out" 2>&1 \
      || fail "a huge eval_batch_size failed: $(tail -3 "$scratch/out")"
    grep -q '"test_samples": 500,' "$scratch/eval_batch/metrics.jsonl" || fail "the huge eval batch did not evaluate the 500 test samples"
    expect_error 2 "error: --set data\.batch_size_per_replica=4611686018427387904: data\.batch_size_per_replica 4611686018427387904 times 2 replicas" -- run "$small" --set train.epochs=1 \
      --set data.batch_size_per_replica=4611686018427387904 --set "strategy={kind: mirrored, devices: [cpu:0, cpu:1]}" \
      --run-dir "$scratch/overflow"
    ;;
  experiments_validate)
    bf16=yes
    "$dtrain" info | grep -q "^precision mixed_bfloat16: available" || bf16=no
    for exp in experiments/*.yaml; do
      if [ "$bf16" = no ] && grep -q '^precision: mixed_bfloat16' "$exp"; then
        # Refused on this CPU, as it should be: exit 2 at the precision key.
        "$dtrain" validate "$exp" >/dev/null 2>&1
        [ $? -eq 2 ] || fail "$exp: mixed_bfloat16 on a CPU without bfloat16 is not exit 2"
        continue
      fi
      "$dtrain" validate "$exp" >/dev/null || fail "$exp does not validate"
    done
    ;;
  train_mirrored)
    "$dtrain" run experiments/fashion_mnist_mirrored.yaml --set data.source=hdf5 --set data.path=data/fashion_mnist_small.h5 \
      --set data.shuffle_buffer=2000 --set train.epochs=2 --run-dir "$scratch/run" >"$scratch/out" || fail "run failed"
    cat "$scratch/out"
    grep -Eq '\| strategy mirrored \| replicas 2 \(cpu:0, cpu:1\) \| cross-device ops ring \| global batch 128 \|' "$scratch/out" \
      || fail "header does not name the strategy, its devices, the cross-device op and the global batch"
    grep -q '^cross_device_ops: auto chose ring' "$scratch/out" || fail "auto does not say what it chose"
    [ "$(grep -Ec "$epoch_re" "$scratch/out")" -eq 2 ] || fail "wanted 2 epoch lines"
    "$dtrain" run experiments/fashion_mnist_central_storage.yaml --set data.source=hdf5 --set data.path=data/fashion_mnist_small.h5 \
      --set data.shuffle_buffer=2000 --set train.epochs=1 --run-dir "$scratch/run2" >"$scratch/out2" || fail "central storage run failed"
    grep -q '| strategy central_storage | replicas 2 (cpu:0, cpu:1) | cross-device ops reduction_to_one_device |' "$scratch/out2" \
      || fail "central storage header"
    ;;
  refused_reduction)
    expect_error 2 "refused under strategy 'mirrored'.*reduction: none" -- run experiments/fashion_mnist_mirrored.yaml --set loss.reduction=auto
    expect_error 2 "sum_over_batch_size' is refused under strategy 'one_device'" -- run experiments/fashion_mnist.yaml --set strategy.kind=one_device --set loss.reduction=sum_over_batch_size
    sed 's/reduction: none/reduction: auto/' experiments/fashion_mnist_central_storage.yaml >"$scratch/exp.yaml"
    expect_error 2 "exp\.yaml:[0-9]+:[0-9]+: loss.reduction 'auto' is refused under strategy 'central_storage'" -- run "$scratch/exp.yaml"
    ;;
  rerun_refused)
    # A second run never touches the first run's files: without --run-dir it goes to the next
    # runs/<name>-N; into a --run-dir that holds a run it is refused; --overwrite replaces on request.
    cp "$small" "$scratch/exp.yaml"
    sed -i 's|^name: .*|name: rerun_refused_test|; s|path: data/|path: '"$PWD"'/data/|' "$scratch/exp.yaml"
    quick=(--set train.epochs=1 --set train.steps_per_epoch=3 --set train.progress=none)
    first="$scratch/runs/rerun_refused_test"
    (cd "$scratch" && "$dtrain" run exp.yaml "${quick[@]}" >/dev/null) || fail "first run failed"
    [ -f "$first/checkpoints/ckpt-3.h5" ] || fail "the first run left no checkpoint"
    sums() { (cd "$first" && find . -type f | sort | xargs sha256sum); }
    sums >"$scratch/before"
    (cd "$scratch" && "$dtrain" run exp.yaml "${quick[@]}" --set optimizer.learning_rate=0.01 >"$scratch/second.out") \
      || fail "second run failed"
    grep -qx "runs/rerun_refused_test holds an earlier run; this run writes into runs/rerun_refused_test-2" \
      "$scratch/second.out" || fail "the second run did not say where it wrote: $(head -2 "$scratch/second.out")"
    [ -f "$first-2/checkpoints/ckpt-3.h5" ] || fail "the second run did not write runs/rerun_refused_test-2"
    sums | diff "$scratch/before" - || fail "the second run changed the first run's files"
    expect_error 2 "$first already holds a run \(.*config.yaml.*\); a new run would overwrite it: give another \
--run-dir to keep it, \`dtrain resume $first\` to continue it, or --overwrite to replace it" -- \
      run "$small" "${quick[@]}" --run-dir "$first"
    sums | diff "$scratch/before" - || fail "the refused --run-dir run changed the first run's files"
    "$dtrain" run "$small" "${quick[@]}" --set optimizer.learning_rate=0.01 --run-dir "$first" --overwrite >/dev/null \
      || fail "--overwrite failed"
    ! sums | diff -q "$scratch/before" - >/dev/null || fail "--overwrite left the first run's files as they were"
    [ "$(wc -l <"$first/metrics.jsonl")" -eq 1 ] || fail "--overwrite appended to the old log"
    # A name is not a path: it would put the run directory outside runs/.
    sed 's|^name: .*|name: ../escape|' "$scratch/exp.yaml" >"$scratch/escape.yaml"
    expect_error 2 "escape.yaml:[0-9]+:7: name: must be a name, not a path" -- validate "$scratch/escape.yaml"
    expect_error 2 "^dtrain: error: --set name=\.\.: name: must be a name, not a path" -- \
      validate "$scratch/exp.yaml" --set 'name=..'
    # Nor one too long for a directory: validate refuses it at its place, in one short line, rather
    # than run failing to create runs/<name> (exit 3, the whole name in the message).
    { printf 'name: %s\n' "$(head -c 100000 /dev/zero | tr '\0' n)"; grep -v '^name:' "$scratch/exp.yaml"; } \
      >"$scratch/long.yaml"
    expect_error 2 "long.yaml:1:7: name: must be at most 200 bytes .*\(100000 bytes\)$" -- validate "$scratch/long.yaml"
    [ "$(wc -c <"$scratch/err")" -lt 400 ] || fail "the error repeats the long name"
    ;;
  gpu_refused)
    # A gpu:N device this machine lacks is refused before any training, saying how many GPUs it
    # has (or that the build has no CUDA backend); the YAML location comes first.
    if nvidia-smi -L 2>/dev/null | grep -q "^GPU 0"; then
      echo "SKIP: this machine has a GPU"; exit 77
    fi
    why=$(refusal_without_gpu "^CUDA: built" "device gpu:0: this build of dtrain has no CUDA backend.*; use cpu:N devices")
    expect_error 2 "experiments/fashion_mnist_one_device.yaml:[0-9]+:[0-9]+: $why" -- \
      run experiments/fashion_mnist_one_device.yaml --set strategy.device=gpu:0 --run-dir "$scratch/run"
    [ ! -e "$scratch/run/metrics.jsonl" ] || fail "a refused device still started training"
    ;;
  cuda_on_demand)
    # The CUDA backend is a module loaded when something asks for a GPU: a CPU run maps none of
    # CUDA's libraries (the loader's own record of what it loaded, LD_DEBUG=files), a gpu:N device
    # loads the module, and a broken module beside dtrain stops the run in one line naming it.
    "$dtrain" info | grep -q "^CUDA: built" || { echo "SKIP: this build has no CUDA backend"; exit 77; }
    loaded() {  # the files the dynamic loader opened for: dtrain ARGS...
      rm -f "$scratch"/ld.*
      LD_DEBUG=files LD_DEBUG_OUTPUT="$scratch/ld" "$dtrain" "$@" >/dev/null 2>&1 || true
      cat "$scratch"/ld.* | grep -o 'file=[^ ]*' | sort -u
    }
    loaded --version >"$scratch/version"
    loaded run "$small" --set train.epochs=1 --run-dir "$scratch/cpu" >"$scratch/cpu_files"
    [ -s "$scratch/cpu/metrics.jsonl" ] || fail "the CPU run did not train"
    for f in version cpu_files; do
      grep -q "file=libdnnl" "$scratch/$f" || fail "LD_DEBUG recorded no libraries ($f): the check cannot see"
      ! grep -Eq "libdtrain_cuda|libcuda|libcublas|libcudnn|libnccl" "$scratch/$f" || fail "$f loaded CUDA: $(grep -E 'cud|nccl' "$scratch/$f")"
    done
    # (Where the machine has a GPU, that run trains: two steps.)
    loaded run experiments/fashion_mnist_one_device.yaml --set strategy.device=gpu:0 --set train.epochs=1 \
      --set train.steps_per_epoch=2 --run-dir "$scratch/gpu" >"$scratch/gpu_files"
    grep -q "libdtrain_cuda" "$scratch/gpu_files" || fail "a gpu:0 run did not load the CUDA backend module"
    grep -q "libcudart" "$scratch/gpu_files" || fail "the module loaded without the CUDA runtime"
    # A copy of dtrain looks beside itself first: there, a file that is no module.
    mkdir -p "$scratch/bin" && cp "$dtrain" "$scratch/bin/dtrain" && echo "not a module" >"$scratch/bin/libdtrain_cuda.so"
    dtrain="$scratch/bin/dtrain" expect_error 2 \
      "device gpu:0: the CUDA backend $scratch/bin/libdtrain_cuda.so could not be loaded \(.*\): .*; use cpu:N devices" -- \
      run experiments/fashion_mnist_one_device.yaml --set strategy.device=gpu:0 --run-dir "$scratch/broken"
    [ ! -e "$scratch/broken/metrics.jsonl" ] || fail "a run without its GPU backend still trained"
    # Where NVIDIA's driver is installed (a stand-in libcuda.so.1 here: the loader finds it, the CUDA
    # runtime finds no GPU through it), `devices: auto` looks for GPUs: a module that cannot load
    # stops there instead of leaving the run to the CPU unnoticed; a module that loads finds none.
    mkdir -p "$scratch/driver" && gcc -shared -o "$scratch/driver/libcuda.so.1" -x c /dev/null \
      || fail "cannot build a stand-in libcuda.so.1"
    LD_LIBRARY_PATH="$scratch/driver" dtrain="$scratch/bin/dtrain" expect_error 2 \
      "devices: auto looks for GPUs: this machine has NVIDIA's driver, but the CUDA backend .* could not be loaded .*; or list cpu devices" -- \
      validate "$small" --set "strategy={kind: mirrored}"
    LD_LIBRARY_PATH="$scratch/driver" "$dtrain" validate "$small" --set "strategy={kind: mirrored}" >"$scratch/auto" \
      || fail "devices: auto refused where the module loads and the runtime finds no GPU"
    ;;
  bf16_refused)
    # A CPU without bfloat16 instructions, played by capping oneDNN's ISA: mixed_bfloat16 stops at
    # start with exit 2 at the precision key, and dtrain info says why.
    printf 'precision: mixed_bfloat16\n' >"$scratch/bf16.yaml"
    grep -v '^precision:' experiments/fashion_mnist_small.yaml >>"$scratch/bf16.yaml"
    # Where the CPU has them, the cap is what rules them out, and the message says so.
    if grep -qw avx512_bf16 /proc/cpuinfo; then
      reason="oneDNN is capped to isa avx512_core \\(reproducibility.isa, or ONEDNN_MAX_CPU_ISA\\), below the avx512_core_bf16"
    else
      reason="this CPU has no bfloat16 instructions"
    fi
    ONEDNN_MAX_CPU_ISA=AVX512_CORE "$dtrain" info | grep -Eq "^precision mixed_bfloat16: not available: $reason" \
      || fail "dtrain info does not say why mixed_bfloat16 is unavailable: $(ONEDNN_MAX_CPU_ISA=AVX512_CORE "$dtrain" info | grep mixed)"
    why="precision mixed_bfloat16 cannot run on cpu:0: $reason.*; use precision: float32"
    ONEDNN_MAX_CPU_ISA=AVX512_CORE expect_error 2 "$scratch/bf16.yaml:1:12: $why" -- validate "$scratch/bf16.yaml"
    ONEDNN_MAX_CPU_ISA=AVX512_CORE expect_error 2 "$scratch/bf16.yaml:1:12: $why" -- run "$scratch/bf16.yaml" --run-dir "$scratch/run"
    [ ! -e "$scratch/run/metrics.jsonl" ] || fail "a refused precision still started training"
    ;;
  nccl_on_cpu)
    expect_error 2 "nccl needs GPU devices.*ring, hierarchical_copy or reduction_to_one_device" -- run experiments/fashion_mnist_mirrored.yaml --set strategy.cross_device_ops=nccl --run-dir "$scratch/run"
    # On GPUs: validate accepts it (any machine); run on a machine without them stops in one line
    # at the YAML's place, naming the device and how many GPUs it found (or what the build lacks).
    gpus=(--set "strategy={kind: mirrored, devices: [gpu:0, gpu:1], cross_device_ops: nccl}")
    "$dtrain" validate experiments/fashion_mnist_mirrored.yaml "${gpus[@]}" >/dev/null || fail "validate refused nccl over gpu:0, gpu:1"
    if nvidia-smi -L 2>/dev/null | grep -q "^GPU 1"; then
      echo "ok [$case_name] (this machine has two GPUs: the refusal is not checked)"; exit 0
    fi
    why=$(refusal_without_gpu "^NCCL: NCCL" \
      "cross_device_ops nccl over gpu:0, gpu:1: this build has no NCCL .*; rebuild where NCCL is installed, or use ring")
    # The devices come from --set here, so the location is that option.
    expect_error 2 "^dtrain: error: --set strategy=\\{.*\\}: $why" -- \
      run experiments/fashion_mnist_mirrored.yaml "${gpus[@]}" --run-dir "$scratch/gpus"
    # Across workers too: one GPU per worker process, refused before any GPU is looked for.
    expect_error 2 "communication.implementation nccl takes one GPU per worker process, and each worker here has gpu:0, gpu:1" -- \
      run experiments/fashion_mnist_multi_worker.yaml --set "strategy.devices=[gpu:0, gpu:1]" \
      --set strategy.communication.implementation=nccl --run-dir "$scratch/mwm"
    ;;
  *)
    fail "unknown case"
    ;;
esac
echo "ok [$case_name]"
