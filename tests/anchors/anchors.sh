#!/usr/bin/env bash
# dtrain beside TensorFlow 2.21 and Keras 3 (the anchors: build/venv-anchors, made by
# tools/setup --anchors; without it every case skips with exit 77).
#   tests/anchors/anchors.sh CASE DTRAIN_BINARY SCRATCH_DIR
#
# default, mirrored, multi_worker: dtrain trains the anchors experiment below for one epoch of the
#   2,000-image subset in file order (shuffle_buffer 0): 20 global batches of 96 and a short last
#   one of 80, a checkpoint after every step. TensorFlow runs the same custom training loop
#   (tools/tf_reference/tf_ctl.py) from dtrain's initial weights on the same batches, under the
#   same strategy: 2 mirrored replicas on 2 logical CPU devices, or 2 workers (dtrain under mpirun,
#   TensorFlow as 2 processes with TF_CONFIG). tests/anchors/tf_step_for_step.py compares them
#   step for step (TensorFlow set to dtrain's state before each step) and free running, and holds
#   dtrain's free run to TensorFlow's own distance from the same run in float64.
# seed_default, seed_mirrored, seed_multi_worker: the same with the seed CNN itself
#   (experiments/fashion_mnist.yaml: Adam, batch 64) for 20 steps of that file, shuffled as the
#   experiment shuffles: TensorFlow takes dtrain's order (dtrain order).
# varied_default, varied_mirrored, varied_multi_worker: as default, mirrored and multi_worker with
#   a model of what the others leave out: strides, 'same' padding, a non-square kernel, tanh and
#   sigmoid, average, overlapping max and global average pooling, batch normalization without
#   scale, softmax probabilities (from_logits: false) and reduction sum; under default Adam with its
#   other constants and a cosine decay on 2 threads (the lanes), under mirrored RMSprop (centered,
#   with momentum) and a piecewise constant rate, across workers SGD with Nesterov momentum and a
#   staircase exponential decay.
# stem_default: a VGG-style stem (two relu convolutions before the first pooling): the first
#   convolution's weight loops apply its relu's derivative themselves (no input gradient), on 2
#   threads (the lanes), SGD with momentum.
# losses: the other losses on 2 mirrored replicas, 10 steps each: categorical_crossentropy on
#   one-hot rows, binary_crossentropy on a sigmoid's probabilities (is the item footwear or a bag:
#   label 5 or more), mean_squared_error of a linear unit to the label's value.
# random: 8 random models on random data (tests/anchors/random_models.py: shapes, layers' options,
#   losses, optimizers, schedules, and in turn default or one_device, mirrored, central_storage and
#   multi_worker_mirrored on 2 to 4 replicas), each step held to TensorFlow's own float32 distance
#   from the float64 step; the trained model's outputs in Keras 3 and ONNX Runtime must be dtrain
#   eval's. DTRAIN_RANDOM_MODELS=N DTRAIN_RANDOM_SEED=S hunt further.
# keras_weights: dtrain's trained weights through dtrain export --format keras into Keras 3
#   (load_weights, evaluate: dtrain eval's Test Loss and Accuracy), and weights Keras saved starting a dtrain
#   run (model.initial_weights) that TensorFlow follows step for step.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../integration/common.sh" "$@"

venv=${DTRAIN_ANCHORS_VENV:-build/venv-anchors}
python=$venv/bin/python
if ! [ -x "$python" ] || ! "$python" -c 'import tensorflow, keras' 2>/dev/null; then
  echo "SKIP: no TensorFlow in $venv: tools/setup --anchors installs it (tools/requirements-anchors.txt)"
  exit 77
fi
# TensorFlow's own oneDNN kernels compute convolutions differently enough to move the weights by
# 1e-4 in a few steps (its start-up message says so, and how to turn them off): its reference
# kernels are what the comparison holds dtrain to. One op thread per process: two share the cores.
export TF_ENABLE_ONEDNN_OPTS=0 TF_CPP_MIN_LOG_LEVEL=2 PYTHONDONTWRITEBYTECODE=1
steps=21

# The seed CNN with what the comparison must cover: L2 on a convolution and a dense layer,
# reduction none (the global batch's average), batch normalization synchronized across replicas
# and per replica, and the short last batch (2,000 = 20 x 96 + 80).
cat >"$scratch/anchors.yaml" <<'YAML'
name: anchors
seed: 3
strategy: {kind: default}
data: {source: hdf5, path: data/fashion_mnist_small.h5, batch_size_per_replica: 96, shuffle_buffer: 0}
model:
  input_shape: [28, 28, 1]
  layers:
    - conv2d: {filters: 32, kernel_size: 3, activation: relu, kernel_regularizer: {l2: 1.0e-3}}
    - max_pool2d: {pool_size: 2}
    - conv2d: {filters: 64, kernel_size: 3, use_bias: false}
    - batch_normalization: {momentum: 0.9, synchronized: true}
    - activation: {activation: relu}
    - max_pool2d: {pool_size: 2}
    - flatten: {}
    - dense: {units: 64, use_bias: false, kernel_regularizer: {l2: 1.0e-3}}
    - batch_normalization: {momentum: 0.9}
    - activation: {activation: relu}
    - dense: {units: 10}
