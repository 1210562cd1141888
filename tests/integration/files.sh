#!/usr/bin/env bash
# Bad files, full and read-only disks, damaged checkpoints and manifests, signals under mpirun, end
# to end with the real binary:
#   tests/integration/files.sh CASE DTRAIN_BINARY SCRATCH_DIR
# Cases that need to mount a tmpfs exit 77 (CTest: skipped) where mounting is not permitted.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh" "$@"

py=/usr/bin/python3
toy=experiments/regression_toy.yaml
quiet=(--set train.progress=none --set train.threads=1)
small=experiments/fashion_mnist_small.yaml

# "rc err": the exit code must be $1, stderr ($2) one "dtrain: error:" line containing each further argument.
one_line_error() {
  local want=$1 rc=$2 err=$3; shift 3
  [ "$rc" -eq "$want" ] || fail "exit $rc, wanted $want: $(cat "$err")"
  [ "$(grep -c '^dtrain: error:' "$err")" -eq 1 ] || fail "wanted one 'dtrain: error:' line: $(cat "$err")"
  for part in "$@"; do grep -qF -- "$part" "$err" || fail "the error does not say '$part': $(cat "$err")"; done
  grep -q "HDF5" "$err" && grep -q "#0[0-9][0-9]:" "$err" && fail "an HDF5 stack dump: $(cat "$err")"
  return 0
}

# start_held RUN STEP COMMAND...: COMMAND in the background, holding at STEP (hold_env) in
# RUN.hold, its stdout into RUN.out and its stderr into RUN.err; its PID in $pid.
start_held() {
  local run=$1 step=$2
  shift 2
  hold_env "$run.hold" "$step"
  env "${hold[@]}" "$@" >"$run.out" 2>"$run.err" &
  pid=$!
}

mount_tmpfs() {  # dir size
  mkdir -p "$1"
  if ! mount -t tmpfs -o "size=$2" tmpfs "$1" 2>/dev/null; then
    echo "SKIP [$case_name]: cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN)"
    exit 77
  fi
  trap "umount '$1' 2>/dev/null" EXIT
}

no_temporaries() {  # dir
  local left
  left=$(find "$1" -name '*.tmp-*' 2>/dev/null)
  [ -z "$left" ] || fail "temporaries left behind: $left"
}

case "$case_name" in
  full_disk)
    mnt="$scratch/mnt"
    mount_tmpfs "$mnt" 4m
    run="$mnt/run"
    "$dtrain" run "$toy" "${quiet[@]}" --set train.epochs=2 --run-dir "$run" >/dev/null 2>"$scratch/first.err" \
      || fail "first run failed: $(cat "$scratch/first.err")"
    before=$(cd "$run/checkpoints" && sha256sum ckpt-*.h5 checkpoint)
    # Fill the disk but for two pages, then continue: config.yaml (rewritten atomically at the
    # start, one page) fits, the next checkpoint (three) cannot be written.
    dd if=/dev/zero of="$mnt/filler" bs=64k >/dev/null 2>&1
    truncate -s -8192 "$mnt/filler"
    "$dtrain" resume "$run" --set train.epochs=4 >/dev/null 2>"$scratch/full.err"
    rc=$?
    cat "$scratch/full.err"
    one_line_error 3 "$rc" "$scratch/full.err" "$run/checkpoints/ckpt-" "No space left on device"
    grep -q "infinite loop closing library" "$scratch/full.err" && fail "HDF5 could not close a file"
    after=$(cd "$run/checkpoints" && sha256sum ckpt-*.h5 checkpoint)
    [ "$before" = "$after" ] || fail "the previous checkpoints or the manifest changed: $before / $after"
    no_temporaries "$run"
    rm -f "$mnt/filler"
    "$dtrain" resume "$run" --set train.epochs=4 >"$scratch/again.out" 2>&1 || fail "resume with space failed: $(cat "$scratch/again.out")"
    grep -q '^Epoch 4' "$scratch/again.out" || fail "no epoch 4 after the disk had space again"
    ;;
  readonly_run_dir)
    mnt="$scratch/mnt"
    mount_tmpfs "$mnt" 1m
    mkdir -p "$mnt/run"
    mount -o remount,ro "$mnt" || fail "cannot remount read-only"
    "$dtrain" run "$toy" "${quiet[@]}" --run-dir "$mnt/run" >/dev/null 2>"$scratch/ro.err"
    one_line_error 3 $? "$scratch/ro.err" "$mnt/run" "Read-only file system"
    ;;
  unwritable_checkpoint_dir)
    # Found before the first epoch, not at the first save.
    mnt="$scratch/mnt"
    mount_tmpfs "$mnt" 1m
    mkdir -p "$mnt/ckpts"
    mount -o remount,ro "$mnt" || fail "cannot remount read-only"
    "$dtrain" run "$toy" "${quiet[@]}" --set "checkpoint.dir=$mnt/ckpts" --run-dir "$scratch/run" >"$scratch/out" \
      2>"$scratch/err"
    one_line_error 3 $? "$scratch/err" "$mnt/ckpts" "not writable"
    grep -q '^Epoch' "$scratch/out" && fail "trained before finding the checkpoint directory unwritable"
    true
    ;;
  nan_data)
    "$py" - "$scratch/nan.h5" <<'EOF' || fail "cannot write the HDF5 file"
