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

    # An empty class folder is a class (as Keras' image_dataset_from_directory counts it), also
    # where it sorts last and no label takes it.
    mkdir -p "$scratch/with_empty" && cp -r "$scratch/images/circle" "$scratch/images/square" "$scratch/with_empty/"
    mkdir "$scratch/with_empty/z_empty"
    "$to_hdf5" images "$scratch/with_empty" --shape 8 8 --output "$scratch/with_empty.h5" >"$scratch/out" \
      || fail "images with an empty class folder did not convert"
    grep -q ", 3 classes" "$scratch/out" && grep -q "units: 3" "$scratch/out" || fail "the empty class is not counted: $(cat "$scratch/out")"
    $py -c "import h5py,sys; f=h5py.File(sys.argv[1]); assert int(f['train'].attrs['num_classes'])==3" "$scratch/with_empty.h5" \
      || fail "with_empty.h5 does not declare 3 classes"

    "$to_hdf5" npz "$scratch/own.npz" --output "$scratch/npz.h5" >"$scratch/out" || fail "npz did not convert"
    # The input shape to paste is the one dtrain reads: uint8 (N, 8, 8) gets a channel axis.
    grep -q "input_shape: \[8, 8, 1\]" "$scratch/out" || fail "npz: the printed input_shape is not dtrain's: $(cat "$scratch/out")"
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
open(f"{root}/nan.csv", "w").write("f1,f2,label\n1,2,0\n3,NaN,1\n")
open(f"{root}/inf.csv", "w").write("f1,f2,label\n1,2,0\n3,4,1\n-inf,6,1\n")
x_inf = np.zeros((10, 4), dtype=np.float32)
x_inf[7, 2] = np.inf
np.save(f"{root}/x_inf.npy", x_inf)
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
    expect_bad "nan\.csv:3: column 'f2' holds 'NaN', not a finite number" -- csv "$scratch/nan.csv" --label label -o "$scratch/o.h5"
    expect_bad "inf\.csv:4: column 'f1' holds '-inf', not a finite number" -- csv "$scratch/inf.csv" --label label -o "$scratch/o.h5"
    expect_bad "x_inf\.npy: sample 7 \(.*y_big\.npy row 7\) holds inf at feature 2" -- npy "$scratch/x_inf.npy" "$scratch/y_big.npy" --num-classes 13 -o "$scratch/o.h5"
    expect_bad "range\.csv:4: label -1 is out of range" -- csv "$scratch/range.csv" --label label -o "$scratch/o.h5"
    expect_bad "y_big\.npy row 9: label 12 is out of range: classes are 0\.\.9" -- npy "$scratch/x.npy" "$scratch/y_big.npy" --num-classes 10 -o "$scratch/o.h5"
    expect_bad "x\.npy holds 10 samples but .*y9\.npy holds 9" -- npy "$scratch/x.npy" "$scratch/y9.npy" -o "$scratch/o.h5"
    expect_bad "ragged\.npy: .*ragged" -- npy "$scratch/ragged.npy" "$scratch/y9.npy" -o "$scratch/o.h5"
    expect_bad "mismatch\.npz:x_test: samples of shape \(3,\), but .*mismatch\.npz:x_train has \(4,\)" -- npz "$scratch/mismatch.npz" -o "$scratch/o.h5"
    expect_bad "x\.npy: 4 values per sample do not fill --shape 3 3" -- npy "$scratch/x.npy" "$scratch/y_big.npy" --shape 3 3 -o "$scratch/o.h5"
    [ ! -e "$scratch/o.h5" ] && [ ! -e "$scratch/o.h5.tmp" ] || fail "a failed conversion left a file behind"
    ;;
  png_16bit)
    # A 16-bit grayscale PNG is scaled by 255/65535 (Pillow's convert("L") clips all of these to
    # 255); 8-bit images beside it keep their values, and rgb repeats the gray channel.
    $py - "$scratch" <<'EOF' || fail "cannot generate the inputs"
import os, sys
import numpy as np
from PIL import Image
root = sys.argv[1]
for name in ("deep", "plain"):
    os.makedirs(f"{root}/images/{name}")
for i, value in enumerate((0, 1000, 30000, 65535)):
    Image.fromarray(np.full((6, 5), value, dtype=np.uint16)).save(f"{root}/images/deep/{i}.png")
    Image.fromarray(np.full((6, 5), 7 * i, dtype=np.uint8)).save(f"{root}/images/plain/{i}.png")
