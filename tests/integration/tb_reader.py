"""A run's event files read by TensorBoard itself (its EventAccumulator, from the `tensorboard`
package that tools/setup installs into build/venv), against <run dir>/metrics.jsonl.

  tb_reader.py RUN_DIR --since EPOCH_SECONDS --until EPOCH_SECONDS

Every epoch scalar of metrics.jsonl must be there under its tag at its global step (to float32),
each tag's steps strictly increasing as TensorBoard shows them (a resumed run's START event purges
what came after it), and every wall time inside [since, until]: the run's own clock. Exits 1 naming
what differs.
"""
import argparse
import json
import math
import os
import sys

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def fail(message):
    print(f"tb_reader.py: {message}", file=sys.stderr)
    sys.exit(1)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("--since", type=float, required=True)
    parser.add_argument("--until", type=float, required=True)
    args = parser.parse_args()

    accumulator = EventAccumulator(os.path.join(args.run_dir, "tensorboard"), size_guidance={"scalars": 0})
    accumulator.Reload()
    tags = accumulator.Tags()["scalars"]
    scalars = {tag: accumulator.Scalars(tag) for tag in tags}
    for tag, events in scalars.items():
        steps = [e.step for e in events]
        if steps != sorted(set(steps)):
            fail(f"{tag}: TensorBoard shows steps {steps}, not strictly increasing")
        for e in events:
            if not args.since <= e.wall_time <= args.until:
                fail(f"{tag} at step {e.step}: wall time {e.wall_time} outside the run's [{args.since}, {args.until}]")

    with open(os.path.join(args.run_dir, "metrics.jsonl")) as f:
        epochs = [json.loads(line) for line in f]
    pairs = [("train/loss", "loss"), ("train/accuracy", "accuracy"), ("validation/loss", "val_loss"),
             ("validation/accuracy", "val_accuracy"), ("test/loss", "test_loss"), ("test/accuracy", "test_accuracy"),
             ("train/samples_per_second", "train_samples_per_s")]
    checked = 0
    for tag, key in pairs:
        want = {e["global_step"]: e[key] for e in epochs if key in e}
        got = {e.step: e.value for e in scalars.get(tag, [])}
        if sorted(got) != sorted(want):
            fail(f"{tag}: TensorBoard has steps {sorted(got)}, metrics.jsonl has {key} at {sorted(want)}")
        for step, value in want.items():
            if not math.isclose(got[step], value, rel_tol=2e-6, abs_tol=0.01 if key == "train_samples_per_s" else 1e-6):
                fail(f"{tag} at step {step}: TensorBoard reads {got[step]!r}, metrics.jsonl {value!r}")
            checked += 1
    print(f"TensorBoard's reader: {len(tags)} tags ({', '.join(sorted(tags))}); {checked} epoch scalars match "
          f"metrics.jsonl over {len(epochs)} epochs")


if __name__ == "__main__":
    main()