loss: {kind: sparse_categorical_crossentropy, from_logits: true, reduction: none}
optimizer: {kind: adam, learning_rate: 0.001}
metrics: [sparse_categorical_accuracy]
train: {epochs: 1, threads: 1, progress: none}
checkpoint: {every_steps: 1, max_to_keep: 100}
YAML
per_replica=(--set data.batch_size_per_replica=48)

# The seed CNN itself (experiments/fashion_mnist.yaml, Adam, batch 64) on the same file, shuffled
# as the experiment shuffles (a full shuffle), 20 steps: the seed_* cases. TensorFlow takes
# dtrain's order from `dtrain order`.
seed_cnn() {
  experiment=experiments/fashion_mnist.yaml
  steps=20
  per_replica=(--set data.batch_size_per_replica=32)
  common=(--set data.source=hdf5 --set data.path=data/fashion_mnist_small.h5
          --set train.epochs=1 --set train.threads=1 --set train.progress=none --set train.steps_per_epoch=20
          --set checkpoint.every_steps=1 --set checkpoint.max_to_keep=100)
  order=(--order "$scratch/order.npy")
}
# The varied_* cases' model (see the top).
varied_cnn() {
  cat >"$scratch/varied.yaml" <<'YAML'
name: varied
seed: 13
strategy: {kind: default}
data: {source: hdf5, path: data/fashion_mnist_small.h5, batch_size_per_replica: 96, shuffle_buffer: 0}
model:
  input_shape: [28, 28, 1]
  layers:
    - conv2d: {filters: 12, kernel_size: 5, strides: 2, padding: same, activation: tanh}
    - batch_normalization: {momentum: 0.9, scale: false, synchronized: true}
    - activation: {activation: relu}
    - average_pooling2d: {pool_size: 2}
    - conv2d: {filters: 20, kernel_size: [3, 2], padding: same, activation: sigmoid, kernel_regularizer: {l2: 1.0e-3}}
    - max_pool2d: {pool_size: 3, strides: 2, padding: same}
    - conv2d: {filters: 16, kernel_size: 2, strides: [2, 1], use_bias: false}
    - batch_normalization: {momentum: 0.8, epsilon: 0.01}
    - activation: {activation: tanh}
    - global_average_pooling2d: {}
    - dense: {units: 24, activation: relu}
    - dense: {units: 10, activation: softmax}
loss: {kind: sparse_categorical_crossentropy, from_logits: false, reduction: sum}
optimizer: {kind: adam, learning_rate: 0.003, beta_1: 0.8, beta_2: 0.99, epsilon: 1.0e-6}
metrics: [sparse_categorical_accuracy]
train: {epochs: 1, threads: 1, progress: none}
checkpoint: {every_steps: 1, max_to_keep: 100}
YAML
  experiment=$scratch/varied.yaml
  # Each strategy with another optimizer: Adam on the lanes, RMSprop (centered, momentum) on
  # mirrored replicas, SGD (Nesterov momentum) across workers.
  # Each with a learning-rate schedule that moves within the 21 steps.
  case $kind in
    default) common=(--set train.threads=2
                     --set "optimizer.learning_rate={schedule: cosine_decay, initial_learning_rate: 0.003,
                                                     decay_steps: 15, alpha: 0.1}") ;;
    mirrored) common=(--set "optimizer={kind: rmsprop, rho: 0.8, momentum: 0.5, centered: true, epsilon: 1.0e-5,
                                        learning_rate: {schedule: piecewise_constant, boundaries: [5, 12],
                                                        values: [0.001, 0.0005, 0.0002]}}") ;;
    multi_worker) common=(--set "optimizer={kind: sgd, momentum: 0.9, nesterov: true,
                                            learning_rate: {schedule: exponential_decay, initial_learning_rate: 0.0005,
                                                            decay_steps: 4, decay_rate: 0.7, staircase: true}}") ;;
  esac
}
# The stem_default case: the anchors experiment with the stem's model, SGD with momentum, 2 threads.
stem_cnn() {
  common=(--set seed=21 --set train.threads=2
          --set "model={input_shape: [28, 28, 1], layers: [
                   {conv2d: {filters: 16, kernel_size: 3, activation: relu}},
                   {conv2d: {filters: 16, kernel_size: 3, padding: same, activation: relu}},
                   {max_pool2d: {pool_size: 2}},
                   {conv2d: {filters: 32, kernel_size: 3, strides: 2, activation: relu}},
                   {flatten: {}}, {dense: {units: 10}}]}"
          --set "optimizer={kind: sgd, learning_rate: 0.01, momentum: 0.9}")
}
# loss_cnn LOSS: the losses case's experiment for LOSS (categorical, binary, squared).
loss_cnn() {
  local data=$scratch/onehot.h5 units=10 output=linear loss="{kind: categorical_crossentropy, from_logits: true"
  case $1 in
    binary) data=$scratch/binary.h5 units=1 output=sigmoid loss="{kind: binary_crossentropy, from_logits: false" ;;
    squared) data=data/fashion_mnist_small.h5 units=1 loss="{kind: mean_squared_error" ;;
    # Keras' sparse crossentropy of probabilities clips each output and takes a softmax of the
    # logs: on a relu output (rows of zeros included) not the categorical formula.
    sparse_relu) data=data/fashion_mnist_small.h5 output=relu loss="{kind: sparse_categorical_crossentropy, from_logits: false" ;;
  esac
  cat >"$scratch/$1.yaml" <<YAML
