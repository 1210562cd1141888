#!/usr/bin/env bash
# dtrain export against ONNX Runtime (build/venv, made by tools/setup): tiny models covering every
# layer kind, trained under the default, mirrored, multi-worker and parameter-server strategies,
# exported and run in ONNX Runtime on the test split that `dtrain eval --predictions` wrote: the
# same Test Accuracy as dtrain eval, logits within 1e-5 of each sample's largest.
#   tests/integration/export.sh CASE DTRAIN_BINARY SCRATCH_DIR
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh" "$@"

python=${DTRAIN_VENV:-build/venv}/bin/python
"$python" -c 'import onnxruntime' 2>/dev/null \
  || fail "no ONNX Runtime in ${DTRAIN_VENV:-build/venv}: run tools/setup (it installs tools/requirements.txt there)"
mpi() { local n=$1; shift; timeout 300 mpirun -n "$n" --oversubscribe "$@"; }
common=(--set train.progress=none --set train.threads=1)

# experiment NAME SEED LEARNING_RATE FROM_LOGITS < LAYERS: a 20-step experiment on the subset in
# data/ whose model.layers are the lines read.
experiment() {
  cat <<YAML
name: $1
seed: $2
strategy: {kind: default}
data: {source: hdf5, path: data/fashion_mnist_small.h5, batch_size_per_replica: 32, shuffle_buffer: 2000}
model:
  input_shape: [28, 28, 1]
  layers:
$(cat)
loss: {kind: sparse_categorical_crossentropy, from_logits: $4, reduction: none}
optimizer: {kind: adam, learning_rate: $3}
metrics: [sparse_categorical_accuracy]
train: {epochs: 1, steps_per_epoch: 20}
YAML
}
# Every layer kind, SAME paddings that pad more at the end, strides, kernels that are not square,
# batch normalization on rank 4, 3 and 2 (with and without gamma/beta), every activation.
experiment onnx_layers_a 7 0.003 true >"$scratch/layers_a.yaml" <<'LAYERS'
    - conv2d: {filters: 8, kernel_size: [3, 5], strides: [2, 1], padding: same, activation: relu}
    - batch_normalization: {momentum: 0.5, epsilon: 0.01}
    - max_pool2d: {pool_size: 3, strides: 2, padding: same}
    - dropout: {rate: 0.25}
    - conv2d: {filters: 6, kernel_size: 2, use_bias: false, activation: tanh}
    - average_pooling2d: {pool_size: [3, 2], strides: 2, padding: same}
    - flatten: {}
    - dense: {units: 16, activation: sigmoid}
    - batch_normalization: {momentum: 0.5, center: false, scale: false}
    - dense: {units: 10}
LAYERS
experiment onnx_layers_b 11 0.01 false >"$scratch/layers_b.yaml" <<'LAYERS'
    - reshape: {target_shape: [14, 56, -1]}
    - conv2d: {filters: 8, kernel_size: 3, padding: valid}
    - activation: {activation: relu}
    - batch_normalization: {momentum: 0.5}
    - max_pool2d: {pool_size: 2}
    - global_average_pooling2d: {}
    - reshape: {target_shape: [2, 4]}
    - batch_normalization: {momentum: 0.5, epsilon: 0.1}
    - activation: {activation: softmax}
    - flatten: {}
    - activation: {activation: linear}
    - dense: {units: 10, use_bias: false, activation: softmax}
LAYERS

# check RUN_DIR [--softmax]: eval its checkpoint with --predictions, export it, run ONNX Runtime.
check() {
  local run=$1 name ckpt accuracy
  shift
  name=$(basename "$run")
  ckpt=$(ls "$run"/checkpoints/ckpt-*.h5 | tail -1)
  [ -f "$ckpt" ] || fail "$name: no checkpoint in $run/checkpoints"
  "$dtrain" eval --checkpoint "$ckpt" --predictions "$scratch/$name.h5" >"$scratch/$name.eval" \
    || fail "$name: dtrain eval --predictions failed: $(cat "$scratch/$name.eval")"
  accuracy=$(sed -n 's/.*Test Accuracy: \([0-9.]*\).*/\1/p' "$scratch/$name.eval")
  [ -n "$accuracy" ] || fail "$name: eval printed no Test Accuracy: $(cat "$scratch/$name.eval")"
  "$dtrain" export "$ckpt" -o "$scratch/$name.onnx" "$@" >"$scratch/$name.export" 2>&1 \
    || fail "$name: dtrain export failed: $(cat "$scratch/$name.export")"
  grep -q "^Exported $ckpt (global step [0-9]*) to $scratch/$name.onnx: input 'input' (N, 28, 28, 1) float32" \
    "$scratch/$name.export" || fail "$name: export printed $(cat "$scratch/$name.export")"
  echo -n "$name: "
  "$python" tests/integration/onnx_check.py "$scratch/$name.onnx" "$scratch/$name.h5" --accuracy "$accuracy" "$@" \
    || fail "$name: ONNX Runtime differs from dtrain"
}

