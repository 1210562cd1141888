"""Runs an ONNX graph written by `dtrain export` in ONNX Runtime on the samples `dtrain eval
--predictions` wrote, and compares: the graph's declared input and output, the logits (within
--rtol of the larger of the sample's largest logit and the split's mean one: an output near zero,
a regression's say, is a sum that cancels and carries rounding of its terms' size), and the accuracy against the one eval printed (a
class model's; left out without --accuracy).

  build/venv/bin/python tests/integration/onnx_check.py MODEL.onnx PREDICTIONS.h5 [--accuracy 84.20]
      [--softmax] [--rtol 1e-5]

Prints one line of figures; exit 1 with the reason when something differs.
"""
import argparse
import sys

import h5py
import numpy as np


def relative_difference(got, want):
    """Per sample, the largest |got - want| over the larger of the sample's largest |want| and the
    split's mean one (an output near zero, a regression's say, is a sum that cancels and carries
    rounding of its terms' size). Also tests/anchors/random_models.py's measure."""
    scale = np.abs(want).reshape(len(want), -1).max(axis=1)
    scale = np.maximum(scale, max(scale.mean(), np.finfo(np.float32).tiny))
    return np.abs(got - want).reshape(len(want), -1).max(axis=1) / scale


def main():
    import onnxruntime as ort

    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("predictions")
    parser.add_argument("--accuracy", type=float, help="dtrain eval's Test Accuracy (percent), for a class model")
    parser.add_argument("--softmax", action="store_true", help="the graph ends in a Softmax")
    parser.add_argument("--rtol", type=float, default=1e-5)
    args = parser.parse_args()

    with h5py.File(args.predictions, "r") as f:
        x = f["inputs"][...]
        want = f["logits"][...]
        labels = f["labels"][...]

    session = ort.InferenceSession(args.model, providers=["CPUExecutionProvider"])
    inputs, outputs = session.get_inputs(), session.get_outputs()
    problems = []
    out_name = "probabilities" if args.softmax else "logits"
    if [i.name for i in inputs] != ["input"] or [o.name for o in outputs] != [out_name]:
        problems.append(f"inputs {[i.name for i in inputs]}, outputs {[o.name for o in outputs]}")
    if inputs[0].shape != ["N", *x.shape[1:]] or inputs[0].type != "tensor(float)":
        problems.append(f"input shape {inputs[0].shape} {inputs[0].type}, data {x.shape}")
    if outputs[0].shape != ["N", *want.shape[1:]]:
        problems.append(f"output shape {outputs[0].shape}, dtrain's {want.shape}")

    # Two batch sizes: the whole split at once, and an odd one, to use the dynamic batch.
    got = session.run([out_name], {"input": x})[0]
    got_17 = np.concatenate([session.run([out_name], {"input": x[i:i + 17]})[0] for i in range(0, len(x), 17)])
    if args.softmax:
        shifted = np.exp(want - want.max(axis=-1, keepdims=True))
        want = shifted / shifted.sum(axis=-1, keepdims=True)
    per_sample = relative_difference(got, want)
    rel, rel_17 = per_sample.max(), relative_difference(got_17, want).max()
    compared = ""
    if args.accuracy is not None:
        accuracy = 100.0 * np.mean(np.argmax(got.reshape(len(got), -1), axis=1) == labels)
        compared = f", Test Accuracy {accuracy:.2f} (dtrain eval {args.accuracy:.2f})"
    print(f"onnxruntime {ort.__version__}: {len(x)} samples{compared}, max relative logit difference {max(rel, rel_17):.2e}")
    if not rel <= args.rtol or not rel_17 <= args.rtol:
        worst = int(np.argmax(per_sample))
        problems.append(f"logits differ by {max(rel, rel_17):.2e} relative (> {args.rtol}); sample {worst}: "
                        f"onnxruntime {got[worst].ravel()[:10]}, dtrain {want[worst].ravel()[:10]}")
    if args.accuracy is not None and f"{accuracy:.2f}" != f"{args.accuracy:.2f}":
        problems.append(f"accuracy {accuracy:.2f} against dtrain eval's {args.accuracy:.2f}")
    for p in problems:
        print(f"onnx_check: {args.model}: {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
