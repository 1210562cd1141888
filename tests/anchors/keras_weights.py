#!/usr/bin/env python3
"""Keras 3 on dtrain's weights, both ways (tests/anchors/anchors.sh keras_weights).

  keras_weights.py evaluate EXPERIMENT WEIGHTS.weights.h5
      builds the experiment's model in Keras, model.load_weights(WEIGHTS) and prints
      "Keras Test Loss: L, Test Accuracy: A" from model.evaluate on the experiment's test split (L
      without the L2 penalties that evaluate adds, as dtrain's Test Loss)
  keras_weights.py save EXPERIMENT WEIGHTS.weights.h5 [--seed S]
      builds the experiment's model in Keras with Keras' own initializers (keras.utils.set_random_seed)
      and model.save_weights(WEIGHTS): a start for dtrain's model.initial_weights
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools", "tf_reference"))
import tf_ctl  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("action", choices=["evaluate", "save"])
    ap.add_argument("experiment")
    ap.add_argument("weights")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras

    exp = tf_ctl.load_experiment(args.experiment)
    if args.action == "save":
        keras.utils.set_random_seed(args.seed)
        tf_ctl.build_model(exp["model"]).save_weights(args.weights)
        print(f"saved {args.weights}")
        return
    model = tf_ctl.build_model(exp["model"])
    model.load_weights(args.weights)
    loss = exp.get("loss", {})
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=loss.get("from_logits", False)),
                  metrics=[keras.metrics.SparseCategoricalAccuracy()])
    _, _, x_test, y_test = tf_ctl.load_data(exp.get("data", {}))
    test_loss, accuracy = model.evaluate(x_test, y_test, batch_size=256, verbose=0)
    # Keras' evaluate adds the model's regularization losses (the L2 penalties) to the loss it
    # reports; dtrain's Test Loss is the per-example losses' mean alone.
    penalties = float(sum(float(loss) for loss in model.losses))
    print(f"Keras Test Loss: {test_loss - penalties:.4f}, Test Accuracy: {accuracy * 100:.2f} "
          f"(evaluate's loss {test_loss:.4f} holds the L2 penalties, {penalties:.4f})")


if __name__ == "__main__":
    main()
