#!/usr/bin/python3
"""Write data/fashion_mnist_small.h5: the first 2000 training and the first 500 test images of
Fashion-MNIST, in the HDF5 layout dtrain's `source: hdf5` reads (groups /train and /test, each
with datasets x (N, 28, 28, 1) uint8 and y (N,) uint8, and attribute num_classes).

Usage: tools/make_subset.py [--source DIR] [--output FILE] [--train N] [--test N]

Deterministic: the same inputs give the same content, and (timestamps off, fixed chunking and
compression) the same bytes with a given h5py/HDF5 version.
"""
import argparse
import gzip
import hashlib
import os
import sys

import h5py
import numpy as np

DEFAULT_SOURCE = "/usr/share/datasets/fashion-mnist"
NUM_CLASSES = 10


def read_idx_gz(path):
    """One gzip-compressed IDX file as a numpy array (ubyte elements only, as Fashion-MNIST has)."""
    with gzip.open(path, "rb") as f:
        raw = f.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        sys.exit(f"{path}: not a ubyte IDX file (magic {raw[:4].hex()})")
    rank = raw[3]
    dims = [int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(rank)]
    offset = 4 + 4 * rank
    count = int(np.prod(dims))
    if len(raw) - offset != count:
        sys.exit(f"{path}: header promises {count} bytes of data, file has {len(raw) - offset}")
    return np.frombuffer(raw, dtype=np.uint8, offset=offset).reshape(dims)


def sha256(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def take(source, prefix, count):
    images_path = os.path.join(source, f"{prefix}-images-idx3-ubyte.gz")
    labels_path = os.path.join(source, f"{prefix}-labels-idx1-ubyte.gz")
    images = read_idx_gz(images_path)
    labels = read_idx_gz(labels_path)
    if images.shape[0] != labels.shape[0]:
        sys.exit(f"{images_path} and {labels_path} hold different counts")
    if count > images.shape[0]:
        sys.exit(f"{prefix}: asked for {count} examples, the files hold {images.shape[0]}")
    x = images[:count].reshape(count, images.shape[1], images.shape[2], 1)
    y = labels[:count].astype(np.uint8)
    missing = sorted(set(range(NUM_CLASSES)) - set(int(v) for v in y))
    if missing:
        sys.exit(f"{prefix}: the first {count} examples lack classes {missing}; take more examples")
    if int(y.max()) >= NUM_CLASSES:
        sys.exit(f"{prefix}: label {int(y.max())} is not below {NUM_CLASSES}")
    return x, y, (images_path, labels_path), images.shape[0]


def write_group(out, name, x, y, sources, total):
    group = out.create_group(name, track_order=False)
    for key, data in (("x", x), ("y", y)):
        chunks = (min(500, data.shape[0]),) + data.shape[1:]
        group.create_dataset(key, data=data, chunks=chunks, compression="gzip", compression_opts=9,
                             shuffle=False, track_times=False)
    group.attrs["num_classes"] = np.int32(NUM_CLASSES)
    group.attrs["examples"] = np.int64(x.shape[0])
    group.attrs["source_images"] = os.path.basename(sources[0])
    group.attrs["source_labels"] = os.path.basename(sources[1])
    group.attrs["source_images_sha256"] = sha256(sources[0])
    group.attrs["source_labels_sha256"] = sha256(sources[1])
    group.attrs["selection"] = f"the first {x.shape[0]} of {total} examples, in file order"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    here = os.path.dirname(os.path.abspath(__file__))
    parser.add_argument("--source", default=DEFAULT_SOURCE, help="directory with the Fashion-MNIST .gz IDX files")
    parser.add_argument("--output", default=os.path.join(here, "..", "data", "fashion_mnist_small.h5"))
    parser.add_argument("--train", type=int, default=2000)
    parser.add_argument("--test", type=int, default=500)
    args = parser.parse_args()

    train = take(args.source, "train", args.train)
    test = take(args.source, "t10k", args.test)

    output = os.path.normpath(args.output)
    temporary = output + ".tmp"
    with h5py.File(temporary, "w", libver="earliest", track_order=False) as out:
        out.attrs["description"] = "Fashion-MNIST subset for dtrain tests and quick runs (made by tools/make_subset.py)"
        out.attrs["origin"] = "Fashion-MNIST, Zalando Research (https://github.com/zalandoresearch/fashion-mnist), MIT license"
        write_group(out, "train", *train)
        write_group(out, "test", *test)
    os.replace(temporary, output)
    print(f"wrote {output}: train {train[0].shape}, test {test[0].shape}, {os.path.getsize(output)} bytes")


if __name__ == "__main__":
    main()