case "$case_name" in
  layer_kinds)
    for model in layers_a layers_b; do
      "$dtrain" run "$scratch/$model.yaml" "${common[@]}" --run-dir "$scratch/$model" >"$scratch/$model.out" 2>&1 \
        || fail "training $model failed: $(tail -5 "$scratch/$model.out")"
      check "$scratch/$model"
    done
    # --softmax: the output is 'probabilities', softmax of dtrain's logits.
    cp -r "$scratch/layers_a" "$scratch/layers_a_softmax"
    check "$scratch/layers_a_softmax" --softmax
    ;;
  strategies)
    # Checkpoints written under mirrored (2 replicas), multi_worker_mirrored (2 workers) and
    # parameter_server (a chief, one server, one worker): eval and export read them alike.
    a="$scratch/layers_a.yaml"
    batch=(--set data.batch_size_per_replica=16)
    "$dtrain" run "$a" "${common[@]}" "${batch[@]}" --set "strategy={kind: mirrored, devices: [cpu:0, cpu:1]}" \
      --run-dir "$scratch/mirrored" >"$scratch/mirrored.out" 2>&1 || fail "mirrored run failed: $(tail -5 "$scratch/mirrored.out")"
    check "$scratch/mirrored"
    mpi 2 "$dtrain" run "$a" "${common[@]}" "${batch[@]}" --set "strategy={kind: multi_worker_mirrored}" \
      --run-dir "$scratch/multi_worker" >"$scratch/multi_worker.out" 2>&1 \
      || fail "multi-worker run failed: $(tail -5 "$scratch/multi_worker.out")"
    check "$scratch/multi_worker"
    mpi 3 "$dtrain" run "$a" "${common[@]}" "${batch[@]}" \
      --set "strategy={kind: parameter_server, roles: {chief: 1, ps: 1, worker: 1}}" \
      --run-dir "$scratch/parameter_server" >"$scratch/parameter_server.out" 2>&1 \
      || fail "parameter-server run failed: $(tail -5 "$scratch/parameter_server.out")"
    check "$scratch/parameter_server"
    ;;
  errors)
    # A missing or damaged checkpoint is exit 2, an output that cannot be written exit 3; neither
    # leaves a file behind.
    "$dtrain" run "$scratch/layers_b.yaml" "${common[@]}" --set train.steps_per_epoch=2 --run-dir "$scratch/b" \
      >/dev/null 2>&1 || fail "training failed"
    ckpt=$(ls "$scratch"/b/checkpoints/ckpt-*.h5 | tail -1)
    "$dtrain" export "$scratch/none.h5" -o "$scratch/none.onnx" 2>"$scratch/err"
    rc=$?
    [ "$rc" = 2 ] && grep -q "none.h5" "$scratch/err" || fail "a missing checkpoint: exit $rc, $(cat "$scratch/err")"
    head -c 3000 "$ckpt" >"$scratch/cut.h5"
    "$dtrain" export "$scratch/cut.h5" -o "$scratch/cut.onnx" 2>"$scratch/err"
    rc=$?
    [ "$rc" = 2 ] || fail "a truncated checkpoint: exit $rc, $(cat "$scratch/err")"
    "$dtrain" export "$ckpt" -o "$scratch/no/such/dir/m.onnx" 2>"$scratch/err"
    rc=$?
    [ "$rc" = 3 ] && grep -q "no/such/dir/m.onnx" "$scratch/err" || fail "an unwritable output: exit $rc, $(cat "$scratch/err")"
    "$dtrain" export "$ckpt" 2>"$scratch/err"
    rc=$?
    [ "$rc" = 2 ] || fail "no -o: exit $rc"
    # --softmax where a softmax makes no probabilities: on outputs that already are (this model ends
    # in one), and on a binary crossentropy's logits (a sigmoid each).
    "$dtrain" export "$ckpt" --softmax -o "$scratch/twice.onnx" 2>"$scratch/err"
    rc=$?
    [ "$rc" = 2 ] && grep -q "the model's outputs are already probabilities (the softmax of layer 'dense')" "$scratch/err" \
      || fail "--softmax on a softmax output: exit $rc, $(cat "$scratch/err")"
    "$dtrain" export --experiment "$scratch/layers_a.yaml" --set 'loss={kind: binary_crossentropy, from_logits: true}' \
      --softmax -o "$scratch/binary.onnx" 2>"$scratch/err"
    rc=$?
    [ "$rc" = 2 ] && grep -q "its probabilities are the sigmoid of each output" "$scratch/err" \
      || fail "--softmax on a binary crossentropy: exit $rc, $(cat "$scratch/err")"
    [ -z "$(find "$scratch" -name '*.onnx*')" ] || fail "files were left: $(find "$scratch" -name '*.onnx*')"
    # An output onto the file the command reads (under another spelling, or a link) would replace
    # it: refused, the checkpoint untouched.
    before=$(sha256sum <"$ckpt")
    ln -s "$ckpt" "$scratch/link.h5"
    for out in "$ckpt" "$(dirname "$ckpt")/../checkpoints/$(basename "$ckpt")" "$scratch/link.h5"; do
      for format in onnx keras; do
        "$dtrain" export "$ckpt" --format $format -o "$out" 2>"$scratch/err"
        rc=$?
        [ "$rc" = 2 ] && grep -qF -- "-o $out is $ckpt, which this command reads" "$scratch/err" \
          || fail "export --format $format onto its checkpoint ($out): exit $rc, $(cat "$scratch/err")"
      done
      "$dtrain" eval --checkpoint "$ckpt" --predictions "$out" >/dev/null 2>"$scratch/err"
      rc=$?
      [ "$rc" = 2 ] && grep -qF -- "--predictions $out is $ckpt" "$scratch/err" \
        || fail "eval --predictions onto its checkpoint ($out): exit $rc, $(cat "$scratch/err")"
    done
    [ "$before" = "$(sha256sum <"$ckpt")" ] || fail "the checkpoint changed"
    # Nor onto the data it evaluates (copied: the shipped file stays untouched if this fails).
    cp data/fashion_mnist_small.h5 "$scratch/data.h5"
    "$dtrain" eval --checkpoint "$ckpt" --set "data.path=$scratch/data.h5" --predictions "$scratch/data.h5" >/dev/null \
      2>"$scratch/err"
    rc=$?
    [ "$rc" = 2 ] && grep -qF -- "--predictions $scratch/data.h5 is $scratch/data.h5" "$scratch/err" \
      || fail "eval --predictions onto its data: exit $rc, $(cat "$scratch/err")"
    cmp -s data/fashion_mnist_small.h5 "$scratch/data.h5" || fail "the data changed"
    ;;
  keras)
    # --format keras, and model.initial_weights reading it back, without Keras (tests/anchors has
    # Keras read and write them): a checkpoint's weights round trip exactly, the initial model of
    # an experiment exports without a checkpoint, and every file a run cannot start from is
    # refused at the key's file:line:column, naming the file and why.
    b="$scratch/layers_b.yaml"
    "$dtrain" run "$b" "${common[@]}" --set train.steps_per_epoch=2 --run-dir "$scratch/b" >/dev/null 2>&1 \
      || fail "training failed"
    ckpt=$(ls "$scratch"/b/checkpoints/ckpt-*.h5 | tail -1)
    "$dtrain" export "$ckpt" --format keras -o "$scratch/b.weights.h5" >"$scratch/out" 2>&1 \
      || fail "export --format keras failed: $(cat "$scratch/out")"
    grep -q "^Exported $ckpt (global step 2) to $scratch/b.weights.h5: Keras 3 weights of 12 layers" "$scratch/out" \
      || fail "export printed $(cat "$scratch/out")"
    grep -q "warning" "$scratch/out" && fail "a warning for a .weights.h5 name: $(cat "$scratch/out")"
    # Another name is written, with a warning that Keras 3 will not read it under that name.
    "$dtrain" export "$ckpt" --format keras -o "$scratch/b.h5" >/dev/null 2>"$scratch/err" || fail "export to b.h5 failed"
    grep -q "warning: -o $scratch/b.h5: Keras 3's model.load_weights reads this format only from a file named \*.weights.h5" \
      "$scratch/err" || fail "no warning for b.h5: $(cat "$scratch/err")"
    cmp -s "$scratch/b.h5" "$scratch/b.weights.h5" || fail "b.h5 differs from b.weights.h5"
    # The experiment starting from them: its initial model is the checkpoint's weights, bit for bit.
    awk -v weights="$scratch/b.weights.h5" '/^loss:/ && !done {print "  initial_weights: " weights; done = 1} {print}' \
      "$b" >"$scratch/from.yaml"
    line=$(grep -n initial_weights "$scratch/from.yaml" | cut -d: -f1)
    "$dtrain" export --experiment "$scratch/from.yaml" --format keras -o "$scratch/again.weights.h5" >"$scratch/out" 2>&1 \
      || fail "exporting the initial model failed: $(cat "$scratch/out")"
    grep -qF "Exported the initial model of $scratch/from.yaml ($scratch/b.weights.h5)" "$scratch/out" \
      || fail "export printed $(cat "$scratch/out")"
    /usr/bin/python3 - "$scratch/b.weights.h5" "$scratch/again.weights.h5" "$ckpt" <<'PY' || fail "the weights changed"
