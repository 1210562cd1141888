#!/usr/bin/env python3
"""The seed tutorial's custom training loop in TensorFlow 2 (tf.distribute, Keras 3), on what a
dtrain experiment describes: the same model, data, optimizer, batch, loss reduction and metrics.

Runs in the anchors virtual environment (tools/setup --anchors: build/venv-anchors, TensorFlow
pinned in tools/requirements-anchors.txt):

  build/venv-anchors/bin/python tools/tf_reference/tf_ctl.py --epochs 10          # the tutorial: epoch lines
  ... tf_ctl.py --strategy mirrored                  # MirroredStrategy over 2 logical CPU devices
  ... tf_ctl.py --strategy multi_worker --workers 2  # MultiWorkerMirroredStrategy, 2 processes on
                                                     # localhost (this script starts them with TF_CONFIG)
  ... tf_ctl.py --limit-steps 300 --warmup 20        # time 300 steps: a RESULT {json} line (tools/bench)
  ... tf_ctl.py --experiment RUN/config.yaml --initial-weights init.weights.h5 --steps 21 \\
        --save-weights tf.weights.h5                 # step for step beside dtrain (tests/anchors)
  ... tf_ctl.py --order order.npy ...                # the batches dtrain takes: `dtrain order EXP -o order.npy`

The experiment (default experiments/fashion_mnist.yaml) is read as dtrain reads it: data
(fashion_mnist IDX files or an hdf5 file; uint8 images times float32(1/255), as dtrain scales
them), data.batch_size_per_replica or global_batch_size, shuffle_buffer (0: file order),
drop_remainder, the model's layers with their options, the loss and its reduction, the optimizer.
The loop is the tutorial's, with one choice made the way dtrain makes it: the summed per-example
losses of a step are divided by the samples the step really has (tf.nn.compute_average_loss with
global_batch_size = that count), so a short last batch is weighted like a full one; the tutorial's
constant GLOBAL_BATCH_SIZE would shrink that step's gradient (docs/strategies.md).
"""
import argparse
import contextlib
import gzip
import json
import os
import socket
import struct
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FASHION_MNIST = "/usr/share/datasets/fashion-mnist"  # dtrain's default data.path (Debian's dataset-fashion-mnist)


# ---------------------------------------------------------------- the experiment and its data

def load_experiment(path):
    import yaml
    with open(path) as f:
        return yaml.safe_load(f)


def read_idx(directory, stem):
    """An IDX file of `directory`, plain or .gz, as dtrain finds it."""
    import numpy as np
    for name in (stem, stem + ".gz"):
        path = os.path.join(directory, name)
        if os.path.exists(path):
            with (gzip.open if name.endswith(".gz") else open)(path, "rb") as f:
                data = f.read()
            ndim = data[3]
            dims = struct.unpack(">" + "I" * ndim, data[4:4 + 4 * ndim])
            return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)
    sys.exit(f"tf_ctl.py: no {stem}[.gz] in {directory}")


def load_data(data):
    """(x_train, y_train, x_test, y_test): float32 images channels last; int32 labels, or float32
    targets (N, k) (a float y of (N,) becomes (N, 1), as dtrain reads it)."""
    import numpy as np
    source = data.get("source", "fashion_mnist")
    if source == "fashion_mnist":
        directory = data.get("path", FASHION_MNIST)
        xs = [read_idx(directory, f"{p}-images-idx3-ubyte")[..., None] for p in ("train", "t10k")]
        ys = [read_idx(directory, f"{p}-labels-idx1-ubyte") for p in ("train", "t10k")]
    elif source == "hdf5":
        import h5py
        with h5py.File(data["path"], "r") as f:
            xs = [np.asarray(f[s]["x"]) for s in ("train", "test")]
            ys = [np.asarray(f[s]["y"]) for s in ("train", "test")]
    else:
        sys.exit(f"tf_ctl.py: data.source {source} is not read here (fashion_mnist, hdf5)")
    # dtrain scales bytes by multiplying with float32(1/255), not by dividing: the same floats.
    scale = lambda x: x.astype(np.float32) * np.float32(1.0 / 255.0) if x.dtype == np.uint8 else x.astype(np.float32)
    targets = lambda y: y.astype(np.int32) if np.issubdtype(y.dtype, np.integer) else \
        y.astype(np.float32).reshape(len(y), -1)
    return scale(xs[0]), targets(ys[0]), scale(xs[1]), targets(ys[1])


def read_order(path):
    """`dtrain order`'s file (int64, epochs x training samples), or None without one."""
    if not path:
        return None
    import numpy as np
    return np.load(path)


