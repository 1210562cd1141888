#!/usr/bin/env python3
"""TensorFlow beside a dtrain run, step for step (tests/anchors/anchors.sh).

  tf_step_for_step.py --run RUN_DIR --initial-weights INIT.weights.h5 --steps N
      [--strategy default|mirrored|central_storage|multi_worker] [--typical 1e-6] [--most 1e-5 --few 0.1]
      [--worst 1e-4] [--variable 1e-2] [--free 1e-2] [--free-factor 2 --nudged 3] [--relative K]

RUN_DIR is a dtrain run of its config.yaml (data.shuffle_buffer: 0, so step k takes the k-th global
batch of the file; or any shuffle, with --order ORDER.npy written by `dtrain order RUN/config.yaml`)
that saved a checkpoint after every step (checkpoint.every_steps: 1): checkpoints/ckpt-1.h5 ... ckpt-N.h5, N steps within one epoch. INIT is the model dtrain started
from (dtrain export --experiment EXP --format keras, or Keras' own file it was given). The same
custom training loop in TensorFlow (tools/tf_reference/tf_ctl.py) then runs:

- step for step: before step k, every variable, the optimizer's slots and its iteration count are
  set to dtrain's after step k-1 (INIT and fresh slots for the first); TensorFlow takes batch k, and
  its variables are compared with dtrain's after step k: ||tf - dtrain|| / ||dtrain|| over every
  variable together (batch normalization's moving statistics included) and for each variable,
  and so are those of the same step taken in float64 from the same state;
- free running: from INIT for N steps with nothing set in between, against ckpt-N;
- exact arithmetic: the same free run in float64, and TensorFlow's float32 free run again from
  INIT with every variable nudged by one rounding (one ulp, up or down at random), --nudged times,
  and once with each step where dtrain flipped a decision (a step above --most, one of the --few)
  taken as dtrain took it.

Two float32 implementations that sum in different orders agree to rounding on a typical step
(1e-8 to 1e-7 here), but now and then a relu or max-pooling decision is taken on a value within
rounding of its threshold and goes the other way; Adam then moves the weights whose gradients are
smallest by a visibly different step (up to 2e-5 over the variables, 2e-3 for a bias). Free
running, such steps compound: this training is chaotic at float32's resolution, and TensorFlow's
own float32 run, or the same run nudged by one rounding, ends 1e-5 to 2e-3 away from the float64
run after 20 steps (docs/testing.md has the figures). A fixed bound on the free run would test
chance, so dtrain's free run is held to TensorFlow's own spread instead. The bounds: the median
step within --typical; all steps but --few of them within --most; every step within --worst; any
one variable within --variable; each of these step for step against the nearer of TensorFlow's
float32 step and the same step taken in float64 from the same state (a gradient that is a sum
which nearly cancels, such as a convolution's bias below tanh and batch normalization, comes out
of any float32 step with a relative error far above a typical one, TensorFlow's included); the
free run within --free of TensorFlow's or of the float64 run, and dtrain's distance
from the float64 run within --free-factor times the largest of TensorFlow's float32 runs' (those
with one of dtrain's flipped steps included: whether TensorFlow's own runs flip one is chance). Under a
strategy with several replicas, the moving statistics of batch normalization that is not
synchronized are reported apart (per_replica_moving_statistics).

--relative K judges each step by rounding's own size on that model instead of fixed bounds (the
random models of tests/anchors/random_models.py, whose conditioning no fixed bound fits): dtrain's
step, over the variables and for each variable, no farther from the float64 step than K times
TensorFlow's float32 step is (plus --typical, or --variable for one variable), on all steps but
--few of them. The free-run bounds stay.

Prints one line per step and a RESULT {json} line (the chief); exit 1 when a bound is exceeded.
"""
import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools", "tf_reference"))
import tf_ctl  # noqa: E402


def dtrain_names(exp):
    """Each Keras layer's dtrain name (config.yaml writes every layer's name)."""
    return [next(iter(entry.values()))["name"] for entry in exp["model"]["layers"]]