import sys, h5py, numpy as np
a, b, c = (h5py.File(p, "r") for p in sys.argv[1:])
names = []
a.visititems(lambda n, o: names.append(n) if isinstance(o, h5py.Dataset) else None)
assert names and all(np.array_equal(a[n][()], b[n][()]) for n in names), names
# Keras' group of the first dense layer holds what dtrain calls dense/kernel.
assert np.array_equal(a["layers/dense/vars/0"][()], c["model/dense/kernel"][()])
print(f"{len(names)} variables read back exactly")
PY
    "$dtrain" run "$scratch/from.yaml" "${common[@]}" --set train.steps_per_epoch=1 --run-dir "$scratch/from" \
      >"$scratch/out" 2>&1 || fail "a run from model.initial_weights failed: $(tail -3 "$scratch/out")"
    # refused FILE MESSAGE: a run from FILE (--set) exits 2 naming the --set, FILE and MESSAGE.
    refused() {
      "$dtrain" run "$scratch/from.yaml" "${common[@]}" --run-dir "$scratch/refused" --overwrite \
        --set "model.initial_weights=$1" >"$scratch/out" 2>&1
      local rc=$?
      [ "$rc" = 2 ] && grep -qF -- "dtrain: error: --set model.initial_weights=$1: model.initial_weights: $1: $2" \
        "$scratch/out" || fail "initial weights $1: exit $rc, $(cat "$scratch/out")"
    }
    refused "$scratch/none.weights.h5" "no such file"
    refused "$b" "not an HDF5 file"
    refused "$ckpt" "is a dtrain checkpoint, not a Keras weights file"
    refused "$scratch" "is not a regular file"
    "$dtrain" export --experiment "$scratch/layers_a.yaml" --format keras -o "$scratch/a.weights.h5" >/dev/null \
      || fail "exporting layers_a's initial model failed"
    refused "$scratch/a.weights.h5" "/layers/conv2d/vars/0 has shape (3, 5, 1, 8), but conv2d/kernel of the experiment's layer"
    # dtrain validate reads the file as run does: the same refusal before any launch, and its
    # count of variables when the file fits.
    "$dtrain" validate "$scratch/from.yaml" --set "model.initial_weights=$scratch/a.weights.h5" >"$scratch/out" 2>&1
    rc=$?
    [ "$rc" = 2 ] && grep -qF "/layers/conv2d/vars/0 has shape (3, 5, 1, 8), but conv2d/kernel" "$scratch/out" \
      || fail "validate of mismatched initial weights: exit $rc, $(cat "$scratch/out")"
    "$dtrain" validate "$scratch/from.yaml" >"$scratch/out" 2>&1 || fail "validate failed: $(cat "$scratch/out")"
    grep -qE "^# initial weights: $scratch/b.weights.h5 holds the [0-9]+ variables of the model" "$scratch/out" \
      || fail "validate printed $(cat "$scratch/out")"
    # In the file itself: the key's line and column.
    sed "s#initial_weights: .*#initial_weights: $scratch/none.weights.h5#" "$scratch/from.yaml" >"$scratch/bad.yaml"
    "$dtrain" run "$scratch/bad.yaml" "${common[@]}" --run-dir "$scratch/bad" >"$scratch/out" 2>&1
    rc=$?
    [ "$rc" = 2 ] && grep -qF "dtrain: error: $scratch/bad.yaml:$line:20: model.initial_weights: $scratch/none.weights.h5: no such file" \
      "$scratch/out" || fail "a missing file in the experiment: exit $rc, $(cat "$scratch/out")"
    # export's own refusals, which leave no file.
    "$dtrain" export "$ckpt" --format keras --softmax -o "$scratch/s.weights.h5" 2>"$scratch/err"
    rc=$?
    [ "$rc" = 2 ] && grep -q "leave out --softmax or --format keras" "$scratch/err" || fail "--softmax with keras: exit $rc"
    "$dtrain" export --format keras -o "$scratch/s.weights.h5" 2>"$scratch/err"
    rc=$?
    [ "$rc" = 2 ] && grep -q "needs a CHECKPOINT" "$scratch/err" || fail "neither checkpoint nor experiment: exit $rc"
    "$dtrain" export "$ckpt" --format tf -o "$scratch/s.weights.h5" 2>"$scratch/err"
    [ $? = 2 ] || fail "--format tf was taken"
    [ ! -e "$scratch/s.weights.h5" ] || fail "a refused export left a file"
    ;;
  *) fail "unknown case" ;;
esac
echo "ok [$case_name]"