# ---------------------------------------------------------------- the model

def keras_layer(kind, o):
    """The Keras 3 layer of one dtrain model.layers entry (its options as dtrain resolves them)."""
    import keras
    L = keras.layers
    pair = lambda v, default: tuple(v) if isinstance(v, list) else (v, v) if v is not None else default
    l2 = (o.get("kernel_regularizer") or {}).get("l2", 0.0)
    reg = keras.regularizers.L2(l2) if l2 else None
    if kind == "conv2d":
        return L.Conv2D(o["filters"], pair(o["kernel_size"], None), strides=pair(o.get("strides"), (1, 1)),
                        padding=o.get("padding", "valid"), activation=o.get("activation", "linear"),
                        use_bias=o.get("use_bias", True), kernel_regularizer=reg)
    if kind == "dense":
        return L.Dense(o["units"], activation=o.get("activation", "linear"), use_bias=o.get("use_bias", True),
                       kernel_regularizer=reg)
    if kind in ("max_pool2d", "max_pooling2d", "average_pooling2d", "avg_pool2d"):
        cls = L.MaxPooling2D if kind.startswith("max") else L.AveragePooling2D
        size = pair(o.get("pool_size", 2), (2, 2))
        return cls(size, strides=pair(o.get("strides"), size), padding=o.get("padding", "valid"))
    if kind in ("global_average_pooling2d", "global_avg_pool2d"):
        return L.GlobalAveragePooling2D()
    if kind == "flatten":
        return L.Flatten()
    if kind == "reshape":
        return L.Reshape(tuple(o["target_shape"]))
    if kind == "activation":
        return L.Activation(o["activation"])
    if kind == "dropout":
        return L.Dropout(o["rate"])
    if kind == "batch_normalization":
        return L.BatchNormalization(momentum=o.get("momentum", 0.99), epsilon=o.get("epsilon", 0.001),
                                    center=o.get("center", True), scale=o.get("scale", True),
                                    synchronized=o.get("synchronized", False))
    sys.exit(f"tf_ctl.py: layer kind {kind} has no Keras counterpart here")


def build_model(model_config):
    import keras
    # Each entry is one map {kind: options}, as dtrain reads it.
    layers = [keras_layer(kind, options or {}) for entry in model_config["layers"] for kind, options in entry.items()]
    return keras.Sequential([keras.Input(tuple(model_config["input_shape"]))] + layers)


def make_learning_rate(lr):
    """A number, or dtrain's schedule map as the Keras 3 schedule of the same formula."""
    import keras
    if isinstance(lr, (int, float)):
        return lr
    schedules = keras.optimizers.schedules
    kind = lr.get("schedule", "constant")
    if kind == "constant":
        return lr["initial_learning_rate"]
    if kind == "exponential_decay":
        return schedules.ExponentialDecay(lr["initial_learning_rate"], lr["decay_steps"], lr["decay_rate"],
                                          staircase=lr.get("staircase", False))
    if kind == "piecewise_constant":
        return schedules.PiecewiseConstantDecay(lr["boundaries"], lr["values"])
    if kind == "cosine_decay":
        return schedules.CosineDecay(lr["initial_learning_rate"], lr["decay_steps"], alpha=lr.get("alpha", 0.0))
    sys.exit(f"tf_ctl.py: learning-rate schedule {kind} is not translated here")


def make_optimizer(o):
    import keras
    lr = make_learning_rate(o.get("learning_rate", 0.001))
    kind = o.get("kind", "adam")
    if kind == "adam":
        return keras.optimizers.Adam(lr, beta_1=o.get("beta_1", 0.9), beta_2=o.get("beta_2", 0.999),
                                     epsilon=o.get("epsilon", 1e-7))
    if kind == "sgd":
        return keras.optimizers.SGD(lr, momentum=o.get("momentum", 0.0), nesterov=o.get("nesterov", False))
    if kind == "rmsprop":
        return keras.optimizers.RMSprop(lr, rho=o.get("rho", 0.9), momentum=o.get("momentum", 0.0),
                                        epsilon=o.get("epsilon", 1e-7), centered=o.get("centered", False))
    sys.exit(f"tf_ctl.py: optimizer {kind} is not translated here")


# ---------------------------------------------------------------- the strategy

def make_strategy(kind, threads, replicas=2):
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(threads)
    if kind in ("mirrored", "central_storage"):
        # As many logical devices on the one CPU as dtrain has replicas (threads on cpu:0, cpu:1, ...).
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * replicas)
        devices = [f"/cpu:{i}" for i in range(replicas)]
        if kind == "central_storage":  # the variables on the first, as dtrain's parameter_device default
            return tf.distribute.experimental.CentralStorageStrategy(devices, parameter_device=devices[0])
        return tf.distribute.MirroredStrategy(devices)
    if kind == "multi_worker":
        return tf.distribute.MultiWorkerMirroredStrategy()  # the cluster from TF_CONFIG
    return tf.distribute.get_strategy()


