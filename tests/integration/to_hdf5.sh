#!/usr/bin/env bash
# tools/to_hdf5 end to end: generated inputs of each kind are converted and dtrain trains an epoch
# on the result; bad inputs stop with exit 2 and a message naming the file and row.
#   tests/integration/to_hdf5.sh CASE DTRAIN_BINARY SCRATCH_DIR
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh" "$@"
py=/usr/bin/python3
to_hdf5=tools/to_hdf5

# A small MLP for any (H, W, C) input and K classes, one epoch.
experiment() {  # file h5 input_shape classes [extra data keys]
  cat >"$1" <<EOF
name: own_data
seed: 42
data: {source: hdf5, path: $2, batch_size_per_replica: 32, shuffle_buffer: 1000$5}
model:
  input_shape: $3
  layers:
    - flatten: {}
    - dense: {units: 32, activation: relu}
    - dense: {units: $4}
loss: {kind: sparse_categorical_crossentropy, from_logits: true, reduction: none}
optimizer: {kind: adam, learning_rate: 0.01}
metrics: [sparse_categorical_accuracy]
train: {epochs: 1, threads: 1}
checkpoint: {every_epochs: 0}
EOF
}

# expect_bad REGEX -- ARGS...: to_hdf5 exits 2 with one stderr line matching REGEX, no traceback.
expect_bad() {
  local regex=$1; shift 2
  "$to_hdf5" "$@" >"$scratch/out" 2>"$scratch/err"
  local rc=$?
  cat "$scratch/err"
  [ "$rc" -eq 2 ] || fail "exit code $rc, wanted 2, for: $*"
  [ "$(wc -l <"$scratch/err")" -eq 1 ] || fail "wanted a one-line error, got: $(cat "$scratch/err")"
  grep -Eq -- "$regex" "$scratch/err" || fail "error does not match /$regex/: $(cat "$scratch/err")"
}

case "$case_name" in
  convert_and_train)
    # 300 PNG images (and a few JPEGs) in 3 class folders, of mixed sizes and modes: class k is
    # a bright band at rows 4k..4k+3, so a model can learn it.
    $py - "$scratch" <<'EOF' || fail "cannot generate the inputs"