import sys, h5py, numpy as np
with h5py.File(sys.argv[1], "w") as f:
    for g, n in (("train", 32), ("test", 8)):
        x = np.full((n, 4), 0.5, dtype=np.float32)
        if g == "train":
            x[17, 2] = np.nan
        f[g + "/x"] = x
        f[g + "/y"] = (np.arange(n) % 2).astype(np.int32)
EOF
    "$dtrain" run "$small" "${quiet[@]}" --set "data.path=$scratch/nan.h5" --run-dir "$scratch/run" >/dev/null \
      2>"$scratch/err"
    one_line_error 2 $? "$scratch/err" "$scratch/nan.h5" "/train/x sample 17" "non-finite"
    ;;
  data_beyond_memory)
    # A data file larger than the process may hold: its /train/x declares 2.2 GB (chunks never
    # written, so the file is a few KB). Under a limit below that size the tensor is refused before
    # allocating; under one just above it (the process's own mappings then leave too little) the
    # allocation fails. Either way one located error that names the file, the dataset and what to
    # do, exit 2 (it was an unlocated "a tensor of shape ..." or "out of memory").
    "$py" - "$scratch/huge.h5" <<'EOF' || fail "cannot write the HDF5 file"
import sys, h5py
with h5py.File(sys.argv[1], "w") as f:
    for g, n in (("train", 3000000), ("test", 100)):
        f.create_dataset(g + "/x", shape=(n, 28, 28), dtype="u1", chunks=(100, 28, 28))
        f.create_dataset(g + "/y", shape=(n,), dtype="i4", chunks=(100,))
EOF
    x_kib=$((3000000 * 28 * 28 / 1024))
    for limit in $((x_kib * 2 / 3)) $((x_kib + 10240)); do
      (ulimit -v "$limit" && exec "$dtrain" run "$small" "${quiet[@]}" --set "data.path=$scratch/huge.h5" \
        --set train.steps_per_epoch=1 --run-dir "$scratch/run") >/dev/null 2>"$scratch/err"
      one_line_error 2 $? "$scratch/err" "--set data.path=$scratch/huge.h5: $scratch/huge.h5: /train/x: " \
        "dtrain holds each split in memory"
      echo "ok under ulimit -v $limit: $(cat "$scratch/err")"
    done
    ;;
  idx_labels)
    "$py" - "$scratch/idx" <<'EOF' || fail "cannot write the IDX files"
import os, struct, sys
import numpy as np
d = sys.argv[1]
os.makedirs(d)
for prefix, n in (("train", 40), ("t10k", 10)):
    with open(os.path.join(d, prefix + "-images-idx3-ubyte"), "wb") as f:
        f.write(bytes([0, 0, 8, 3]) + struct.pack(">III", n, 4, 4) + bytes(n * 16))
    labels = np.arange(n) % 10
    if prefix == "train":
        labels[23] = 200
    with open(os.path.join(d, prefix + "-labels-idx1-ubyte"), "wb") as f:
        f.write(bytes([0, 0, 8, 1]) + struct.pack(">I", n) + labels.astype(np.uint8).tobytes())