def mirrored_replicas(exp):
    """The replicas of the experiment's mirrored or central_storage strategy: its devices list's
    length (2 where it names none: the anchors' --set strategy gives cpu:0, cpu:1)."""
    devices = (exp.get("strategy") or {}).get("devices")
    return len(devices) if isinstance(devices, list) and devices else 2


def free_ports(n):
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def launch_workers(workers, script, argv):
    """Starts `workers` copies of `script` (with `argv` and --worker-process) on localhost, each with
    its TF_CONFIG; the chief's output is this process's. Exits with the worst exit code."""
    ports = free_ports(workers)
    cluster = {"worker": [f"localhost:{p}" for p in ports]}
    procs = []
    for index in range(workers):
        env = dict(os.environ, TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}}))
        quiet = None if index == 0 else subprocess.DEVNULL
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(script)] + list(argv) + ["--worker-process"],
                                      env=env, stdout=quiet, stderr=quiet))
    codes = [p.wait() for p in procs]
    sys.exit(max(codes, key=abs))


def is_chief():
    """Worker 0 of a TF_CONFIG cluster, or the one process without one."""
    config = os.environ.get("TF_CONFIG")
    return not config or json.loads(config)["task"]["index"] == 0


# ---------------------------------------------------------------- the loop

# dtrain's loss kinds: Keras' loss class and the accuracy Keras' "accuracy" resolves to with it
# (a crossentropy reads a label as a one-hot row, binary crossentropy and the squared error read it
# as the target value, as dtrain does).
LOSSES = {"sparse_categorical_crossentropy": ("SparseCategoricalCrossentropy", "SparseCategoricalAccuracy"),
          "categorical_crossentropy": ("CategoricalCrossentropy", "CategoricalAccuracy"),
          "binary_crossentropy": ("BinaryCrossentropy", "BinaryAccuracy"),
          "mean_squared_error": ("MeanSquaredError", None)}

@contextlib.contextmanager
def keras_floats(floatx):
    """Keras' float type and dtype policy set to `floatx` (float32, float64) for the block. Both:
    the global policy, once a layer read it, no longer follows floatx."""
    import keras
    floats, policy = keras.config.floatx(), keras.config.dtype_policy()
    keras.config.set_floatx(floatx)
    keras.config.set_dtype_policy(floatx)
    try:
        yield
    finally:
        keras.config.set_floatx(floats)
        keras.config.set_dtype_policy(policy)