import csv, os, sys
import numpy as np
from PIL import Image
root = sys.argv[1]
rng = np.random.default_rng(1)
for k, name in enumerate(["circle", "square", "triangle"]):
    os.makedirs(f"{root}/images/{name}")
    for i in range(100):
        size = (16, 16) if i % 2 else (24, 20)
        a = rng.integers(0, 60, size=size + (3,), dtype=np.uint8)
        a[k * size[0] // 3:(k + 1) * size[0] // 3] = 230
        ext = "jpg" if i % 25 == 0 else "png"
        Image.fromarray(a if i % 3 else a[..., 0]).save(f"{root}/images/{name}/{i:03d}.{ext}")
open(f"{root}/images/circle/notes.txt", "w").write("not an image")
# CSV: 4 features, the label column in the middle.
with open(f"{root}/iris.csv", "w", newline="") as f:
    w = csv.writer(f)
    w.writerow(["a", "b", "species", "c", "d"])
    for i in range(240):
        k = i % 3
        v = rng.normal(size=4) + 3 * k
        w.writerow([f"{v[0]:.3f}", f"{v[1]:.3f}", k, f"{v[2]:.3f}", f"{v[3]:.3f}"])
# npz in Keras' mnist.npz layout, uint8 images (N, 8, 8).
x = rng.integers(0, 256, size=(300, 8, 8), dtype=np.uint8)
y = (x[:, :4].mean(axis=(1, 2)) > x[:, 4:].mean(axis=(1, 2))).astype(np.uint8)
np.savez(f"{root}/own.npz", x_train=x[:240], y_train=y[:240], x_test=x[240:], y_test=y[240:])
np.save(f"{root}/x.npy", x.astype(np.float32) / 255)
np.save(f"{root}/y.npy", y.astype(np.int64))
EOF
    "$to_hdf5" images "$scratch/images" --shape 12 12 --output "$scratch/images.h5" --validation-fraction 0.2 \
      >"$scratch/out" || fail "images did not convert"
    cat "$scratch/out"
    grep -q "ignored 1 files" "$scratch/out" || fail "the non-image file is not reported"
    grep -q "validation_split: 0.2" "$scratch/out" || fail "the data section to paste lacks validation_split"
    $py - "$scratch/images.h5" <<'EOF' || fail "images.h5 has the wrong layout"
import sys, h5py, numpy as np
with h5py.File(sys.argv[1]) as f:
    tr, te = f["train"], f["test"]
    assert tr["x"].shape == (240, 12, 12, 1) and tr["x"].dtype == np.uint8, tr["x"].shape
    assert te["x"].shape == (60, 12, 12, 1), te["x"].shape
    assert tr["y"].dtype == np.int32 and int(tr.attrs["num_classes"]) == 3
    assert [s.decode() if isinstance(s, bytes) else s for s in tr.attrs["class_names"]] == ["circle", "square", "triangle"]
    # Stratified: /test and the validation tail (the last 48 of 240) hold 20 and 16 of each class.
    assert np.bincount(te["y"][()]).tolist() == [20, 20, 20], np.bincount(te["y"][()])
    assert np.bincount(tr["y"][-48:]).tolist() == [16, 16, 16], np.bincount(tr["y"][-48:])
    assert abs(float(tr.attrs["validation_split"]) - 0.2) < 1e-12
EOF
    experiment "$scratch/images.yaml" "$scratch/images.h5" "[12, 12, 1]" 3 ", validation_split: 0.2"
    "$dtrain" run "$scratch/images.yaml" --run-dir "$scratch/run_images" >"$scratch/train" || fail "dtrain did not train on images.h5"
    cat "$scratch/train"
    grep -Eq '^Epoch 1, Loss: [0-9.]+, Accuracy: [0-9.]+, Validation Loss: [0-9.]+, Validation Accuracy: [0-9.]+, Test Loss' \
      "$scratch/train" || fail "no epoch line with validation figures"
    grep -q '(6 steps' "$scratch/train" || fail "192 training images at batch 32 make 6 steps"
    # RGB with an explicit test folder and shards through tools/make_shards.
    "$to_hdf5" images "$scratch/images" --shape 10 10 --color rgb --test "$scratch/images" --shards 2 \
      --output "$scratch/rgb.h5" >"$scratch/out" || fail "rgb images did not convert"
    cat "$scratch/out"
    for i in 0 1; do [ -f "$scratch/rgb-0000$i-of-00002.h5" ] || fail "shard $i missing"; done
    $py -c "import h5py,sys; f=h5py.File(sys.argv[1]); assert f['train/x'].shape==(150,10,10,3), f['train/x'].shape" \
      "$scratch/rgb-00000-of-00002.h5" || fail "shard 0 has the wrong shape"

    "$to_hdf5" csv "$scratch/iris.csv" --label species --output "$scratch/csv.h5" >"$scratch/out" || fail "csv did not convert"
    cat "$scratch/out"
    $py -c "import h5py,sys; f=h5py.File(sys.argv[1]); assert f['train/x'].shape==(192,4) and f['train/x'].dtype=='float32'" \
      "$scratch/csv.h5" || fail "csv.h5 has the wrong layout"
    experiment "$scratch/csv.yaml" "$scratch/csv.h5" "[4]" 3 ""
    "$dtrain" run "$scratch/csv.yaml" --run-dir "$scratch/run_csv" >"$scratch/train" || fail "dtrain did not train on csv.h5"
    grep -E '^Epoch 1' "$scratch/train" || fail "no epoch line for csv.h5"

    "$to_hdf5" npz "$scratch/own.npz" --output "$scratch/npz.h5" >"$scratch/out" || fail "npz did not convert"
    $py -c "import h5py,sys; f=h5py.File(sys.argv[1]); assert f['train/x'].shape==(240,8,8) and f['test/x'].shape==(60,8,8) and f['train/x'].dtype=='uint8'" \
      "$scratch/npz.h5" || fail "npz.h5 keeps neither the npz's split nor its uint8 images"
    experiment "$scratch/npz.yaml" "$scratch/npz.h5" "[8, 8, 1]" 2 ""
    "$dtrain" run "$scratch/npz.yaml" --run-dir "$scratch/run_npz" >"$scratch/train" || fail "dtrain did not train on npz.h5"
    grep -E '^Epoch 1' "$scratch/train" || fail "no epoch line for npz.h5"

    "$to_hdf5" npy "$scratch/x.npy" "$scratch/y.npy" --shape 64 --output "$scratch/npy.h5" >"$scratch/out" || fail "npy did not convert"
    $py -c "import h5py,sys; f=h5py.File(sys.argv[1]); assert f['train/x'].shape==(240,64) and f['train/x'].dtype=='float32'" \
      "$scratch/npy.h5" || fail "npy.h5 has the wrong layout"
    ;;
  bad_inputs)
    $py - "$scratch" <<'EOF' || fail "cannot generate the inputs"