def slot_lists(opt):
    """{dtrain's slot name: Keras 3's list of that slot's variables, in the trainable variables'
    order} for Adam, SGD and RMSprop (a checkpoint keeps slot s of a variable at
    optimizer/s/<layer>/<variable>)."""
    kinds = {"Adam": {"m": "_momentums", "v": "_velocities"}, "SGD": {"momentum": "momentums"},
             "RMSprop": {"velocity": "_velocities", "momentum": "_momentums", "average_gradient": "_average_gradients"}}
    if type(opt).__name__ not in kinds:
        sys.exit(f"tf_step_for_step.py: the slots of {type(opt).__name__} are not translated here")
    # Keras makes a slot only where the options need it (SGD's momentum, RMSprop's centered ...).
    return {slot: getattr(opt, attribute) for slot, attribute in kinds[type(opt).__name__].items()
            if getattr(opt, attribute, None)}


def read_checkpoint(path):
    """A dtrain checkpoint's variables and optimizer slots, {dataset path: array}
    (model/<layer>/<variable>, optimizer/<slot>/<layer>/<variable>), and its optimizer's iteration
    count under "iterations"."""
    import h5py
    out = {}
    with h5py.File(path, "r") as f:
        for group in ("model", "optimizer"):
            f[group].visititems(lambda key, item, g=group: out.__setitem__(f"{g}/{key}", item[()])
                                if isinstance(item, h5py.Dataset) else None)
        out["iterations"] = int(f["optimizer"].attrs["iterations"])
    return out


def set_state(loop, names, state=None, initial=None):
    """The variables and the optimizer's state from a checkpoint read by read_checkpoint, or the
    initial weights and fresh slots."""
    import numpy as np
    opt = loop.optimizer
    slots = slot_lists(opt)
    if initial:
        loop.model.load_weights(initial)
        for variables in slots.values():
            for slot in variables:
                slot.assign(np.zeros(slot.shape, np.float32))
        opt.iterations.assign(0)
        return
    for key, variable in state_variables(loop, names):
        variable.assign(state[key])
    opt.iterations.assign(state["iterations"])


def state_variables(loop, names):
    """(key, TensorFlow variable) for every variable of a loop's model and every optimizer slot,
    keyed as read_checkpoint keys a checkpoint's (the iteration count apart)."""
    opt = loop.optimizer
    slots = slot_lists(opt)
    for layer, name in zip(loop.model.layers, names):
        for v in layer.weights:
            yield f"model/{name}/{v.name}", v
            if v.trainable:
                i = opt._get_variable_index(v)
                for slot, variables in slots.items():
                    yield f"optimizer/{slot}/{name}/{v.name}", variables[i]


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


def model_values(loop, names):
    """{<layer>/<variable>: its values in float64} of a loop's model."""
    import numpy as np
    return {f"{name}/{v.name}": np.asarray(v.numpy(), np.float64)
            for layer, name in zip(loop.model.layers, names) for v in layer.weights}


def distances(a, b, apart):
    """({variable: ||a - b|| / ||b||} but those `apart`, the same over those variables together, and
    over the variables `apart` together) for two {variable: values}."""
    import numpy as np
    out, sums = {}, {False: [0.0, 0.0], True: [0.0, 0.0]}
    for key, x in a.items():
        y = np.asarray(b[key], np.float64)
        d, n = float(np.sum((x - y) ** 2)), float(np.sum(y ** 2))
        if key not in apart:
            out[key] = (d / n) ** 0.5 if n > 0 else d ** 0.5
        sums[key in apart][0] += d
        sums[key in apart][1] += n
    overall = lambda d, n: (d / n) ** 0.5 if n > 0 else d ** 0.5
    return out, overall(*sums[False]), overall(*sums[True])


def checkpoint_model(state):
    """{<layer>/<variable>: values} of a checkpoint read by read_checkpoint."""
    return {key[len("model/"):]: values for key, values in state.items() if key.startswith("model/")}


def differences(loop, names, state, apart):
    """distances() of a loop's model from the variables of a checkpoint read by read_checkpoint."""
    return distances(model_values(loop, names), checkpoint_model(state), apart)


def distance(a, b, names, apart):
    """||a - b|| / ||b|| over the variables of two loops' models but those `apart`."""
    return distances(model_values(a, names), model_values(b, names), apart)[1]


def free_run(loop, names, initial, steps, nudge_seed=None):
    """`steps` steps from `initial` with nothing set in between; with `nudge_seed`, every variable
    first moved by one float32 step (ulp) up or down at random: a perturbation the size of one
    rounding."""
    import numpy as np
    set_state(loop, names, initial=initial)
    if nudge_seed is not None:
        rng = np.random.default_rng(nudge_seed)
        for v in loop.model.weights:
            x = np.asarray(v.numpy(), np.float32)
            v.assign(np.nextafter(x, np.where(rng.random(x.shape) < 0.5, -np.inf, np.inf).astype(np.float32)))
    batches = iter(loop.batches())
    for k in range(steps):
        loop.train_step(next(batches), loop.samples_at(k))


