#!/usr/bin/env python3
"""Random models on random data under every synchronous strategy: dtrain beside TensorFlow, step
for step (tests/anchors/anchors.sh, case random).

  random_models.py --dtrain BUILD/dtrain --scratch DIR [--seed S] [--count N]

Model S, S+1, ... S+N-1 each draw, from their seed alone:
- data: an HDF5 file of H x W x C images (H, W 6..30, C 1..3; uint8, or float32 in [0, 1]), or
  one model in five of rows of 4..64 float32 features, whose classes (2..12) are noisy templates,
  labelled for the loss: sparse labels (int64, int32 or uint8), one-hot rows, a binary or
  multi-label target, or a regression value;
- on features, 1 to 3 dense layers, or a reshape to [H, W, 1] and what follows for images;
- on images, 1 to 3 convolution blocks (square or not, strides 1 or 2 on either axis, 'valid' or
  'same', each activation, bias or not, L2), batch normalization (momentum, epsilon, center, scale,
  synchronized or not) with an activation layer, max or average pooling (sizes 2..3, their own
  strides and padding), then flatten or global average pooling, up to two dense layers (batch
  normalization after some) and the output layer: logits or probabilities;
- the loss (sparse categorical, categorical, binary crossentropy, mean squared error), its
  reduction (none, sum; auto and sum_over_batch_size without replicas), Adam, SGD (momentum,
  Nesterov) or RMSprop (centered, momentum) with their constants, a learning-rate schedule now
  and then;
- the strategy, in turn by seed: default or one_device (1 or 2 threads), mirrored (2..4
  replicas), central_storage (2..4 replicas) and multi_worker_mirrored (2..4 ranks under
  mpirun); the batch per replica, or a global batch the replicas split unevenly; and now and then
  a whole epoch, whose short last batch leaves some replicas few samples or none.

dtrain trains it (a checkpoint after every step) and tests/anchors/tf_step_for_step.py follows in
TensorFlow with --relative 3: no fixed bound fits every model's conditioning (a model of a few
units under Adam moves 1e-4 from exact arithmetic in one float32 step, TensorFlow's step
included), so each step is held to TensorFlow's own float32 distance from the float64 step. The
trained model's outputs on the test split (dtrain eval --predictions) must then be Keras 3's on
its weights (dtrain export --format keras) and ONNX Runtime's on its graph (dtrain export; with
--onnx-python's onnxruntime) within 1e-4 of the larger of each sample's largest output and the
split's mean one (a regression's output near zero is a sum that cancels).

A bias below batch normalization has no gradient but rounding, which Adam and RMSprop turn into
whole steps of either sign: none is drawn. Neither is dropout (TensorFlow's random masks are not
dtrain's), nor batch normalization under central_storage (TensorFlow's CentralStorageStrategy
cannot update Keras 3's moving statistics in a replica, synchronized or not), nor batch
normalization where a replica may see one sample or none (a whole epoch).

Prints one line per model and the experiment's path for each that differs; exit 1 if any did.
A model whose training diverges (dtrain stops on a non-finite loss, exit 2) is reported and not
compared. DTRAIN_RANDOM_MODELS and DTRAIN_RANDOM_SEED override --count and --seed, for hunts.
"""
import argparse
import json
import os
import random
import subprocess
import sys
import time

import h5py
import numpy as np
import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", "..", "tools", "tf_reference"), os.path.join(HERE, "..", "integration")]
from onnx_check import relative_difference  # noqa: E402
STRATEGIES = ["default", "mirrored", "central_storage", "multi_worker"]
# The trained model's outputs in Keras and ONNX Runtime against dtrain eval's, relative to each
# sample's largest: their sums in other orders, through up to a dozen layers.
kInferenceRtol = 1e-4


def out_size(n, k, s, padding):
    return (n - k) // s + 1 if padding == "valid" else -(-n // s)