import os, sys
import numpy as np
from PIL import Image
root = sys.argv[1]
for name in ("a", "b"):
    os.makedirs(f"{root}/images/{name}")
    for i in range(3):
        Image.fromarray(np.zeros((8, 8), dtype=np.uint8)).save(f"{root}/images/{name}/{i}.png")
open(f"{root}/images/b/broken.png", "wb").write(b"\x89PNG\r\n\x1a\n not really")
open(f"{root}/cells.csv", "w").write("f1,f2,label\n1,2,0\n3,4,1\n5,x7,1\n")
open(f"{root}/short.csv", "w").write("f1,f2,label\n1,2,0\n3,1\n")
open(f"{root}/range.csv", "w").write("f1,f2,label\n1,2,0\n3,4,1\n5,6,-1\n")
np.save(f"{root}/x.npy", np.zeros((10, 4), dtype=np.float32))
np.save(f"{root}/y9.npy", np.zeros(9, dtype=np.int64))
np.save(f"{root}/y_big.npy", np.array([0, 1, 2, 3, 4, 5, 6, 7, 8, 12]))
np.save(f"{root}/ragged.npy", np.array([np.zeros(3), np.zeros(4)], dtype=object), allow_pickle=True)
np.savez(f"{root}/mismatch.npz", x_train=np.zeros((10, 4)), y_train=np.zeros(10, dtype=int),
         x_test=np.zeros((5, 3)), y_test=np.zeros(5, dtype=int))
EOF
    expect_bad "images/b/broken\.png: not a readable PNG or JPEG image" -- images "$scratch/images" --shape 8 8 -o "$scratch/o.h5"
    expect_bad "cells\.csv:4: column 'f2' holds 'x7', not a number" -- csv "$scratch/cells.csv" --label label -o "$scratch/o.h5"
    expect_bad "short\.csv:3: 2 cells, the header has 3 columns" -- csv "$scratch/short.csv" --label label -o "$scratch/o.h5"
    expect_bad "cells\.csv: no column 'species'" -- csv "$scratch/cells.csv" --label species -o "$scratch/o.h5"
    expect_bad "range\.csv:4: label -1 is out of range" -- csv "$scratch/range.csv" --label label -o "$scratch/o.h5"
    expect_bad "y_big\.npy row 9: label 12 is out of range: classes are 0\.\.9" -- npy "$scratch/x.npy" "$scratch/y_big.npy" --num-classes 10 -o "$scratch/o.h5"
    expect_bad "x\.npy holds 10 samples but .*y9\.npy holds 9" -- npy "$scratch/x.npy" "$scratch/y9.npy" -o "$scratch/o.h5"
    expect_bad "ragged\.npy: .*ragged" -- npy "$scratch/ragged.npy" "$scratch/y9.npy" -o "$scratch/o.h5"
    expect_bad "mismatch\.npz:x_test: samples of shape \(3,\), but .*mismatch\.npz:x_train has \(4,\)" -- npz "$scratch/mismatch.npz" -o "$scratch/o.h5"
    expect_bad "x\.npy: 4 values per sample do not fill --shape 3 3" -- npy "$scratch/x.npy" "$scratch/y_big.npy" --shape 3 3 -o "$scratch/o.h5"
    [ ! -e "$scratch/o.h5" ] && [ ! -e "$scratch/o.h5.tmp" ] || fail "a failed conversion left a file behind"
    ;;
  *) fail "unknown case" ;;
esac
echo "PASS [$case_name]"