name: $1
seed: 17
strategy: {kind: default}
data: {source: hdf5, path: $data, batch_size_per_replica: 96, shuffle_buffer: 0}
model:
  input_shape: [28, 28, 1]
  layers:
    - conv2d: {filters: 8, kernel_size: 3, activation: relu}
    - max_pool2d: {pool_size: 2}
    - reshape: {target_shape: [1352]}
    - dense: {units: 32, activation: relu, kernel_regularizer: {l2: 1.0e-3}}
    - dense: {units: $units, activation: $output}
loss: $loss, reduction: none}
optimizer: {kind: adam, learning_rate: 0.001}
metrics: []
train: {epochs: 1, threads: 1, progress: none, steps_per_epoch: 10}
checkpoint: {every_steps: 1, max_to_keep: 100}
YAML
  experiment=$scratch/$1.yaml
}
experiment=$scratch/anchors.yaml
common=()
order=()

# train NAME STRATEGY [--set ...]: dtrain runs the experiment into $scratch/NAME.
train() {
  local name=$1 kind=$2
  shift 2
  case $kind in
    default) "$dtrain" run "$experiment" --run-dir "$scratch/$name" "${common[@]}" "$@" ;;
    mirrored) "$dtrain" run "$experiment" --run-dir "$scratch/$name" "${common[@]}" "${per_replica[@]}" \
                --set "strategy={kind: mirrored, devices: [cpu:0, cpu:1]}" "$@" ;;
    multi_worker) timeout 300 mpirun -n 2 --oversubscribe "$dtrain" run "$experiment" --run-dir "$scratch/$name" \
                    "${common[@]}" "${per_replica[@]}" --set "strategy={kind: multi_worker_mirrored}" "$@" ;;
  esac >"$scratch/$name.out" 2>&1 || fail "dtrain ($kind) failed: $(tail -5 "$scratch/$name.out")"
}

# follow NAME STRATEGY INITIAL: TensorFlow beside the run in $scratch/NAME, from INITIAL.
follow() {
  timeout 300 "$python" tests/anchors/tf_step_for_step.py --run "$scratch/$1" --initial-weights "$3" --steps "$steps" \
    --strategy "$2" "${order[@]}" >"$scratch/$1.tf" 2>&1
  local rc=$?
  cat "$scratch/$1.tf"
  [ "$rc" = 0 ] || fail "TensorFlow differs from dtrain ($2)"
}