class Loop:
    """The tutorial's custom training loop on an experiment: the strategy, the model, optimizer,
    loss and metrics made in its scope, and the distributed train and test steps."""

    def __init__(self, exp, strategy_kind, threads=0, workers=2, batch_per_replica=0, strategy=None, floatx="float32",
                 order=None):
        """`strategy`: one made before (by another Loop: a process makes its strategy once);
        `floatx`: the variables' and computations' float type (float64: the exact-arithmetic
        reference that tests/anchors measures float32 runs against); `order`: the training order
        of `dtrain order` (epochs x samples), taken in place of tf.data's shuffle."""
        self.order = order
        import tensorflow as tf
        self.tf = tf
        self.exp = exp
        self.data = exp.get("data", {})
        processes = workers if strategy_kind == "multi_worker" else 1
        self.strategy = strategy or make_strategy(strategy_kind, threads or max(1, (os.cpu_count() or 1) // processes),
                                                  mirrored_replicas(exp))
        self.replicas = self.strategy.num_replicas_in_sync
        self.global_batch = self.data.get("global_batch_size") or \
            (batch_per_replica or self.data.get("batch_size_per_replica", 64)) * self.replicas
        self.x_train, self.y_train, self.x_test, self.y_test = load_data(self.data)
        loss = exp.get("loss", {})
        kind = loss.get("kind", "sparse_categorical_crossentropy")
        if kind not in LOSSES:
            sys.exit(f"tf_ctl.py: loss {kind} is not translated here ({', '.join(LOSSES)})")
        loss_class, accuracy_class = LOSSES[kind]
        self.reduction = loss.get("reduction", "auto")
        # Read as the layers, the optimizer, the loss (which casts its inputs to it) and the metrics are made.
        with keras_floats(floatx):
            with self.strategy.scope():
                self.model = build_model(exp["model"])
                self.optimizer = make_optimizer(exp.get("optimizer", {}))
                self.optimizer.build(self.model.trainable_variables)
                options = {"from_logits": loss.get("from_logits", False)} if kind != "mean_squared_error" else {}
                self.per_example = getattr(tf.keras.losses, loss_class)(reduction=None, **options)
                # Keras' compile(metrics=["accuracy"]) picks from the shapes, not the loss: a binary
                # crossentropy over several outputs (multi-label rows) gets CategoricalAccuracy.
                if accuracy_class == "BinaryAccuracy" and self.model.output_shape[-1] != 1:
                    accuracy_class = "CategoricalAccuracy"
                # (A regression has no accuracy: None.)
                accuracy = lambda: getattr(tf.keras.metrics, accuracy_class)() if accuracy_class else None
                self.train_accuracy, self.test_accuracy = accuracy(), accuracy()
                self.test_loss = tf.keras.metrics.Sum()
        self.floatx = floatx
        self.train_step = tf.function(lambda *args: self._traced_in_floatx(self._distributed_train_step, *args))
        self.test_step = tf.function(lambda *args: self._traced_in_floatx(self._distributed_test_step, *args))

    def _traced_in_floatx(self, step, *args):
        """`step` traced with Keras' float type set to the loop's: what Keras computes in floatx
        then has the variables' type."""
        with keras_floats(self.floatx):
            return step(*args)

    def _replica_train_step(self, x, y, samples):
        tf = self.tf
        with tf.GradientTape() as tape:
            logits = self.model(x, training=True)
            losses = self.per_example(y, logits)
            # dtrain's reductions: none divides the step's summed losses by its real sample count
            # (compute_average_loss, as the tutorial), sum does not divide.
            loss = tf.reduce_sum(losses) if self.reduction == "sum" else \
                tf.nn.compute_average_loss(losses, global_batch_size=samples)
            if self.model.losses:
                loss += tf.nn.scale_regularization_loss(tf.add_n(self.model.losses))
        grads = tape.gradient(loss, self.model.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.model.trainable_variables))
        if self.train_accuracy:
            self.train_accuracy.update_state(y, logits)
        return loss

    def _distributed_train_step(self, batch, samples):
        losses = self.strategy.run(self._replica_train_step, args=(batch[0], batch[1], samples))
        return self.strategy.reduce(self.tf.distribute.ReduceOp.SUM, losses, axis=None)

    def _replica_test_step(self, x, y):
        logits = self.model(x, training=False)
        self.test_loss.update_state(self.tf.reduce_sum(self.per_example(y, logits)))
        if self.test_accuracy:
            self.test_accuracy.update_state(y, logits)

    def _distributed_test_step(self, batch):
        self.strategy.run(self._replica_test_step, args=batch)

    def batches(self, training=True, epoch=0, repeat=False):
        """The distributed global batches of the training split (shuffled as data.shuffle_buffer
        says, 0: in file order) or of the test split (in order)."""
        tf = self.tf
        x, y = (self.x_train, self.y_train) if training else (self.x_test, self.y_test)
        shuffle = int(self.data.get("shuffle_buffer", 60000)) if training else 0
        if training and self.order is not None:
            # dtrain's own order of this epoch (dtrain order), so both take the same batches.
            if epoch >= len(self.order) or len(self.order[epoch]) != len(x):
                sys.exit(f"tf_ctl.py: the order file has {len(self.order)} epochs of {len(self.order[0])} samples; "
                         f"epoch {epoch + 1} of {len(x)} samples is not in it")
            x, y, shuffle = x[self.order[epoch]], y[self.order[epoch]], 0
        ds = tf.data.Dataset.from_tensor_slices((x, y))
        if shuffle:
            ds = ds.shuffle(shuffle, seed=self.exp.get("seed", 42) + epoch)
        if repeat:
            ds = ds.repeat()
        ds = ds.batch(self.global_batch, drop_remainder=training and bool(self.data.get("drop_remainder", False)))
        options = tf.data.Options()
        # Every worker keeps its part of each global batch, as dtrain's data sharding does.
        options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
        return self.strategy.experimental_distribute_dataset(ds.with_options(options))

    def samples_at(self, step):
        """The samples of step `step` of an epoch over every replica (the short last batch's fewer)."""
        n = len(self.x_train)
        return self.tf.constant(min(self.global_batch, n - step * self.global_batch), self.tf.int32)

    def header(self, kind):
        tf = self.tf
        return (f"TensorFlow {tf.__version__}, Keras {tf.keras.version()} | strategy {kind} | replicas "
                f"{self.replicas} | global batch {self.global_batch} | threads "
                f"{tf.config.threading.get_intra_op_parallelism_threads()} | oneDNN ops "
                f"{'off' if os.environ.get('TF_ENABLE_ONEDNN_OPTS') == '0' else 'on'}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experiment", default=os.path.join(ROOT, "experiments", "fashion_mnist.yaml"))
    ap.add_argument("--strategy", choices=["default", "mirrored", "central_storage", "multi_worker"], default="default")
    ap.add_argument("--workers", type=int, default=2, help="multi_worker: processes on localhost")
    ap.add_argument("--threads", type=int, default=0, help="TensorFlow's op threads per process (0: cores / processes)")
    ap.add_argument("--epochs", type=int, default=0, help="0: the experiment's train.epochs")
    ap.add_argument("--batch", type=int, default=0, help="per replica; 0: the experiment's")
    ap.add_argument("--limit-steps", type=int, default=0, help="benchmark: time this many steps, print RESULT")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--steps", type=int, default=0, help="train this many steps from the data's first sample")
    ap.add_argument("--initial-weights", help="a Keras .weights.h5 file to start from (dtrain export --format keras)")
    ap.add_argument("--save-weights", help="write the variables after training here (the chief)")
    ap.add_argument("--order", help="take the training samples in dtrain's order: the .npy file of `dtrain order`")
    ap.add_argument("--worker-process", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.strategy == "multi_worker" and not args.worker_process:
        launch_workers(args.workers, __file__, sys.argv[1:])
    started = time.perf_counter()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

    exp = load_experiment(args.experiment)
    loop = Loop(exp, args.strategy, args.threads, args.workers, args.batch, order=read_order(args.order))
    if args.initial_weights:
        loop.model.load_weights(args.initial_weights)
    say = print if is_chief() else (lambda *a, **k: None)
    say(loop.header(args.strategy), flush=True)

    if args.steps:
        # From the split's first global batch on, epoch after epoch (file order when shuffle_buffer is 0).
        steps, epoch = 0, 0
        while steps < args.steps:
            for k, batch in enumerate(loop.batches(epoch=epoch)):
                loop.train_step(batch, loop.samples_at(k))
                steps += 1
                if steps == args.steps:
                    break
            epoch += 1
        if is_chief() and args.save_weights:
            loop.model.save_weights(args.save_weights)
        say(f"trained {steps} steps")
        return

    if args.limit_steps:
        it = iter(loop.batches(repeat=True))
        full = loop.samples_at(0)
        for _ in range(args.warmup):
            loop.train_step(next(it), full)
        t0 = time.perf_counter()
        for _ in range(args.limit_steps):
            loss = loop.train_step(next(it), full)
        float(loss)  # the last step has finished
        seconds = time.perf_counter() - t0
        say("RESULT " + json.dumps({"train_samples_per_s": args.limit_steps * loop.global_batch / seconds,
                                    "strategy": args.strategy, "global_batch": loop.global_batch}), flush=True)
        return

    if loop.test_accuracy is None:
        sys.exit(f"tf_ctl.py: loss {exp['loss']['kind']} has no accuracy to train epochs against; use --steps")
    epochs = args.epochs or exp.get("train", {}).get("epochs", 10)
    to_90, n = None, len(loop.x_train)
    test = loop.batches(training=False)
    for epoch in range(epochs):
        t0 = time.perf_counter()
        total, steps = 0.0, 0
        for k, batch in enumerate(loop.batches(epoch=epoch)):
            total += float(loop.train_step(batch, loop.samples_at(k)))
            steps += 1
        seconds = time.perf_counter() - t0
        for batch in test:
            loop.test_step(batch)
        accuracy = float(loop.test_accuracy.result()) * 100
        say(f"Epoch {epoch + 1}, Loss: {total / steps:.4f}, Accuracy: {float(loop.train_accuracy.result()) * 100:.2f}, "
            f"Test Loss: {float(loop.test_loss.result()) / len(loop.x_test):.4f}, Test Accuracy: {accuracy:.2f}")
        say(f"  train {n / seconds:.1f} samples/s ({steps} steps, {seconds:.2f} s)", flush=True)
        if to_90 is None and accuracy >= 90.0:
            to_90 = time.perf_counter() - started
        for metric in (loop.train_accuracy, loop.test_accuracy, loop.test_loss):
            metric.reset_state()
    say("RESULT " + json.dumps({"final_test_accuracy": accuracy, "seconds_to_90": to_90,
                                "seconds": time.perf_counter() - started, "strategy": args.strategy}), flush=True)


if __name__ == "__main__":
    main()