EOF
    "$dtrain" run "$small" "${quiet[@]}" --set data.source=idx --set "data.path=$scratch/idx" \
      --set "model={input_shape: [4, 4, 1], layers: [{flatten: {}}, {dense: {units: 10}}]}" --run-dir "$scratch/run" \
      >"$scratch/out" 2>"$scratch/err"
    one_line_error 2 $? "$scratch/err" "$scratch/idx/train-labels-idx1-ubyte" "label 200 of sample 23"
    grep -q '^Epoch' "$scratch/out" && fail "trained before finding the label"
    true
    ;;
  special_files)
    # A FIFO as the IDX file, the checkpoint and the manifest: refused or worked around, never a hang.
    mkdir -p "$scratch/idx"
    mkfifo "$scratch/idx/train-images-idx3-ubyte"
    touch "$scratch/idx/train-labels-idx1-ubyte"
    timeout 60 "$dtrain" run "$small" "${quiet[@]}" --set data.source=idx --set "data.path=$scratch/idx" \
      --run-dir "$scratch/idxrun" >/dev/null 2>"$scratch/idx.err"
    one_line_error 2 $? "$scratch/idx.err" "$scratch/idx/train-images-idx3-ubyte" "not a regular file"
    mkfifo "$scratch/ckpt-1.h5"
    timeout 60 "$dtrain" eval --checkpoint "$scratch/ckpt-1.h5" >/dev/null 2>"$scratch/eval.err"
    one_line_error 2 $? "$scratch/eval.err" "$scratch/ckpt-1.h5" "not a regular file"
    "$dtrain" run "$toy" "${quiet[@]}" --set train.epochs=2 --run-dir "$scratch/run" >/dev/null || fail "run failed"
    rm "$scratch/run/checkpoints/checkpoint" && mkfifo "$scratch/run/checkpoints/checkpoint"
    timeout 60 "$dtrain" resume "$scratch/run" --set train.epochs=3 >"$scratch/resume.out" 2>"$scratch/resume.err" \
      || fail "resume with a FIFO manifest: exit $?: $(cat "$scratch/resume.err")"
    grep -q "warning: .*checkpoint: not a regular file" "$scratch/resume.err" || fail "no warning: $(cat "$scratch/resume.err")"
    grep -q "^Resuming from .*ckpt-20.h5" "$scratch/resume.out" || fail "did not resume from the newest: $(cat "$scratch/resume.out")"
    ;;
  manifest)
    "$dtrain" run "$toy" "${quiet[@]}" --set train.epochs=3 --run-dir "$scratch/ref" >/dev/null || fail "run failed"
    for how in empty garbage deleted reversed repeated; do
      run="$scratch/$how"
      cp -r "$scratch/ref" "$run"
      m="$run/checkpoints/checkpoint"
      case $how in
        empty) : >"$m" ;;
        garbage) printf '\001\377 not a manifest\n' >"$m" ;;
        deleted) rm "$m" ;;
        reversed) printf 'ckpt-30.h5\nckpt-20.h5\nckpt-10.h5\n' >"$m" ;;
        repeated) printf 'ckpt-30.h5\nckpt-30.h5\nckpt-30.h5\n' >"$m" ;;
      esac
      "$dtrain" resume "$run" --set train.epochs=4 >"$run.out" 2>"$run.err" || fail "$how: resume failed: $(cat "$run.err")"
      grep -q "^Resuming from $run/checkpoints/ckpt-30.h5" "$run.out" || fail "$how: $(grep Resuming "$run.out")"
      for step in 20 30 40; do
        [ -f "$run/checkpoints/ckpt-$step.h5" ] || fail "$how: ckpt-$step.h5 is gone: $(ls "$run/checkpoints")"
      done
      echo "ok: manifest $how"
    done
    # A FIFO or a link to nothing in place of the newest checkpoint: never opened (no hang), named
    # in a warning, and the run resumes from the one before.
    for how in fifo dangling; do
      run="$scratch/$how"
      cp -r "$scratch/ref" "$run"
      rm "$run/checkpoints/ckpt-30.h5"
      case $how in
        fifo) mkfifo "$run/checkpoints/ckpt-30.h5" ;;
        dangling) ln -s nowhere.h5 "$run/checkpoints/ckpt-30.h5" ;;
      esac
      timeout 120 "$dtrain" resume "$run" --set train.epochs=4 >"$run.out" 2>"$run.err" || fail "$how: resume failed: $(cat "$run.err")"
      grep -q "^Resuming from $run/checkpoints/ckpt-20.h5" "$run.out" || fail "$how: $(grep Resuming "$run.out")"
      grep -q "^dtrain: warning: $run/checkpoints/ckpt-30.h5 is a \(FIFO\|symbolic link to nothing\), not a checkpoint file: skipped$" \
        "$run.err" || fail "$how: no warning: $(cat "$run.err")"
      echo "ok: $how in place of a checkpoint"
    done
    ;;
  resume_checkpoint_dir)
    "$dtrain" run "$toy" "${quiet[@]}" --set train.epochs=2 --set "checkpoint.dir=$scratch/elsewhere" \
      --run-dir "$scratch/run" >/dev/null || fail "run failed"
    "$dtrain" resume "$scratch/run" --set train.epochs=3 >"$scratch/out" 2>"$scratch/err" \
      || fail "resume ignored checkpoint.dir: $(cat "$scratch/err")"
    grep -q "^Resuming from $scratch/elsewhere/ckpt-20.h5" "$scratch/out" || fail "$(cat "$scratch/out")"
    [ -f "$scratch/elsewhere/ckpt-30.h5" ] || fail "the resumed run did not save into checkpoint.dir"
    ;;
  relative_checkpoint_dir)
    # A relative checkpoint.dir lies inside the run directory: two runs started in different
    # directories never share it, and `dtrain resume RUN_DIR` from a third finds the run's own.
    toy_abs="$PWD/$toy"
    mkdir -p "$scratch/A" "$scratch/B"
    (cd "$scratch/A" && "$dtrain" run "$toy_abs" "${quiet[@]}" --set train.epochs=2 --set checkpoint.dir=myck \
      --run-dir r) >/dev/null 2>&1 || fail "run in A failed"
    [ -f "$scratch/A/r/myck/ckpt-20.h5" ] || fail "checkpoint.dir myck is not inside the run directory: $(find "$scratch/A")"
    (cd "$scratch/B" && "$dtrain" run "$toy_abs" "${quiet[@]}" --set train.epochs=2 --set checkpoint.dir=myck \
      --set optimizer.learning_rate=0.5 --run-dir other) >/dev/null 2>&1 || fail "run in B failed"
    other_before=$(cd "$scratch/B" && sha256sum other/myck/* other/metrics.jsonl)
    (cd "$scratch/B" && "$dtrain" resume ../A/r --set train.epochs=3) >"$scratch/out" 2>"$scratch/err" \
      || fail "resume from B failed: $(cat "$scratch/err")"
    grep -q "^Resuming from ../A/r/myck/ckpt-20.h5" "$scratch/out" || fail "not the run's checkpoint: $(cat "$scratch/out")"
    [ "$(wc -l <"$scratch/A/r/metrics.jsonl")" -eq 3 ] || fail "A/r/metrics.jsonl: $(cat "$scratch/A/r/metrics.jsonl")"
    [ -f "$scratch/A/r/myck/ckpt-30.h5" ] || fail "the resumed run did not save into its own checkpoint.dir"
    [ "$other_before" = "$(cd "$scratch/B" && sha256sum other/myck/* other/metrics.jsonl)" ] || fail "the other run changed"
    [ ! -e "$scratch/B/myck" ] || fail "a checkpoint directory appeared in the current directory"
    # --checkpoint alone finds the run directory above a relative checkpoint.dir.
    (cd "$scratch/B" && "$dtrain" resume --checkpoint ../A/r/myck/ckpt-30.h5 --set train.epochs=4) >"$scratch/out2" \
      2>&1 || fail "resume --checkpoint failed: $(cat "$scratch/out2")"
    [ "$(wc -l <"$scratch/A/r/metrics.jsonl")" -eq 4 ] || fail "resume --checkpoint did not continue A/r's metrics.jsonl"
    ;;
  shared_checkpoint_dir)
    # An absolute checkpoint.dir that holds another run's checkpoints: a new run is refused naming
    # checkpoint.dir (resuming the new run directory could not continue them), and a run whose
    # checkpoints were replaced (--overwrite) refuses to resume from the other run's.
    shared="$scratch/shared"
    "$dtrain" run "$toy" "${quiet[@]}" --set train.epochs=2 --set "checkpoint.dir=$shared" --run-dir "$scratch/X" \
      >/dev/null 2>&1 || fail "run X failed"
    "$dtrain" run "$toy" "${quiet[@]}" --set train.epochs=2 --set "checkpoint.dir=$shared" --run-dir "$scratch/Y" \
      >/dev/null 2>"$scratch/refused.err"
    one_line_error 2 $? "$scratch/refused.err" "checkpoint.dir $shared already holds another run's checkpoints" \
      "$shared/ckpt-20.h5"
    grep -q "dtrain resume $scratch/Y" "$scratch/refused.err" && fail "suggests resuming the new run: $(cat "$scratch/refused.err")"
    [ ! -e "$scratch/Y" ] || fail "the refused run wrote $scratch/Y"
    "$dtrain" run "$toy" "${quiet[@]}" --set train.epochs=2 --set "checkpoint.dir=$shared" --overwrite \
      --set optimizer.learning_rate=0.5 --run-dir "$scratch/Y" >/dev/null 2>&1 || fail "run Y --overwrite failed"
    x_metrics=$(sha256sum <"$scratch/X/metrics.jsonl")
    "$dtrain" resume "$scratch/X" --set train.epochs=3 >"$scratch/out" 2>"$scratch/err"
    one_line_error 2 $? "$scratch/err" "$shared/ckpt-20.h5: not a checkpoint of the run in $scratch/X" \
      "$scratch/X/config.yaml" "learning_rate: 0.5"
    [ "$x_metrics" = "$(sha256sum <"$scratch/X/metrics.jsonl")" ] || fail "X's metrics.jsonl changed"
    grep -q '^Epoch' "$scratch/out" && fail "trained from another run's checkpoint"
    true
    ;;
  branched_resume)
    # A resume from an older checkpoint with a --set that changes the results starts another history
    # in the same run directory; the old history's checkpoint with a higher step stays (a save never
    # prunes one). A plain resume afterwards continues the new history from its newest checkpoint,
    # skipping the old one with a warning, and the log reads epochs 1, 2, 3 once each.
    run="$scratch/run"
    "$dtrain" run "$toy" "${quiet[@]}" --set train.epochs=3 --run-dir "$run" >/dev/null 2>&1 || fail "run failed"
    old30=$(sha256sum <"$run/checkpoints/ckpt-30.h5")
    "$dtrain" resume "$run" --checkpoint "$run/checkpoints/ckpt-10.h5" --set optimizer.learning_rate=0.02 \
      --set train.epochs=2 >/dev/null 2>&1 || fail "the branching resume failed"
    [ "$old30" = "$(sha256sum <"$run/checkpoints/ckpt-30.h5")" ] || fail "the old history's ckpt-30.h5 changed"
    "$dtrain" resume "$run" --set train.epochs=3 >"$scratch/out" 2>"$scratch/err" \
      || fail "plain resume after the branch failed: $(cat "$scratch/err")"
    grep -q "^Resuming from $run/checkpoints/ckpt-20.h5 at epoch 3" "$scratch/out" \
      || fail "not resumed from the new history's newest checkpoint: $(cat "$scratch/out" "$scratch/err")"
    [ "$(grep -c '^dtrain: warning: skipping' "$scratch/err")" -eq 1 ] || fail "wanted one skip warning: $(cat "$scratch/err")"
    grep -qF "skipping $run/checkpoints/ckpt-30.h5: its experiment is not the one in $run/config.yaml" "$scratch/err" \
      || fail "the warning does not name the old history's checkpoint: $(cat "$scratch/err")"
    grep -q "learning_rate: 0.01" "$scratch/err" && grep -q "learning_rate: 0.02" "$scratch/err" \
      || fail "the warning does not name the difference: $(cat "$scratch/err")"
    grep -q -- "--checkpoint" "$scratch/err" && fail "the warning suggests continuing the old history: $(cat "$scratch/err")"
    [ "$("$py" -c 'import json,sys; print(" ".join(str(json.loads(l)["epoch"]) for l in open(sys.argv[1])))' \
        "$run/metrics.jsonl")" = "1 2 3" ] || fail "metrics.jsonl does not read 1 2 3: $(cat "$run/metrics.jsonl")"
    # The new history's epoch 3 is the one the lower learning rate trained, not the old one's.
    [ "$old30" != "$(sha256sum <"$run/checkpoints/ckpt-30.h5")" ] || fail "ckpt-30.h5 is still the old history's"
    # Under replica_invariant a resume may change the layout (threads) without leaving the run: the
    # checkpoints before it are still the run's own.
    ri="$scratch/ri"
    invariant=(--set 'reproducibility={mode: replica_invariant, micro_batch_size: 5}' --set data.batch_size_per_replica=null
               --set data.global_batch_size=10)
    "$dtrain" run "$toy" "${quiet[@]}" "${invariant[@]}" --set train.epochs=2 --run-dir "$ri" >/dev/null 2>&1 \
      || fail "the replica_invariant run failed"
    "$dtrain" resume "$ri" --set train.threads=2 --set train.epochs=3 >/dev/null 2>&1 || fail "the resume on 2 threads failed"
    rm "$ri/checkpoints/ckpt-30.h5"  # as if killed before its first save
    "$dtrain" resume "$ri" --set train.epochs=3 >"$scratch/out" 2>"$scratch/err" \
      || fail "resume after a layout change failed: $(cat "$scratch/err")"
    grep -q "^Resuming from $ri/checkpoints/ckpt-20.h5" "$scratch/out" || fail "not resumed from ckpt-20: $(cat "$scratch/out")"
    grep -q "its experiment is not the one" "$scratch/err" && fail "a layout change taken for another run: $(cat "$scratch/err")"
    true
    ;;
  metrics_once)
    # Epoch 3 is logged but not checkpointed (every 2 epochs): the resumed run trains it again and
    # the log must hold it once.
    "$dtrain" run "$toy" "${quiet[@]}" --set train.epochs=3 --set checkpoint.every_epochs=2 --run-dir "$scratch/run" \
      >/dev/null || fail "run failed"
    [ "$(wc -l <"$scratch/run/metrics.jsonl")" -eq 3 ] || fail "wanted 3 epochs logged"
    "$dtrain" resume "$scratch/run" --set train.epochs=4 >/dev/null 2>&1 || fail "resume failed"
    epochs=$("$py" -c "import json, sys; print(' '.join(str(json.loads(l)['epoch']) for l in open(sys.argv[1])))" \
      "$scratch/run/metrics.jsonl") || fail "metrics.jsonl is not JSON lines"
    [ "$epochs" = "1 2 3 4" ] || fail "metrics.jsonl holds epochs '$epochs', wanted '1 2 3 4'"
    ;;
  diverged)
    # A learning rate that blows the weights up: training stops at the first non-finite loss.
    "$dtrain" run "$toy" "${quiet[@]}" --set train.epochs=5 --set optimizer.learning_rate=1e30 --run-dir "$scratch/run" \
      >"$scratch/out" 2>"$scratch/err"
    one_line_error 2 $? "$scratch/err" "the training loss became" "learning_rate"
    "$py" - "$scratch/run" <<'EOF' || fail "non-finite weights saved or invalid metrics.jsonl"
import glob, json, sys
import h5py, numpy as np
run = sys.argv[1]
for line in open(run + "/metrics.jsonl"):
    json.loads(line)
for path in glob.glob(run + "/checkpoints/ckpt-*.h5"):
    with h5py.File(path, "r") as f:
        f.visititems(lambda n, o: (isinstance(o, h5py.Dataset) and o.dtype.kind == "f"
                                   and not np.all(np.isfinite(o[()]))) and sys.exit(path + ": " + n + " is not finite"))
EOF
    ;;
  damaged_state)
    # /state values, the optimizer's update count and weights rewritten with valid checksums (and
    # the seal recomputed), metric counts of the wrong length among them: refused by eval where it
    # reads them (the weights; not /state, the update count or the optimizer's slots), skipped by
    # resume, refused with one line when named; a flipped bit in the seal's magic does not switch
    # the whole-file check off.
    "$dtrain" run "$toy" "${quiet[@]}" --set train.epochs=3 --set 'metrics=[accuracy]' --set optimizer.kind=adam \
      --run-dir "$scratch/ref" >/dev/null || fail "run failed"
    for change in "global_step 9223372036854775807" "epoch 4611686018427387904" "magic" "metrics 3" \
                  "iterations 4611686018427387904" "iterations 29" "nonfinite model/dense/kernel" \
                  "nonfinite optimizer/v/dense/bias"; do
      set -- $change
      run="$scratch/$1${2:+-${2//\//_}}"
      cp -r "$scratch/ref" "$run"
      "$py" - "$run/checkpoints/ckpt-30.h5" $change <<'EOF' || fail "cannot edit the checkpoint"
import struct, sys, zlib
import h5py, numpy as np
path, name = sys.argv[1], sys.argv[2]
if name == "magic":
    with open(path, "r+b") as f:
        f.write(b"DTRAINCJ")
    sys.exit(0)
with h5py.File(path, "r+") as h:
    if name == "metrics":  # the accuracy's running counts, one too many (it keeps 2)
        for what, value in (("counts", np.arange(int(sys.argv[3]), dtype=np.int64)), ("sums", np.zeros(2))):
            ds = h.create_dataset("state/metrics/0/" + what, data=value)
            ds.attrs.create("crc32", zlib.crc32(value.tobytes()), dtype=np.uint32)
    elif name == "iterations":  # an attribute: no checksum of its own, only the seal's
        h["optimizer"].attrs.modify("iterations", np.int64(int(sys.argv[3])))
    elif name == "nonfinite":  # a diverged run's weights: every checksum still holds
        value = h[sys.argv[3]][()]
        value.flat[0] = np.nan
        del h[sys.argv[3]]
        ds = h.create_dataset(sys.argv[3], data=value)
        ds.attrs.create("crc32", zlib.crc32(value.tobytes()), dtype=np.uint32)
    else:
        value = np.array(int(sys.argv[3]), dtype=np.int64)
        del h["state/" + name]
        ds = h.create_dataset("state/" + name, data=value)
        ds.attrs.create("crc32", zlib.crc32(value.tobytes()), dtype=np.uint32)
with open(path, "r+b") as f:
    body = open(path, "rb").read()[512:]
    f.seek(12)
    f.write(struct.pack("<QI", len(body), zlib.crc32(body)))
EOF
      "$dtrain" eval --checkpoint "$run/checkpoints/ckpt-30.h5" >/dev/null 2>"$run.eval.err"
      rc=$?
      if [ "$1" = iterations ] || [ "${2:-}" = optimizer/v/dense/bias ]; then
        [ "$rc" -eq 0 ] || fail "$change: eval, which does not use it, failed: $(cat "$run.eval.err")"
      else
        one_line_error 2 "$rc" "$run.eval.err" "$run/checkpoints/ckpt-30.h5"
      fi
      [ "$1" = metrics ] && { grep -q "/state/metrics/0 holds 3 counts" "$run.eval.err" || fail "metrics: $(cat "$run.eval.err")"; }
      [ "$1" = nonfinite ] && [ "$rc" -ne 0 ] && { grep -q "/$2 holds 1 non-finite value" "$run.eval.err" || fail "$change: $(cat "$run.eval.err")"; }
      # Named explicitly, it is refused with one line (before the resume below writes a new one).
      "$dtrain" resume "$run" --checkpoint "$run/checkpoints/ckpt-30.h5" >/dev/null 2>"$run.err"
      one_line_error 2 $? "$run.err" "$run/checkpoints/ckpt-30.h5"
      "$dtrain" resume "$run" --set train.epochs=4 >"$run.out" 2>"$run.err" || fail "$1: resume failed: $(cat "$run.err")"
      grep -q "skipping $run/checkpoints/ckpt-30.h5" "$run.err" || fail "$1: not skipped: $(cat "$run.err")"
      grep -q "^Resuming from $run/checkpoints/ckpt-20.h5" "$run.out" || fail "$1: $(cat "$run.out")"
      case "$change" in
        iterations*) grep -q "/optimizer iterations is $2 but /state/global_step is 30" "$run.err" || fail "$change: $(cat "$run.err")" ;;
        nonfinite*) grep -q "/$2 holds 1 non-finite value" "$run.err" || fail "$change: $(cat "$run.err")" ;;
      esac
      echo "ok: $change"
    done
    ;;
  stored_experiment)
    # An experiment stored in a checkpoint that builds no model: the error names the checkpoint.
    "$dtrain" run "$toy" "${quiet[@]}" --set train.epochs=1 --run-dir "$scratch/run" >/dev/null || fail "run failed"
    ckpt="$scratch/run/checkpoints/ckpt-10.h5"
    "$py" - "$ckpt" <<'EOF' || fail "cannot edit the checkpoint"
import struct, sys, zlib
import h5py, numpy as np
path = sys.argv[1]
text = b"name: x\nmodel: {input_shape: [2, 2, 1], layers: [{dense: {units: 1}}]}\n"
with h5py.File(path, "r+") as h:
    del h["experiment"]
    ds = h.create_dataset("experiment", data=np.array(text, dtype="S%d" % len(text)))
    ds.attrs.create("crc32", zlib.crc32(text), dtype=np.uint32)
body = open(path, "rb").read()[512:]
with open(path, "r+b") as f:
    f.seek(12)
    f.write(struct.pack("<QI", len(body), zlib.crc32(body)))
EOF
    "$dtrain" eval --checkpoint "$ckpt" >/dev/null 2>"$scratch/eval.err"
    one_line_error 2 $? "$scratch/eval.err" "$ckpt:/experiment"
    "$dtrain" resume "$scratch/run" --checkpoint "$ckpt" --set train.epochs=2 >/dev/null 2>"$scratch/resume.err"
    one_line_error 2 $? "$scratch/resume.err" "$ckpt:/experiment"
    # Through the run directory it is not the run's experiment at all (config.yaml differs).
    "$dtrain" resume "$scratch/run" --set train.epochs=2 >/dev/null 2>"$scratch/resume.err"
    one_line_error 2 $? "$scratch/resume.err" "$ckpt: not a checkpoint of the run in $scratch/run"
    ;;
  double_signal)
    # A second signal exits at once (128 + signal) and leaves no temporary behind, whenever it comes.
    for i in 1 2 3 4 5; do
      run="$scratch/run$i"
      # Held at a random step while training (a checkpoint written every step), so the first
      # signal lands in a run that is still going on any machine; the second follows after a
      # random moment, into the checkpoint being saved or the exit.
      hold_env "$run.hold" $((2 + RANDOM % 60))
      env "${hold[@]}" "$dtrain" run "$small" "${quiet[@]}" --set train.epochs=20 --set checkpoint.every_steps=1 \
        --run-dir "$run" >/dev/null 2>"$run.err" &
      pid=$!
      wait_held "$run.hold" 1 "$pid"
      kill -TERM "$pid"
      sleep "0.0$((RANDOM % 9))"
      kill -TERM "$pid" 2>/dev/null
      wait "$pid"
      rc=$?
      [ "$rc" -eq 143 ] || [ "$rc" -eq 4 ] || fail "double SIGTERM: exit $rc: $(cat "$run.err")"
      no_temporaries "$run"
      "$dtrain" resume "$run" --set train.epochs=1 >/dev/null 2>&1 || true
      no_temporaries "$run"
    done
    ;;
  signal_after_command)
    # A signal that reaches a process whose command has already returned its exit code ends it
    # quietly with that code: nothing is left to stop or to save. Each process holds there
    # (DTRAIN_TEST_HOLD_AT_STEP=exit) until the test acts.
    command -v mpirun >/dev/null || { echo "SKIP: no mpirun"; exit 77; }
    # mpirun -n 2 with a strategy that runs in one process: both ranks refuse it (exit 2, rank 0
    # reports). Rank 1 ends first; mpirun then sends SIGTERM to rank 0, still finalizing.
    run="$scratch/refused"
    start_held "$run" exit mpirun -n 2 --oversubscribe "$dtrain" run "$small" "${quiet[@]}" \
      --set 'strategy={kind: mirrored}' --run-dir "$run"
    wait_held "$run.hold" 2 "$pid"
    rank1=$(rank_pid "$run" 1)
    [ -n "$rank1" ] || fail "no process of rank 1 found"
    kill -TERM "$rank1"
    wait "$pid"
    rc=$?
    cat "$run.err"
    [ "$rc" -eq 2 ] || fail "refused under mpirun, then SIGTERM: exit $rc, wanted 2"
    [ "$(grep -c '^dtrain' "$run.err")" -eq 1 ] || fail "wanted the one refusal from dtrain: $(cat "$run.err")"
    grep -q '^dtrain: error: .*strategy kind mirrored runs in one process' "$run.err" || fail "not the refusal"
    # One process that trained: SIGTERM after it returned 0 leaves 0 and everything it printed.
    run="$scratch/trained"
    start_held "$run" exit "$dtrain" run "$small" "${quiet[@]}" --set train.epochs=2 --set train.steps_per_epoch=2 \
      --run-dir "$run"
    wait_held "$run.hold" 1 "$pid"
    kill -TERM "$pid"
    wait "$pid"
    rc=$?
    [ "$rc" -eq 0 ] || fail "SIGTERM after a finished run: exit $rc, wanted 0: $(cat "$run.err")"
    [ -s "$run.err" ] && fail "SIGTERM after a finished run printed: $(cat "$run.err")"
    [ "$(grep -c '^Epoch [12], Loss: ' "$run.out")" -eq 2 ] || fail "the epoch lines are lost: $(cat "$run.out")"
    ;;
  mpi_signals)
    # mpirun -n 2: SIGUSR1 is forwarded to the ranks, which stop at an agreed step, save once and
    # exit 4, and so does mpirun. SIGTERM makes mpirun abort the job (docs/multi_worker.md): no rank survives it
    # and no temporary is left.
    command -v mpirun >/dev/null || { echo "SKIP: no mpirun"; exit 77; }
    mw=(--set "strategy={kind: multi_worker_mirrored}" --set train.epochs=30 --set checkpoint.every_steps=2)
    for sig in USR1 TERM TERM2; do
      run="$scratch/mpi_$sig"
      # Both ranks hold at a step past the first checkpoint while mpirun is signalled.
      start_held "$run" $((3 + RANDOM % 40)) mpirun -n 2 --oversubscribe "$dtrain" run "$small" "${quiet[@]}" "${mw[@]}" \
        --run-dir "$run"
      wait_held "$run.hold" 2 "$pid"
      case $sig in
        USR1) kill -USR1 "$pid" ;;
        TERM) kill -TERM "$pid" ;;
        TERM2) kill -TERM "$pid"; sleep 0.2; kill -TERM "$pid" 2>/dev/null ;;
      esac
      wait "$pid"
      rc=$?
      cat "$run.err"
      # mpirun has returned; its ranks end with it (reaped within moments, however loaded the machine).
      for _ in $(seq 1 300); do pgrep -f -- "--run-dir $run" >/dev/null || break; sleep 0.1; done
      pgrep -f -- "--run-dir $run" >/dev/null && fail "SIG$sig: a rank outlived mpirun by 30 s"
      no_temporaries "$run"
      if [ "$sig" = USR1 ]; then
        [ "$rc" -eq 4 ] || fail "SIGUSR1: mpirun exit $rc, wanted 4"
        grep -q "continue with: dtrain resume $run" "$run.err" || fail "SIGUSR1: no resume command printed"
        [ "$(grep -c 'continue with' "$run.err")" -eq 1 ] || fail "SIGUSR1: only the chief reports"
      fi
      echo "SIG$sig to mpirun: exit $rc"
      mpirun -n 2 --oversubscribe "$dtrain" resume "$run" --set train.epochs=1 >"$run.resume.out" 2>&1 \
        || fail "SIG$sig: resume failed: $(tail -5 "$run.resume.out")"
    done
    # What a batch system sends, SIGTERM, to tools/dtrain-mpirun: it reaches the ranks as SIGUSR1,
    # the chief saves, and the job's exit status is 4, where mpirun alone would say 1.
    run="$scratch/wrapped"
    start_held "$run" $((3 + RANDOM % 40)) tools/dtrain-mpirun -n 2 --oversubscribe "$dtrain" run "$small" "${quiet[@]}" \
      "${mw[@]}" --run-dir "$run"
    wait_held "$run.hold" 2 "$pid"
    kill -TERM "$pid"
    wait "$pid"
    rc=$?
    cat "$run.err"
    [ "$rc" -eq 4 ] || fail "SIGTERM to tools/dtrain-mpirun: exit $rc, wanted 4"
    grep -q "continue with: dtrain resume $run" "$run.err" || fail "SIGTERM to tools/dtrain-mpirun: no resume command printed"
    echo "SIGTERM to tools/dtrain-mpirun: exit $rc"
    ;;
  *)
    fail "unknown case"
    ;;
esac
echo "ok [$case_name]"
