#!/usr/bin/env python3
"""TensorFlow beside a dtrain run, step for step (tests/anchors/anchors.sh).

  tf_step_for_step.py --run RUN_DIR --initial-weights INIT.weights.h5 --steps N
      [--strategy default|mirrored|multi_worker] [--typical 1e-6] [--worst 1e-4] [--variable 1e-2] [--free 1e-2]

RUN_DIR is a dtrain run of its config.yaml (data.shuffle_buffer: 0, so step k takes the k-th global
batch of the file) that saved a checkpoint after every step (checkpoint.every_steps: 1):
checkpoints/ckpt-1.h5 ... ckpt-N.h5, N steps within one epoch. INIT is the model dtrain started
from (dtrain export --experiment EXP --format keras, or Keras' own file it was given). The same
custom training loop in TensorFlow (tools/tf_reference/tf_ctl.py) then runs twice:

- step for step: before step k, every variable, Adam's slots and its iteration count are set to
  dtrain's after step k-1 (INIT and fresh slots for the first); TensorFlow takes batch k, and its
  variables are compared with dtrain's after step k: ||tf - dtrain|| / ||dtrain|| over every
  variable together (batch normalization's moving statistics included) and for each variable;
- free running: from INIT for N steps with nothing set in between, against ckpt-N.

Two float32 implementations that sum in different orders agree to rounding on a typical step
(1e-8 to 1e-7 here), but now and then a relu or max-pooling decision is taken on a value within
rounding of its threshold and goes the other way; Adam then moves the weights whose gradients are
smallest by a visibly different step (up to 2e-5 over the variables, 2e-3 for a bias). Such steps
add up when the runs go on apart, so the free run drifts by 1e-4 or so in 20 steps. The bounds:
the median step within --typical, every step within --worst, any one variable within --variable,
the free run within --free. Under a strategy with several replicas, the moving statistics of
batch normalization that is not synchronized are reported apart (per_replica_moving_statistics).

Prints one line per step and a RESULT {json} line (the chief); exit 1 when a bound is exceeded.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools", "tf_reference"))
import tf_ctl  # noqa: E402


def dtrain_names(exp):
    """Each Keras layer's dtrain name (config.yaml writes every layer's name)."""
    return [next(iter(entry.values()))["name"] for entry in exp["model"]["layers"]]


def set_state(loop, names, checkpoint=None, initial=None):
    """The variables (and Adam's state) from a dtrain checkpoint, or the initial weights and fresh slots."""
    import h5py
    import numpy as np
    opt = loop.optimizer
    if initial:
        loop.model.load_weights(initial)
        for slot in list(opt._momentums) + list(opt._velocities):
            slot.assign(np.zeros(slot.shape, np.float32))
        opt.iterations.assign(0)
        return
    with h5py.File(checkpoint, "r") as f:
        for layer, name in zip(loop.model.layers, names):
            for v in layer.weights:
                v.assign(f[f"model/{name}/{v.name}"][()])
                if v.trainable:
                    i = opt._get_variable_index(v)
                    opt._momentums[i].assign(f[f"optimizer/m/{name}/{v.name}"][()])
                    opt._velocities[i].assign(f[f"optimizer/v/{name}/{v.name}"][()])
        opt.iterations.assign(int(f["optimizer"].attrs["iterations"]))


def per_replica_moving_statistics(exp, replicas):
    """The moving statistics of batch normalization that is not synchronized, with several replicas:
    Keras 3 creates them with aggregation "none", and under a strategy TensorFlow then keeps the
    first replica's update, where dtrain moves them by every replica's statistics (weighted by its
    samples). They are compared apart (docs/strategies.md)."""
    if replicas == 1:
        return set()
    out = set()
    for entry in exp["model"]["layers"]:
        kind, options = next(iter(entry.items()))
        if kind == "batch_normalization" and not options.get("synchronized", False):
            out |= {options["name"] + "/moving_mean", options["name"] + "/moving_variance"}
    return out


def differences(loop, names, checkpoint, apart):
    """{variable: ||tf - dtrain|| / ||dtrain||}, the same over every variable together but those
    `apart`, and over those."""
    import h5py
    import numpy as np
    out, sums = {}, {False: [0.0, 0.0], True: [0.0, 0.0]}
    with h5py.File(checkpoint, "r") as f:
        for layer, name in zip(loop.model.layers, names):
            for v in layer.weights:
                ours = np.asarray(f[f"model/{name}/{v.name}"][()], np.float64)
                theirs = np.asarray(v.numpy(), np.float64)
                d, n = float(np.sum((theirs - ours) ** 2)), float(np.sum(ours ** 2))
                key = f"{name}/{v.name}"
                out[key] = (d / n) ** 0.5 if n > 0 else d ** 0.5
                sums[key in apart][0] += d
                sums[key in apart][1] += n
    overall = lambda d, n: (d / n) ** 0.5 if n > 0 else 0.0
    return ({k: v for k, v in out.items() if k not in apart}, overall(*sums[False]), overall(*sums[True]))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", required=True)
    ap.add_argument("--initial-weights", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--strategy", choices=["default", "mirrored", "multi_worker"], default="default")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--list", type=int, default=0, help="also list the N variables that differ most at each step")
    # The bounds (docs/testing.md, "The anchors"): a typical step agrees to float32 rounding; a step
    # where a relu or max-pooling decision on a value within rounding of its threshold went the
    # other way moves a few weights further; free running, such steps add up.
    ap.add_argument("--typical", type=float, default=1e-6, help="bound of the median step, over the variables")
    ap.add_argument("--worst", type=float, default=1e-4, help="bound of every step, over the variables")
    ap.add_argument("--variable", type=float, default=1e-2, help="bound of any one variable at any step")
    ap.add_argument("--free", type=float, default=1e-2, help="bound of the free run, over the variables")
    ap.add_argument("--worker-process", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.strategy == "multi_worker" and not args.worker_process:
        tf_ctl.launch_workers(args.workers, __file__, sys.argv[1:])
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

    exp = tf_ctl.load_experiment(os.path.join(args.run, "config.yaml"))
    names = dtrain_names(exp)
    # One op thread per process: the two workers share the machine's cores.
    loop = tf_ctl.Loop(exp, args.strategy, threads=1, workers=args.workers)
    say = print if tf_ctl.is_chief() else (lambda *a, **k: None)
    say(loop.header(args.strategy), flush=True)
    checkpoint = lambda k: os.path.join(args.run, "checkpoints", f"ckpt-{k}.h5")
    steps_per_epoch = -(-len(loop.x_train) // loop.global_batch)
    if args.steps > steps_per_epoch:
        sys.exit(f"tf_step_for_step.py: --steps {args.steps} is more than one epoch ({steps_per_epoch} steps)")

    apart = per_replica_moving_statistics(exp, loop.replicas)
    overall_by_step, worst_variable, worst_apart = [], ("", 0.0), 0.0
    batches = iter(loop.batches())
    for k in range(args.steps):
        set_state(loop, names, initial=args.initial_weights if k == 0 else None,
                  checkpoint=checkpoint(k) if k > 0 else None)
        loop.train_step(next(batches), loop.samples_at(k))
        per_variable, overall, moving = differences(loop, names, checkpoint(k + 1), apart)
        name, largest = max(per_variable.items(), key=lambda item: item[1])
        say(f"step {k + 1:3d} ({int(loop.samples_at(k))} samples): ||tf - dtrain|| / ||dtrain|| {overall:.2e} over the "
            f"variables, largest {largest:.2e} ({name})" + (f"; per-replica moving statistics {moving:.2e}" if apart else ""),
            flush=True)
        for variable, value in sorted(per_variable.items(), key=lambda item: -item[1])[:args.list]:
            say(f"    {variable} {value:.2e}")
        overall_by_step.append(overall)
        worst_variable = max(worst_variable, (name, largest), key=lambda item: item[1])
        worst_apart = max(worst_apart, moving)

    set_state(loop, names, initial=args.initial_weights)
    batches = iter(loop.batches())
    for k in range(args.steps):
        loop.train_step(next(batches), loop.samples_at(k))
    per_variable, free, _ = differences(loop, names, checkpoint(args.steps), apart)
    say(f"free running, {args.steps} steps: ||tf - dtrain|| / ||dtrain|| {free:.2e} over the variables, largest "
        f"{max(per_variable.values()):.2e} ({max(per_variable, key=per_variable.get)})")
    median = sorted(overall_by_step)[len(overall_by_step) // 2]
    worst = max(overall_by_step)
    say("RESULT " + json.dumps({"strategy": args.strategy, "steps": args.steps, "step_for_step_median": median,
                                "step_for_step_worst": worst, "worst_variable": worst_variable[1],
                                "worst_variable_name": worst_variable[0],
                                "per_replica_moving_statistics": worst_apart if apart else None,
                                "free_running": free}), flush=True)
    failed = [f"{what} {value:.2e} > {bound:.0e}" for what, value, bound in
              [("step for step, the median step", median, args.typical),
               ("step for step, the worst step", worst, args.worst),
               ("step for step, one variable", worst_variable[1], args.variable),
               ("free running", free, args.free)] if value > bound]
    if failed:
        say("FAIL: " + "; ".join(failed), file=sys.stderr)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