def draw_model(r, shape, outputs, batch_norm):
    """(layers, from_logits): model.layers for an input of `shape` ([H, W, C] or [features]: a
    reshape to [H, W, 1] first now and then, else dense layers alone) and `outputs` units, with
    batch normalization here and there where `batch_norm`."""
    layers = []
    if len(shape) == 1:
        rows = next((d for d in range(2, shape[0]) if shape[0] % d == 0 and d * d >= shape[0]), 0)
        if rows and r.random() < 0.4:
            layers.append({"reshape": {"target_shape": [rows, shape[0] // rows, 1]}})
            shape = [rows, shape[0] // rows, 1]
    h, w, c = shape if len(shape) == 3 else (0, 0, 0)
    for _ in range(r.randint(1, 3) if len(shape) == 3 else 0):
        if min(h, w) < 2:
            break
        kh = r.randint(1, min(5, h))
        kw = kh if r.random() < 0.7 else r.randint(1, min(5, w))
        kw = min(kw, w)
        sh = r.choice([1, 1, 2])
        sw = sh if r.random() < 0.8 else r.choice([1, 2])
        padding = r.choice(["valid", "same"])
        conv = {"filters": r.randint(2, 16), "kernel_size": [kh, kw] if kh != kw else kh,
                "strides": [sh, sw] if sh != sw else sh, "padding": padding,
                "activation": r.choice(["relu", "relu", "tanh", "sigmoid", "linear"]), "use_bias": r.random() < 0.7}
        if r.random() < 0.3:
            conv["kernel_regularizer"] = {"l2": r.choice([1e-3, 1e-2])}
        h2, w2 = out_size(h, kh, sh, padding), out_size(w, kw, sw, padding)
        if h2 < 1 or w2 < 1:
            break
        layers.append({"conv2d": conv})
        h, w = h2, w2
        if r.random() < 0.4 and batch_norm:
            conv["use_bias"] = False  # see the top: no bias below batch normalization
            layers.append({"batch_normalization": {"momentum": r.choice([0.9, 0.99, 0.5]),
                                                   "epsilon": r.choice([1e-3, 1e-2, 1e-5]),
                                                   "center": r.random() < 0.8, "scale": r.random() < 0.8,
                                                   "synchronized": r.random() < 0.5}})
            if r.random() < 0.6:
                layers.append({"activation": {"activation": r.choice(["relu", "tanh", "sigmoid"])}})
        if r.random() < 0.6 and min(h, w) >= 2:
            size = r.randint(2, min(3, h, w))
            strides = r.choice([None, 1, 2, size])
            padding = r.choice(["valid", "same"])
            h2, w2 = out_size(h, size, strides or size, padding), out_size(w, size, strides or size, padding)
            if h2 >= 1 and w2 >= 1:
                pool = {"pool_size": size, "padding": padding}
                if strides is not None:
                    pool["strides"] = strides
                layers.append({r.choice(["max_pool2d", "average_pooling2d"]): pool})
                h, w = h2, w2
    if len(shape) == 3:
        layers.append({"global_average_pooling2d": {}} if r.random() < 0.3 else {"flatten": {}})
    for _ in range(r.randint(0, 2) if len(shape) == 3 else r.randint(1, 3)):
        dense = {"units": r.randint(3, 40), "activation": r.choice(["relu", "tanh", "sigmoid", "linear"]),
                 "use_bias": r.random() < 0.8}
        if r.random() < 0.3:
            dense["kernel_regularizer"] = {"l2": r.choice([1e-3, 1e-2])}
        layers.append({"dense": dense})
        if r.random() < 0.3 and batch_norm:
            dense["use_bias"] = False
            layers.append({"batch_normalization": {"momentum": r.choice([0.9, 0.99]), "synchronized": r.random() < 0.5}})
            layers.append({"activation": {"activation": "relu"}})
    probabilities = r.random() < 0.25
    layers.append({"dense": {"units": outputs, "activation": "softmax" if probabilities else "linear"}})
    return layers, not probabilities


def draw_optimizer(r):
    kind = r.choice(["adam", "sgd", "rmsprop"])
    if kind == "adam":
        return {"kind": "adam", "learning_rate": r.choice([1e-3, 3e-3, 1e-2]), "beta_1": r.choice([0.9, 0.8]),
                "beta_2": r.choice([0.999, 0.99]), "epsilon": r.choice([1e-7, 1e-5])}
    if kind == "sgd":
        momentum = r.choice([0.0, 0.9])
        return {"kind": "sgd", "learning_rate": r.choice([0.01, 0.05]), "momentum": momentum,
                "nesterov": momentum > 0 and r.random() < 0.3}
    return {"kind": "rmsprop", "learning_rate": r.choice([1e-3, 3e-3]), "rho": r.choice([0.9, 0.8]),
            "momentum": r.choice([0.0, 0.5]), "centered": r.random() < 0.4, "epsilon": r.choice([1e-7, 1e-5])}


def draw_schedule(r, rate):
    return r.choice([
        {"schedule": "exponential_decay", "initial_learning_rate": rate, "decay_steps": 3, "decay_rate": 0.8,
         "staircase": r.random() < 0.5},
        {"schedule": "cosine_decay", "initial_learning_rate": rate, "decay_steps": 7, "alpha": 0.1},
        {"schedule": "piecewise_constant", "boundaries": [2, 5], "values": [rate, rate / 2, rate / 5]}])


class Case:
    """Model `seed`: its data file and experiment in `directory`, and how to run and follow it."""

    def __init__(self, seed, directory):
        r = random.Random(seed)
        self.seed, self.directory = seed, directory
        os.makedirs(directory, exist_ok=True)
        # Images, or rows of features (float32, any sign) one model in five.
        shape = [r.randint(6, 30), r.randint(6, 30), r.choice([1, 1, 2, 3])] if r.random() < 0.8 else [r.randint(4, 64)]
        classes = r.randint(2, 12)
        target = r.choice(["sparse"] * 6 + ["one_hot", "binary", "multi_label", "regression"])
        floats, label_type = r.random() < 0.2, r.choice([np.int64, np.int32, np.uint8])
        rng = np.random.default_rng(seed)
        templates = rng.integers(0, 256, size=[classes] + shape)

        def rows(n):
            y = rng.integers(0, classes, size=n)
            if len(shape) == 1:
                x = (templates[y] / 64.0 - 2.0 + rng.normal(size=[n] + shape)).astype(np.float32)
            else:
                x = np.clip(templates[y] * 0.5 + rng.integers(0, 128, size=[n] + shape), 0, 255).astype(np.uint8)
                if floats:
                    x = (x / 255.0).astype(np.float32)
            if target == "one_hot":
                return x, np.eye(classes, dtype=np.float32)[y]
            if target == "binary":
                return x, (y >= classes // 2).astype(np.float32)
            if target == "multi_label":
                return x, (rng.random((n, classes)) < 0.3).astype(np.float32)
            if target == "regression":
                return x, (y / classes).astype(np.float32)
            return x, y.astype(label_type)

        outputs = 1 if target in ("binary", "regression") else classes
        self.strategy = STRATEGIES[seed % len(STRATEGIES)]
        layers, from_logits = draw_model(r, shape, outputs, batch_norm=self.strategy != "central_storage")
        head = layers[-1]["dense"]
        loss = {"kind": {"sparse": "sparse_categorical_crossentropy", "one_hot": "categorical_crossentropy",
                         "binary": "binary_crossentropy", "multi_label": "binary_crossentropy",
                         "regression": "mean_squared_error"}[target]}
        if target in ("binary", "multi_label"):
            from_logits = r.random() < 0.5
            head["activation"] = "linear" if from_logits else "sigmoid"
        if target == "regression":
            head["activation"] = r.choice(["linear", "sigmoid"])
        else:
            loss["from_logits"] = from_logits

        self.replicas = 1 if self.strategy == "default" else r.randint(2, 4)
        has_batch_norm = any("batch_normalization" in layer for layer in layers)
        per_replica = r.randint(8, 48)
        n_train = r.randint(150, 500)
        whole_epoch = r.random() < 0.3 and not has_batch_norm
        if whole_epoch:
            # A whole epoch: its last batch short, some replicas with few samples or none.
            per_replica = r.randint(8, 24)
            global_batch = per_replica * self.replicas
            n_train = r.randint(3, 8) * global_batch + r.randint(1, global_batch - 1)
            self.steps = -(-n_train // global_batch)
        else:
            self.steps = min(12, n_train // (per_replica * self.replicas))
            if self.steps < 3:
                per_replica = max(4, n_train // (self.replicas * 6))
                self.steps = min(12, n_train // (per_replica * self.replicas))
        loss["reduction"] = r.choice(["none", "none", "sum"] + (["sum_over_batch_size", "auto"] if self.replicas == 1 else []))
        optimizer = draw_optimizer(r)
        if loss["reduction"] == "sum" and optimizer["kind"] == "sgd":
            optimizer["learning_rate"] /= 10  # a summed loss's gradient is the batch's times larger
        if r.random() < 0.3:
            optimizer["learning_rate"] = draw_schedule(r, optimizer["learning_rate"])

        self.data = os.path.join(directory, "data.h5")
        with h5py.File(self.data, "w") as f:
            for split, n in (("train", n_train), ("test", 100)):
                x, y = rows(n)
                f.create_dataset(f"{split}/x", data=x)
                f.create_dataset(f"{split}/y", data=y)
        strategy = {"kind": "default"}
        if self.strategy in ("mirrored", "central_storage"):
            strategy = {"kind": self.strategy, "devices": [f"cpu:{i}" for i in range(self.replicas)]}
        elif self.strategy == "multi_worker":
            strategy = {"kind": "multi_worker_mirrored"}
        threads = r.choice([1, 2]) if self.strategy == "default" else 1
        # Drawn last, so that the draws above stay what they were for a seed.
        batch = {"batch_size_per_replica": per_replica}
        if self.replicas > 1 and not whole_epoch and r.random() < 0.3:
            # A global batch that the replicas split unevenly (ceil(G / R) each in turn).
            batch = {"global_batch_size": per_replica * self.replicas + r.randint(1, self.replicas - 1)}
            self.steps = max(1, min(self.steps, n_train // batch["global_batch_size"]))
        # (auto and sum_over_batch_size are refused under every explicit strategy, as tf.distribute does.)
        if self.strategy == "default" and r.random() < 0.3 and loss["reduction"] in ("none", "sum"):
            strategy = {"kind": "one_device", "device": "cpu:0"}
        self.experiment = os.path.join(directory, "experiment.yaml")
        with open(self.experiment, "w") as f:
            yaml.safe_dump({"name": f"random{seed}", "seed": seed, "strategy": strategy,
                            "data": {"source": "hdf5", "path": self.data, **batch, "shuffle_buffer": 0},
                            "model": {"input_shape": shape, "layers": layers}, "loss": loss,
                            "optimizer": optimizer, "metrics": [],
                            "train": {"epochs": 1, "threads": threads, "progress": "none", "steps_per_epoch": self.steps},
                            "checkpoint": {"every_steps": 1, "max_to_keep": 100}}, f, sort_keys=False)
        kinds = [next(iter(layer)) for layer in layers]
        self.summary = (f"{'x'.join(map(str, shape))} -> {outputs}, {next(iter(batch.items()))[0]} "
                        f"{next(iter(batch.values()))}, {len(layers)} layers ({kinds.count('conv2d')} conv, "
                        f"{kinds.count('batch_normalization')} batch norm, {kinds.count('dense')} dense), "
                        f"{loss['kind']} {loss['reduction']}, {optimizer['kind']}, {self.steps} steps")

    def train(self, dtrain):
        """dtrain's exit code and output."""
        run = [dtrain, "run", self.experiment, "--run-dir", os.path.join(self.directory, "run")]
        if self.strategy == "multi_worker":
            run = ["timeout", "300", "mpirun", "-n", str(self.replicas), "--oversubscribe"] + run
        p = subprocess.run(run, capture_output=True, text=True)
        return p.returncode, p.stdout + p.stderr

    def follow(self, dtrain):
        """TensorFlow's verdict: (exit code, output)."""
        run, initial = os.path.join(self.directory, "run"), os.path.join(self.directory, "initial.weights.h5")
        p = subprocess.run([dtrain, "export", "--experiment", os.path.join(run, "config.yaml"), "--format", "keras",
                            "-o", initial], capture_output=True, text=True)
        if p.returncode != 0:
            return p.returncode, "exporting the initial model failed: " + p.stdout + p.stderr
        p = subprocess.run(["timeout", "400", sys.executable, os.path.join(HERE, "tf_step_for_step.py"), "--run", run,
                            "--initial-weights", initial, "--steps", str(self.steps), "--strategy", self.strategy,
                            "--workers", str(self.replicas), "--relative", "3", "--free", "1", "--free-factor", "4"],
                           capture_output=True, text=True)
        return p.returncode, p.stdout + p.stderr

    def infer(self, dtrain, onnx_python):
        """The trained model's outputs on the test split three ways: `dtrain eval --predictions`,
        Keras 3 on `dtrain export --format keras`, and ONNX Runtime on `dtrain export` (where
        `onnx_python` has it). (problems, figures): empty problems where Keras' and ONNX Runtime's
        outputs are within kInferenceRtol of dtrain's (onnx_check.relative_difference)."""
        checkpoint = os.path.join(self.directory, "run", "checkpoints", f"ckpt-{self.steps}.h5")
        predictions, keras_weights, onnx = (os.path.join(self.directory, name) for name in
                                            ("predictions.h5", "trained.weights.h5", "trained.onnx"))
        for command in ([dtrain, "eval", "--checkpoint", checkpoint, "--predictions", predictions],
                        [dtrain, "export", checkpoint, "--format", "keras", "-o", keras_weights],
                        [dtrain, "export", checkpoint, "-o", onnx]):
            p = subprocess.run(command, capture_output=True, text=True)
            if p.returncode != 0:
                return [f"{' '.join(command[:2])} failed (exit {p.returncode}): {p.stdout + p.stderr}"], ""
        with h5py.File(predictions, "r") as f:
            x, want = f["inputs"][()], f["logits"][()]
        import tf_ctl  # TensorFlow, imported once the first model needs it
        model = tf_ctl.build_model(tf_ctl.load_experiment(os.path.join(self.directory, "run", "config.yaml"))["model"])
        model.load_weights(keras_weights)
        got = np.asarray(model.predict(x, batch_size=64, verbose=0))
        keras = relative_difference(got, want).max()
        problems = [f"Keras' outputs {keras:.2e} from dtrain eval's (> {kInferenceRtol})"] if not keras <= kInferenceRtol else []
        figures = f"inference: Keras {keras:.1e}"
        if onnx_python:
            p = subprocess.run([onnx_python, os.path.join(HERE, "..", "integration", "onnx_check.py"), onnx, predictions,
                                "--rtol", str(kInferenceRtol)], capture_output=True, text=True)
            if p.returncode != 0:
                problems.append(f"ONNX Runtime: {p.stdout + p.stderr}")
            figures += ", ONNX Runtime " + p.stdout.strip().rsplit(" ", 1)[-1]
        return problems, figures


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtrain", required=True)
    ap.add_argument("--scratch", required=True)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--count", type=int, default=8)
    ap.add_argument("--onnx-python", default="build/venv/bin/python",
                    help="a Python with onnxruntime and h5py (tools/setup's build/venv); none there: no ONNX check")
    args = ap.parse_args()
    onnx_python = args.onnx_python if subprocess.run([args.onnx_python, "-c", "import onnxruntime, h5py"],
                                                     capture_output=True).returncode == 0 else None
    if not onnx_python:
        print(f"no onnxruntime in {args.onnx_python}: the exported ONNX models are not run (tools/setup installs it)")
    first = int(os.environ.get("DTRAIN_RANDOM_SEED", args.seed))
    count = int(os.environ.get("DTRAIN_RANDOM_MODELS", args.count))
    differ, diverged = [], []
    for seed in range(first, first + count):
        started = time.perf_counter()
        case = Case(seed, os.path.join(args.scratch, f"model{seed}"))
        where = f"model {seed} ({case.strategy}, {case.replicas} replicas): {case.summary}"
        code, out = case.train(args.dtrain)
        if code == 2 and "the training loss became" in out:
            diverged.append(seed)
            print(f"{where}: diverged in dtrain, not compared", flush=True)
            continue
        if code != 0:
            differ.append(seed)
            print(f"{where}: dtrain failed (exit {code}): {case.experiment}\n{out[-2000:]}", flush=True)
            continue
        code, out = case.follow(args.dtrain)
        result = next((json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT ")), None)
        if code != 0 or result is None:
            differ.append(seed)
            print(f"{where}: DIFFERS from TensorFlow: {case.experiment}\n{out[-3000:]}", flush=True)
            continue
        problems, inference = case.infer(args.dtrain, onnx_python)
        if problems:
            differ.append(seed)
            print(f"{where}: the trained model's outputs differ: {case.experiment}\n" + "\n".join(problems), flush=True)
            continue
        print(f"{where}: ok, steps {result['step_for_step_median']:.1e} median from TensorFlow, free run "
              f"{result['free_running_dtrain_from_float64']:.1e} from float64 (TensorFlow float32 "
              f"{max(result['free_running_tf_from_float64']):.1e}); {inference} [{time.perf_counter() - started:.0f} s]",
              flush=True)
    print(f"{count - len(differ) - len(diverged)} of {count} models as TensorFlow trains them"
          + (f"; {len(diverged)} diverged (not compared): {diverged}" if diverged else "")
          + (f"; differ: {differ}" if differ else ""))
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