with Image.open(f"{root}/images/deep/1.png") as image:
    assert image.mode.startswith("I"), image.mode  # what Pillow makes of a 16-bit grayscale PNG
EOF
    for color in grayscale rgb; do
      "$to_hdf5" images "$scratch/images" --shape 3 3 --color $color --test "$scratch/images" \
        -o "$scratch/$color.h5" >"$scratch/out" || fail "$color: 16-bit images did not convert: $(cat "$scratch/out")"
      $py - "$scratch/$color.h5" <<'EOF' || fail "$color: 16-bit gray is not scaled to 8 bits"
import sys, h5py, numpy as np
with h5py.File(sys.argv[1]) as f:
    x, y = f["test/x"][()], f["test/y"][()]
    names = [s.decode() if isinstance(s, bytes) else s for s in f["test"].attrs["class_names"]]
assert names == ["deep", "plain"], names
assert x.dtype == np.uint8
for image in x:
    assert (image == image.flat[0]).all(), "a flat image is no longer flat"
deep = sorted(int(image.flat[0]) for image, label in zip(x, y) if label == 0)
plain = sorted(int(image.flat[0]) for image, label in zip(x, y) if label == 1)
# round(v * 255 / 65535): 0, 3.89, 116.7, 255
assert deep == [0, 4, 117, 255], deep
assert plain == [0, 7, 14, 21], plain
EOF
    done
    ;;
  csv_class_names)
    # Class names in the label column become class indices in sorted order, the names stored as
    # image folders' are; --test is numbered with the same names.
    $py - "$scratch" <<'EOF' || fail "cannot generate the inputs"
import csv, sys
import numpy as np
root = sys.argv[1]
rng = np.random.default_rng(3)
species = ["virginica", "setosa", "versicolor"]  # not in sorted order
for name, rows in (("train", 240), ("test", 60)):
    with open(f"{root}/{name}.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["a", "species", "b", "c"])
        for i in range(rows):
            k = i % 3
            v = rng.normal(size=3) + 3 * k
            w.writerow([f"{v[0]:.3f}", f" {species[k]}", f"{v[1]:.3f}", f"{v[2]:.3f}"])
open(f"{root}/bad.csv", "w").write("a,species,b,c\n1,setosa,2,3\n4,virginica,five,6\n")
EOF
    "$to_hdf5" csv "$scratch/train.csv" --label species --test "$scratch/test.csv" -o "$scratch/iris.h5" \
      >"$scratch/out" || fail "class names did not convert: $(cat "$scratch/out")"
    cat "$scratch/out"
    grep -q "classes: 0 setosa, 1 versicolor, 2 virginica" "$scratch/out" || fail "the classes are not listed"
    $py - "$scratch/iris.h5" "$scratch/test.csv" <<'EOF' || fail "iris.h5 has the wrong labels"
import csv, sys, h5py, numpy as np
with h5py.File(sys.argv[1]) as f:
    for group in ("train", "test"):
        names = [s.decode() if isinstance(s, bytes) else s for s in f[group].attrs["class_names"]]
        assert names == ["setosa", "versicolor", "virginica"], names
        assert int(f[group].attrs["num_classes"]) == 3
        assert f[group]["y"].dtype == np.int32 and f[group]["x"].shape[1:] == (3,)
    # /test is the file's rows in the file's order, each name numbered, its features kept beside it.
    rows = list(csv.DictReader(open(sys.argv[2])))
    assert f["test/y"][()].tolist() == [names.index(r["species"].strip()) for r in rows]
    assert np.allclose(f["test/x"][()][:, 0], [float(r["a"]) for r in rows], atol=1e-3)
EOF
    experiment "$scratch/iris.yaml" "$scratch/iris.h5" "[3]" 3 ""
    "$dtrain" run "$scratch/iris.yaml" --run-dir "$scratch/run" >"$scratch/train" || fail "dtrain did not train on iris.h5"
    grep -E '^Epoch 1' "$scratch/train" || fail "no epoch line for iris.h5"
    # A feature cell that is not a number is still an error naming the file and row.
    expect_bad "bad\.csv:3: column 'b' holds 'five', not a number" -- csv "$scratch/bad.csv" --label species -o "$scratch/o.h5"
    expect_bad "train\.csv: 3 classes \(setosa, versicolor, virginica\), but --num-classes 2" -- \
      csv "$scratch/train.csv" --label species --num-classes 2 -o "$scratch/o.h5"
    ;;
  *) fail "unknown case" ;;
esac
echo "PASS [$case_name]"