def get_state(loop, names):
    """A loop's variables, optimizer slots and iteration count, keyed as read_checkpoint keys a
    checkpoint's."""
    import numpy as np
    out = {key: np.asarray(variable.numpy()) for key, variable in state_variables(loop, names)}
    out["iterations"] = int(loop.optimizer.iterations.numpy())
    return out


def run_with_dtrain_step(loop, names, initial, steps, k, before, after):
    """A free run from `initial` whose step k is dtrain's: TensorFlow's own steps but that one,
    where its state moves by what dtrain's step moved dtrain's (`before` and `after`, the states
    around dtrain's step k as read_checkpoint reads them; `before` None for the initial weights
    and fresh slots)."""
    set_state(loop, names, initial=initial)
    if before is None:
        before = get_state(loop, names)
    batches = iter(loop.batches())
    for j in range(steps):
        batch = next(batches)
        if j != k:
            loop.train_step(batch, loop.samples_at(j))
            continue
        state = get_state(loop, names)
        moved = {key: value + (after[key] - before[key]) for key, value in state.items() if key != "iterations"}
        set_state(loop, names, state=moved | {"iterations": after["iterations"]})


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", required=True)
    ap.add_argument("--initial-weights", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--strategy", choices=["default", "mirrored", "central_storage", "multi_worker"], default="default")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--order", help="dtrain's training order (dtrain order), for a run that shuffles")
    ap.add_argument("--list", type=int, default=0, help="also list the N variables that differ most at each step")
    # The bounds (docs/testing.md, "The anchors"): a typical step agrees to float32 rounding; a step
    # where a relu or max-pooling decision on a value within rounding of its threshold went the
    # other way moves a few weights further; free running, such steps add up.
    ap.add_argument("--typical", type=float, default=1e-6, help="bound of the median step, over the variables")
    ap.add_argument("--worst", type=float, default=1e-4, help="bound of every step, over the variables")
    ap.add_argument("--variable", type=float, default=1e-2, help="bound of any one variable at any step")
    ap.add_argument("--most", type=float, default=1e-5, help="bound of all steps but a few, over the variables")
    ap.add_argument("--few", type=float, default=0.1,
                    help="the share of steps (rounded up) that may exceed --most: steps where a decision flipped")
    ap.add_argument("--free", type=float, default=1e-2,
                    help="bound of the free run from TensorFlow's float32 run or its float64 run, over the variables")
    ap.add_argument("--free-factor", type=float, default=2.0,
                    help="bound of the free run's distance from TensorFlow in float64, as a multiple of the largest "
                         "distance of TensorFlow's float32 runs from it (plus --typical)")
    ap.add_argument("--relative", type=float, default=0.0,
                    help="judge steps against K x TensorFlow float32's own distance from the float64 step (0: the "
                         "fixed bounds)")
    ap.add_argument("--nudged", type=int, default=3,
                    help="TensorFlow float32 runs from the initial variables nudged by one rounding, for the spread")
    ap.add_argument("--worker-process", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.strategy == "multi_worker" and not args.worker_process:
        tf_ctl.launch_workers(args.workers, __file__, sys.argv[1:])
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

    exp = tf_ctl.load_experiment(os.path.join(args.run, "config.yaml"))
    names = dtrain_names(exp)
    # One op thread per process: the two workers share the machine's cores.
    order = tf_ctl.read_order(args.order)
    loop = tf_ctl.Loop(exp, args.strategy, threads=1, workers=args.workers, order=order)
    say = print if tf_ctl.is_chief() else (lambda *a, **k: None)
    say(loop.header(args.strategy), flush=True)
    checkpoint = lambda k: os.path.join(args.run, "checkpoints", f"ckpt-{k}.h5")
    steps_per_epoch = -(-len(loop.x_train) // loop.global_batch)
    if args.steps > steps_per_epoch:
        sys.exit(f"tf_step_for_step.py: --steps {args.steps} is more than one epoch ({steps_per_epoch} steps)")

    apart = per_replica_moving_statistics(exp, loop.replicas)
    # The same steps in float64 (exact arithmetic, for what rounding alone does), under the same
    # strategy, and the free run from the initial weights below.
    exact = tf_ctl.Loop(exp, args.strategy, threads=1, workers=args.workers, strategy=loop.strategy, floatx="float64",
                        order=order)
    overall_by_step, judged_by_step, worst_variable, worst_judged, worst_apart = [], [], ("", 0.0), ("", 0.0), 0.0
    # --relative: each step's excess over K x TensorFlow's distance from the float64 step (over the
    # variables, and the worst variable's, with its name), positive where dtrain is the farther.
    relative_excess, variable_excess = [], ("", -math.inf)
    batches, exact_batches = iter(loop.batches()), iter(exact.batches())
    before = dict(initial=args.initial_weights)  # then dtrain's state after the step before
    for k in range(args.steps):
        after = read_checkpoint(checkpoint(k + 1))
        ours = checkpoint_model(after)
        set_state(loop, names, **before)
        loop.train_step(next(batches), loop.samples_at(k))
        theirs = model_values(loop, names)
        per_variable, overall, moving = distances(theirs, ours, apart)
        # The same step from the same state in float64. A gradient that is a sum which nearly
        # cancels (a convolution's bias below tanh and batch normalization) comes out of any
        # float32 step with a relative error far above a typical one, TensorFlow's included: dtrain
        # is judged against the nearer of TensorFlow's float32 step and this exact one.
        set_state(exact, names, **before)
        exact.train_step(next(exact_batches), exact.samples_at(k))
        exact_values = model_values(exact, names)
        from_exact, overall_from_exact, _ = distances(exact_values, ours, apart)
        tf_from_exact, tf_overall_from_exact, _ = distances(theirs, exact_values, apart)
        judged = {v: min(d, from_exact[v]) for v, d in per_variable.items()}
        relative_excess.append(overall_from_exact - args.relative * tf_overall_from_exact)
        variable_excess = max([variable_excess] + [(v, from_exact[v] - args.relative * tf_from_exact[v])
                                                   for v in from_exact], key=lambda item: item[1])
        name, largest = max(per_variable.items(), key=lambda item: item[1])
        say(f"step {k + 1:3d} ({int(loop.samples_at(k))} samples): ||tf - dtrain|| / ||dtrain|| {overall:.2e} over the "
            f"variables, largest {largest:.2e} ({name}); from the float64 step: dtrain {overall_from_exact:.2e}, "
            f"TensorFlow float32 {tf_overall_from_exact:.2e}"
            + (f"; per-replica moving statistics {moving:.2e}" if apart else ""), flush=True)
        for variable, value in sorted(per_variable.items(), key=lambda item: -item[1])[:args.list]:
            say(f"    {variable} {value:.2e}; from the float64 step: dtrain {from_exact[variable]:.2e}, TensorFlow "
                f"float32 {tf_from_exact[variable]:.2e}")
        overall_by_step.append(overall)
        judged_by_step.append(min(overall, overall_from_exact))
        worst_variable = max(worst_variable, (name, largest), key=lambda item: item[1])
        worst_judged = max(worst_judged, max(judged.items(), key=lambda item: item[1]), key=lambda item: item[1])
        worst_apart = max(worst_apart, moving)
        before = dict(state=after)

    free_run(loop, names, args.initial_weights, args.steps)
    last = read_checkpoint(checkpoint(args.steps))
    per_variable, free, _ = differences(loop, names, last, apart)
    say(f"free running, {args.steps} steps: ||tf - dtrain|| / ||dtrain|| {free:.2e} over the variables, largest "
        f"{max(per_variable.values()):.2e} ({max(per_variable, key=per_variable.get)})")
    # How far float32 rounding alone carries this training from exact arithmetic in N steps: the
    # same free run in float64 under the same strategy, against TensorFlow's float32 run and the
    # same run from variables each nudged by one rounding (--nudged runs). Training is chaotic
    # enough here that one relu or pooling decision taken the other way moves a run by 1e-4 or
    # more; whether it happens is chance, so the bound is the spread of TensorFlow's own float32
    # runs, and dtrain's free run is held to it.
    free_run(exact, names, args.initial_weights, args.steps)
    _, dtrain_from_exact, _ = differences(exact, names, last, apart)
    tf_from_exact = [distance(loop, exact, names, apart)]
    for seed in range(args.nudged):
        free_run(loop, names, args.initial_weights, args.steps, nudge_seed=seed)
        tf_from_exact.append(distance(loop, exact, names, apart))
    above_most = sum(1 for d in judged_by_step if d > args.most)
    allowed_above = math.ceil(args.few * len(judged_by_step))
    # A step where dtrain took a threshold decision the other way (judged above --most, and allowed
    # as one of the --few) moves its free run as a nudge would; whether TensorFlow's four runs
    # happen to flip one too is chance, the rarer the fewer the steps. So TensorFlow also runs
    # free with that one step taken as dtrain took it (its state moved by dtrain's update), and
    # where that lands from the float64 run joins the spread: dtrain's other steps are still
    # judged by whether they carry it further than TensorFlow's own do.
    # (Under --relative, the steps beyond K x TensorFlow's distance.)
    flipped = [k for k, d in enumerate(judged_by_step) if d > args.most] if not args.relative else \
        [k for k, e in enumerate(relative_excess) if e > args.typical]
    flips = flipped if len(flipped) <= allowed_above else []
    tf_after_flip = []
    for k in flips:
        before_flip = read_checkpoint(checkpoint(k)) if k > 0 else None
        run_with_dtrain_step(loop, names, args.initial_weights, args.steps, k, before_flip,
                             read_checkpoint(checkpoint(k + 1)))
        tf_after_flip.append(distance(loop, exact, names, apart))
    spread = max(tf_from_exact + tf_after_flip)
    say(f"free running from exact arithmetic (TensorFlow in float64), {args.steps} steps, ||run - float64|| / "
        f"||float64||: dtrain {dtrain_from_exact:.2e}; TensorFlow float32 {tf_from_exact[0]:.2e}, nudged by one "
        f"rounding {', '.join(f'{d:.2e}' for d in tf_from_exact[1:])}"
        + "".join(f"; with dtrain's step {k + 1} (a decision flipped) {d:.2e}"
                  for k, d in zip(flips, tf_after_flip)))
    median = lambda values: sorted(values)[len(values) // 2]
    say("RESULT " + json.dumps({"strategy": args.strategy, "steps": args.steps,
                                "step_for_step_median": median(overall_by_step),
                                "step_for_step_worst": max(overall_by_step),
                                "steps_above_1e-5": sum(1 for d in overall_by_step if d > 1e-5),
                                "worst_variable": worst_variable[1], "worst_variable_name": worst_variable[0],
                                "judged_median": median(judged_by_step), "judged_worst": max(judged_by_step),
                                "judged_steps_above_most": above_most, "judged_worst_variable": worst_judged[1],
                                "judged_worst_variable_name": worst_judged[0],
                                "per_replica_moving_statistics": worst_apart if apart else None,
                                "free_running": free, "free_running_dtrain_from_float64": dtrain_from_exact,
                                "free_running_tf_from_float64": tf_from_exact,
                                "free_running_tf_after_flips_from_float64": tf_after_flip,
                                "relative": args.relative or None,
                                "relative_worst_step_excess": max(relative_excess),
                                "relative_worst_variable_excess": variable_excess[1],
                                "relative_worst_variable_name": variable_excess[0]}), flush=True)
    # Each figure is dtrain's distance from the nearer of TensorFlow's float32 result and the same
    # computation in float64 ("judged", step for step; the free run likewise).
    if args.relative:
        # What dtrain's float32 step adds to the float64 step's distance beyond K x TensorFlow's.
        step_bounds = [(f"step for step, steps farther from float64 than {args.relative:g} x TensorFlow's",
                        len(flipped), allowed_above),
                       (f"step for step, one variable ({variable_excess[0]}) from float64 beyond "
                        f"{args.relative:g} x TensorFlow's", variable_excess[1], args.variable)]
    else:
        step_bounds = [("step for step, the median step", median(judged_by_step), args.typical),
                       ("step for step, the worst step", max(judged_by_step), args.worst),
                       (f"step for step, steps above {args.most:.0e}", above_most, allowed_above),
                       (f"step for step, one variable ({worst_judged[0]})", worst_judged[1], args.variable)]
    failed = [f"{what} {value:.3g} > {bound:.3g}" for what, value, bound in
              step_bounds + [("free running", min(free, dtrain_from_exact), args.free),
               ("free running, dtrain from float64 against TensorFlow float32's spread", dtrain_from_exact,
                args.free_factor * spread + args.typical)] if value > bound]
    if failed:
        say("FAIL: " + "; ".join(failed), file=sys.stderr)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