case "$case_name" in
  default | mirrored | multi_worker | seed_default | seed_mirrored | seed_multi_worker | varied_default | \
  varied_mirrored | varied_multi_worker | stem_default)
    kind=${case_name##*_}  # default, mirrored, worker
    case $case_name in *multi_worker) kind=multi_worker ;; esac
    case $case_name in seed_*) seed_cnn ;; varied_*) varied_cnn ;; stem_*) stem_cnn ;; esac
    train "$kind" "$kind"
    "$dtrain" export --experiment "$scratch/$kind/config.yaml" --format keras -o "$scratch/initial.weights.h5" \
      >/dev/null || fail "exporting the initial model failed"
    if [ ${#order[@]} -gt 0 ]; then
      "$dtrain" order "$scratch/$kind/config.yaml" --epochs 1 -o "$scratch/order.npy" >/dev/null \
        || fail "dtrain order failed"
    fi
    follow "$kind" "$kind" "$scratch/initial.weights.h5"
    ;;
  losses)
    # The subset's labels as one-hot rows and as a binary target (float32), beside the file.
    "$python" - "$scratch" <<'EOF' || fail "could not write the losses case's data"
import sys, h5py, numpy as np
with h5py.File("data/fashion_mnist_small.h5", "r") as f:
    splits = {s: (f[s]["x"][()], f[s]["y"][()]) for s in ("train", "test")}
for name, target in (("onehot", lambda y: np.eye(10, dtype=np.float32)[y]),
                     ("binary", lambda y: (y >= 5).astype(np.float32)[:, None])):
    with h5py.File(f"{sys.argv[1]}/{name}.h5", "w") as out:
        for split, (x, y) in splits.items():
            out.create_dataset(f"{split}/x", data=x)
            out.create_dataset(f"{split}/y", data=target(y))
EOF
    steps=10
    for loss in categorical binary squared sparse_relu; do
      loss_cnn "$loss"
      train "$loss" mirrored
      "$dtrain" export --experiment "$scratch/$loss/config.yaml" --format keras -o "$scratch/$loss.weights.h5" \
        >/dev/null || fail "exporting the initial model failed ($loss)"
      follow "$loss" mirrored "$scratch/$loss.weights.h5"
    done
    ;;
  random)
    timeout 550 "$python" tests/anchors/random_models.py --dtrain "$dtrain" --scratch "$scratch" --seed 1 --count 8 \
      || fail "a random model trains otherwise in TensorFlow (its experiment is named above)"
    ;;
  keras_weights)
    # dtrain -> Keras: a trained checkpoint, exported, evaluates in Keras as dtrain evaluates it.
    train trained default --set checkpoint.every_steps=0 --set train.epochs=2
    ckpt=$(ls "$scratch"/trained/checkpoints/ckpt-*.h5 | tail -1)
    "$dtrain" eval --checkpoint "$ckpt" >"$scratch/eval.out" 2>&1 || fail "dtrain eval failed: $(cat "$scratch/eval.out")"
    accuracy=$(sed -n 's/.*Test Accuracy: \([0-9.]*\).*/\1/p' "$scratch/eval.out")
    loss=$(sed -n 's/.*Test Loss: \([0-9.]*\),.*/\1/p' "$scratch/eval.out")
    "$dtrain" export "$ckpt" --format keras -o "$scratch/trained.weights.h5" >"$scratch/export.out" 2>&1 \
      || fail "dtrain export --format keras failed: $(cat "$scratch/export.out")"
    timeout 300 "$python" tests/anchors/keras_weights.py evaluate "$scratch/trained/config.yaml" \
      "$scratch/trained.weights.h5" >"$scratch/keras.out" 2>&1 || fail "Keras failed: $(tail -5 "$scratch/keras.out")"
    echo "dtrain eval: $(cat "$scratch/eval.out")"
    cat "$scratch/keras.out"
    grep -q "Test Loss: $loss, Test Accuracy: $accuracy " "$scratch/keras.out" \
      || fail "Keras' loss or accuracy differs from dtrain's (Test Loss: $loss, Test Accuracy: $accuracy)"

    # Keras -> dtrain: weights Keras initialized and saved start a dtrain run exactly where
    # TensorFlow starts from them.
    timeout 300 "$python" tests/anchors/keras_weights.py save "$scratch/anchors.yaml" "$scratch/keras.weights.h5" \
      >"$scratch/save.out" 2>&1 || fail "Keras could not save weights: $(tail -5 "$scratch/save.out")"
    from_keras=(--set "model.initial_weights=$scratch/keras.weights.h5")
    "$dtrain" export --experiment "$scratch/anchors.yaml" "${from_keras[@]}" --format keras -o "$scratch/start.weights.h5" \
      >/dev/null || fail "exporting the model started from Keras' weights failed"
    # Byte for byte, the values dtrain read back are Keras' own.
    "$python" - "$scratch/keras.weights.h5" "$scratch/start.weights.h5" <<'EOF' || fail "dtrain did not start from Keras' values"
import sys, h5py, numpy as np
a, b = (h5py.File(p, "r") for p in sys.argv[1:])
names = []
a.visititems(lambda n, o: names.append(n) if isinstance(o, h5py.Dataset) else None)
bad = [n for n in names if not np.array_equal(a[n][()], b[n][()])]
print(f"{len(names) - len(bad)} of {len(names)} variables equal")
sys.exit(1 if bad or not names else 0)
EOF
    train from_keras default "${from_keras[@]}" --set train.steps_per_epoch=5
    steps=5
    follow from_keras default "$scratch/keras.weights.h5"
    ;;
  *) fail "unknown case" ;;
esac
echo "ok [$case_name]"
