#!/usr/bin/python3
"""Reads a run's TensorBoard event files as TensorBoard would, and checks them.

  tfevents.py RUN_DIR [--files N] [--step-every K] [--resumed-at STEP] [--workdir DIR]

The protocol buffers are dtrain's copy of TensorFlow's schema (lib/observe/proto), compiled here with
protoc --python_out and read with Python's protobuf. Every record's length CRC and data CRC are
checked (TFRecord: masked CRC-32C, computed here independently of dtrain's), every file starts with
the file_version event, and the epoch scalars must equal <run dir>/metrics.jsonl (to float32); with
--step-every K the step losses are at every K-th global step, and with K = 1 each epoch's mean of
them is the epoch's loss. Exits 1 naming what differs.
"""
import argparse
import glob
import json
import math
import os
import struct
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROTO = os.path.join(ROOT, "lib", "observe", "proto")


def fail(message):
    print(f"tfevents.py: {message}", file=sys.stderr)
    sys.exit(1)


def crc32c(data):
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
    return crc ^ 0xFFFFFFFF


def masked(data):
    crc = crc32c(data)
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF


def records(path):
    with open(path, "rb") as f:
        raw = f.read()
    at = 0
    while at < len(raw):
        if at + 12 > len(raw):
            fail(f"{path}: truncated header at byte {at}")
        header = raw[at:at + 8]
        (length,) = struct.unpack("<Q", header)
        (length_crc,) = struct.unpack("<I", raw[at + 8:at + 12])
        if length_crc != masked(header):
            fail(f"{path}: the length CRC at byte {at} is {length_crc:#x}, wanted {masked(header):#x}")
        data = raw[at + 12:at + 12 + length]
        if len(data) != length or at + 16 + length > len(raw):
            fail(f"{path}: truncated record at byte {at}")
        (data_crc,) = struct.unpack("<I", raw[at + 12 + length:at + 16 + length])
        if data_crc != masked(data):
            fail(f"{path}: the data CRC of the record at byte {at} is {data_crc:#x}, wanted {masked(data):#x}")
        yield data
        at += 16 + length


def close(a, b, what):
    if not math.isclose(a, b, rel_tol=2e-6, abs_tol=1e-6):
        fail(f"{what}: the event file says {a!r}, wanted {b!r}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("--files", type=int, default=1)
    parser.add_argument("--step-every", type=int, default=0)
    parser.add_argument("--resumed-at", type=int)
    parser.add_argument("--learning-rate", type=float)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="dtrain_tfevents_") as out:
        subprocess.run(["protoc", f"-I{PROTO}", f"--python_out={out}",
                        "tensorflow/core/framework/summary.proto", "tensorflow/core/util/event.proto"], check=True)
        sys.path.insert(0, out)
        from tensorflow.core.util import event_pb2  # generated just now; loaded before the directory goes

    files = sorted(glob.glob(os.path.join(args.run_dir, "tensorboard", "events.out.tfevents.*")))
    if len(files) != args.files:
        fail(f"{len(files)} event files in {args.run_dir}/tensorboard, wanted {args.files}: {files}")
    scalars = {}  # tag -> {step: value}; a later file's value replaces an earlier one's
    for index, path in enumerate(files):
        events = []
        for data in records(path):
            event = event_pb2.Event()
            event.ParseFromString(data)
            events.append(event)
        if not events or events[0].file_version != "brain.Event:2":
            fail(f"{path}: does not start with the file_version event")
        rest = events[1:]
        if index > 0 and args.resumed_at is not None:
            start = rest.pop(0) if rest else None
            if not start or start.session_log.status != event_pb2.SessionLog.START or start.step != args.resumed_at + 1:
                fail(f"{path}: a resumed run's file must say START at step {args.resumed_at + 1} after its version")
        for event in rest:
            if not event.HasField("summary"):
                fail(f"{path}: an event at step {event.step} without a summary")
            for value in event.summary.value:
                scalars.setdefault(value.tag, {})[event.step] = value.simple_value
        print(f"{os.path.basename(path)}: {len(events)} events, CRCs good")

    with open(os.path.join(args.run_dir, "metrics.jsonl")) as f:
        epochs = [json.loads(line) for line in f]
    pairs = [("train/loss", "loss"), ("train/accuracy", "accuracy"), ("validation/loss", "val_loss"),
             ("validation/accuracy", "val_accuracy"), ("test/loss", "test_loss"), ("test/accuracy", "test_accuracy")]
    for tag, key in pairs:
        want = {e["global_step"]: e[key] for e in epochs if key in e}
        got = scalars.get(tag, {})
        if sorted(got) != sorted(want):
            fail(f"{tag} at steps {sorted(got)}, metrics.jsonl has {key} at {sorted(want)}")
        for step, value in want.items():
            close(got[step], value, f"{tag} at step {step}")
    for e in epochs:
        step = e["global_step"]
        if not math.isclose(scalars["train/samples_per_second"][step], e["train_samples_per_s"], abs_tol=0.01, rel_tol=1e-5):
            fail(f"train/samples_per_second at step {step}: {scalars['train/samples_per_second'][step]}, "
                 f"metrics.jsonl {e['train_samples_per_s']}")
        if args.learning_rate is not None:
            close(scalars["train/learning_rate"][step], args.learning_rate, f"train/learning_rate at step {step}")
    steps = scalars.get("train/step_loss", {})
    if args.step_every:
        last = epochs[-1]["global_step"]
        if sorted(steps) != list(range(args.step_every, last + 1, args.step_every)):
            fail(f"train/step_loss at steps {sorted(steps)}, wanted every {args.step_every} up to {last}")
        if args.step_every == 1:
            first = 1
            for e in epochs:
                losses = [steps[s] for s in range(first, e["global_step"] + 1)]
                close(sum(losses) / len(losses), e["loss"], f"the mean step loss of epoch {e['epoch']}")
                first = e["global_step"] + 1
    elif steps:
        fail("train/step_loss written though log_every_steps is 0")
    print(f"{len(epochs)} epochs match metrics.jsonl; {len(steps)} step losses; tags: {', '.join(sorted(scalars))}")


if __name__ == "__main__":
    main()
