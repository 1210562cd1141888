#!/usr/bin/env bash
# MultiWorkerMirrored over real mpirun (OpenMPI), end to end:
#   tests/integration/multi_worker.sh CASE DTRAIN_BINARY SCRATCH_DIR
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh" "$@"

mpi() { local n=$1; shift; mpirun -n "$n" --oversubscribe "$@"; }
# "PID RANK" of every dtrain rank process of the run writing into $1 (mpirun itself has no rank).
rank_pids() {
  for pid in $(pgrep -f -- "--run-dir $1"); do
    r=$(tr '\0' '\n' <"/proc/$pid/environ" 2>/dev/null | sed -n 's/^OMPI_COMM_WORLD_RANK=//p')
    [ -n "$r" ] && echo "$pid $r"
  done
}

small=experiments/fashion_mnist_small.yaml
one_step=(--set train.epochs=1 --set train.steps_per_epoch=1 --set train.threads=1 --set train.progress=none)
mwm() { echo "strategy={kind: multi_worker_mirrored, communication: {implementation: $1, timeout_seconds: 60}}"; }

case "$case_name" in
  equivalence)
    # The same global batch of 64, one step, from the same initial weights.
    "$dtrain" run "$small" "${one_step[@]}" --set data.batch_size_per_replica=64 --run-dir "$scratch/default" >/dev/null \
      || fail "default run failed"
    "$dtrain" run "$small" "${one_step[@]}" --set data.batch_size_per_replica=16 \
      --set "strategy={kind: mirrored, devices: [cpu:0, cpu:1, cpu:2, cpu:3]}" --run-dir "$scratch/mirrored4" >/dev/null \
      || fail "mirrored run failed"
    for spec in "4 mpi 16" "2 mpi 32" "4 ring 16" "2 ring 32"; do
      read -r n impl per <<<"$spec"
      run="$scratch/mw_${n}_${impl}"
      mpi "$n" "$dtrain" run "$small" "${one_step[@]}" --set data.batch_size_per_replica="$per" --set "$(mwm "$impl")" \
        --run-dir "$run" >"$run.out" 2>&1 || fail "mpirun -n $n ($impl) failed: $(tail -5 "$run.out")"
      grep -q "| strategy multi_worker_mirrored | workers $n | replicas $n " "$run.out" || fail "header: $(head -1 "$run.out")"
      [ "$(grep -c '^Epoch 1' "$run.out")" -eq 1 ] || fail "only the chief prints: wanted one epoch line"
      for ref in default mirrored4; do
        tools/compare_weights "$run/checkpoints/ckpt-1.h5" "$scratch/$ref/checkpoints/ckpt-1.h5" --rtol 1e-5 \
          || fail "$n workers ($impl) differ from $ref by more than 1e-5 relative after one step"
      done
      echo "ok: $n workers over $impl match the default strategy and 4 mirrored replicas"
    done
    # per_replica input across workers (one pipeline per worker, each its k-th share): the same
    # step as 2 mirrored replicas with per_replica input.
    per_replica=(--set data.distribute=per_replica --set data.batch_size_per_replica=32)
    "$dtrain" run "$small" "${one_step[@]}" "${per_replica[@]}" --set "strategy={kind: mirrored, devices: [cpu:0, cpu:1]}" \
      --run-dir "$scratch/mirrored2_per_replica" >/dev/null || fail "mirrored per_replica run failed"
    mpi 2 "$dtrain" run "$small" "${one_step[@]}" "${per_replica[@]}" --set "$(mwm ring)" \
      --run-dir "$scratch/mw_per_replica" >"$scratch/mw_per_replica.out" 2>&1 \
      || fail "mpirun -n 2 per_replica failed: $(tail -5 "$scratch/mw_per_replica.out")"
    tools/compare_weights "$scratch/mw_per_replica/checkpoints/ckpt-1.h5" \
      "$scratch/mirrored2_per_replica/checkpoints/ckpt-1.h5" --rtol 1e-5 \
      || fail "2 workers with per_replica input differ from 2 mirrored replicas"
    echo "ok: per_replica input over 2 workers matches 2 mirrored replicas"
    ;;
  mixed_bfloat16)
    # mixed_bfloat16 over 2 and 4 ranks computes the default strategy's bf16 steps on the same
    # global batch, to bfloat16's precision (smaller per-worker batches round in other blocks).
    "$dtrain" info | grep -q "^precision mixed_bfloat16: available" || { echo "SKIP: this CPU has no bfloat16"; exit 77; }
    steps=(--set train.epochs=1 --set train.steps_per_epoch=3 --set train.threads=1 --set train.progress=none
           --set precision=mixed_bfloat16)
    "$dtrain" run "$small" "${steps[@]}" --set data.batch_size_per_replica=64 --run-dir "$scratch/default" >/dev/null \
      || fail "default run failed"
    for spec in "2 mpi 32" "4 ring 16"; do
      read -r n impl per <<<"$spec"
      run="$scratch/mw_${n}"
      mpi "$n" "$dtrain" run "$small" "${steps[@]}" --set data.batch_size_per_replica="$per" --set "$(mwm "$impl")" \
        --run-dir "$run" >"$run.out" 2>&1 || fail "mpirun -n $n failed: $(tail -5 "$run.out")"
      grep -q "| precision mixed_bfloat16$" "$run.out" || fail "header: $(head -1 "$run.out")"
      tools/compare_weights "$run/checkpoints/ckpt-3.h5" "$scratch/default/checkpoints/ckpt-3.h5" --rtol 1e-3 \
        || fail "$n workers differ from the default strategy by more than 1e-3 after 3 bf16 steps"
      echo "ok: $n workers in mixed_bfloat16 match the default strategy"
    done
    ;;
  sync_batch_norm)
    # Synchronized batch normalization sums its statistics over every replica of every worker, and
    # dropout's masks follow the samples: 2 and 4 ranks compute the default strategy's steps on the
    # global batch of 64, moving statistics included.
    sed -e 's|synchronized: false|synchronized: true|' experiments/fashion_mnist_bn_dropout.yaml >"$scratch/bn.yaml"
    grep -q "synchronized: true" "$scratch/bn.yaml" || fail "the experiment has no batch_normalization to synchronize"
    steps=(--set train.epochs=1 --set train.steps_per_epoch=3 --set train.threads=1 --set train.progress=none
           --set data.source=hdf5 --set data.path=data/fashion_mnist_small.h5 --set data.shuffle_buffer=2000)
    "$dtrain" run "$scratch/bn.yaml" "${steps[@]}" --set data.batch_size_per_replica=64 --run-dir "$scratch/default" \
      >/dev/null || fail "default run failed"
    for spec in "2 mpi 32" "4 ring 16"; do
      read -r n impl per <<<"$spec"
      run="$scratch/mw_${n}"
      mpi "$n" "$dtrain" run "$scratch/bn.yaml" "${steps[@]}" --set data.batch_size_per_replica="$per" \
        --set "$(mwm "$impl")" --run-dir "$run" >"$run.out" 2>&1 || fail "mpirun -n $n failed: $(tail -5 "$run.out")"
      grep -q "not overlapping backward" "$run.out" || fail "the header does not say the sums no longer overlap backward"
      tools/compare_weights "$run/checkpoints/ckpt-3.h5" "$scratch/default/checkpoints/ckpt-3.h5" --rtol 1e-5 \
        || fail "$n workers differ from the default strategy after 3 steps"
      echo "ok: $n workers with synchronized batch normalization match the default strategy"
    done
    # Resumed on another worker count: synchronized, only the order of the sums changes (a note);
    # not synchronized, each replica normalizes by its own share of the batch, which the replica
    # count changes, and the resume says so.
    elastic=(--set train.epochs=2 --set data.batch_size_per_replica=null --set data.global_batch_size=64)
    "$dtrain" resume "$scratch/mw_2" "${elastic[@]}" >"$scratch/sync_resume.out" 2>&1 \
      || fail "resume of the synchronized run failed: $(tail -5 "$scratch/sync_resume.out")"
    grep -q "note: the checkpoint was written by 2 replicas in 2 processes, this run has 1 replica in 1 process; sums" \
      "$scratch/sync_resume.out" || fail "no note of the layout: $(grep -E 'note|warning' "$scratch/sync_resume.out")"
    mpi 2 "$dtrain" run experiments/fashion_mnist_bn_dropout.yaml "${steps[@]}" --set data.batch_size_per_replica=32 \
      --set "$(mwm mpi)" --run-dir "$scratch/per_replica" >"$scratch/per_replica.out" 2>&1 \
      || fail "mpirun -n 2 of per-replica batch normalization failed: $(tail -5 "$scratch/per_replica.out")"
    "$dtrain" resume "$scratch/per_replica" "${elastic[@]}" >"$scratch/per_replica_resume.out" 2>&1 \
      || fail "resume of the per-replica run failed: $(tail -5 "$scratch/per_replica_resume.out")"
    grep -q "warning: the checkpoint was written by 2 replicas in 2 processes, this run has 1 replica in 1 process; layer 'batch_normalization' normalizes by each replica's share of the batch" \
      "$scratch/per_replica_resume.out" || fail "no warning of the per-replica statistics: $(grep -E 'note|warning' "$scratch/per_replica_resume.out")"
    ;;
  sharding)
    # auto_shard over real shard files: each worker reads its own files, the test set is still
    # evaluated exactly once, and every world size gives the same Test Accuracy.
    tools/make_shards --input data/fashion_mnist_small.h5 --shards 4 --output-prefix "$scratch/fm" >/dev/null \
      || fail "tools/make_shards failed"
    shards=$(printf '%s, ' "$scratch"/fm-0000?-of-00004.h5)
    sed -e "s|^  path: .*|  shards: [${shards%, }]|" -e 's|^strategy: .*|strategy: {kind: multi_worker_mirrored}|' \
      "$small" >"$scratch/sharded.yaml"
    common=(--set train.epochs=1 --set train.threads=1 --set train.progress=none)
    mpi 2 "$dtrain" run "$scratch/sharded.yaml" "${common[@]}" --run-dir "$scratch/run" >"$scratch/run.out" 2>&1 \
      || fail "mpirun -n 2 over 4 shard files failed: $(tail -5 "$scratch/run.out")"
    grep -q "data.auto_shard auto: by file (4 shard files over 2 workers)" "$scratch/run.out" || fail "no auto_shard note"
    grep -q '"test_samples": 500,' "$scratch/run/metrics.jsonl" \
      || fail "the test set was not evaluated exactly once: $(cat "$scratch/run/metrics.jsonl")"
    ckpt=$(ls "$scratch"/run/checkpoints/ckpt-*.h5 | head -1)
    for n in 1 2 4; do
      if [ "$n" -eq 1 ]; then "$dtrain" eval --checkpoint "$ckpt" >"$scratch/eval$n" 2>&1 || fail "eval failed"
      else mpi "$n" "$dtrain" eval --checkpoint "$ckpt" >"$scratch/eval$n" 2>&1 || fail "mpirun -n $n eval failed: $(cat "$scratch/eval$n")"; fi
      grep -q '500 samples' "$scratch/eval$n" || fail "$n ranks did not evaluate the 500 test samples of the 4 files once"
    done
    acc() { sed -nE 's/.*Test Accuracy: ([0-9.]+).*/\1/p' "$scratch/eval$1"; }
    [ -n "$(acc 1)" ] && [ "$(acc 1)" = "$(acc 2)" ] && [ "$(acc 1)" = "$(acc 4)" ] \
      || fail "test accuracy differs: $(acc 1) / $(acc 2) / $(acc 4)"
    echo "ok: Test Accuracy $(acc 1) with 1, 2 and 4 ranks over 4 shard files"

    # Fewer files than workers under auto_shard: file is refused (exit 2, the counts named).
    mpi 4 "$dtrain" run "$scratch/sharded.yaml" "${common[@]}" --set data.auto_shard=file \
      --set "data.shards=[$scratch/fm-00000-of-00004.h5, $scratch/fm-00001-of-00004.h5]" --run-dir "$scratch/few" \
      >"$scratch/few.out" 2>&1
    rc=$?
    [ "$rc" -eq 2 ] || fail "fewer files than workers: exit $rc, wanted 2"
    grep -q "data.auto_shard file: 2 shard files for 4 workers" "$scratch/few.out" || fail "no clear error: $(head -3 "$scratch/few.out")"

    # off: every worker trains on everything (twice the steps of data sharding) and is warned.
    mpi 2 "$dtrain" run "$small" "${common[@]}" --set data.auto_shard=off --set "strategy={kind: multi_worker_mirrored}" \
      --run-dir "$scratch/off" >"$scratch/off.out" 2>&1 || fail "auto_shard off failed: $(tail -5 "$scratch/off.out")"
    grep -q "warning: data.auto_shard off: each of the 2 workers trains on the whole dataset" "$scratch/off.out" \
      || fail "no warning for auto_shard off"
    grep -q "(32 steps" "$scratch/off.out" || fail "off: wanted 2000 samples / 64 per worker = 32 steps: $(grep steps "$scratch/off.out")"
    mpi 2 "$dtrain" run "$small" "${common[@]}" --set data.auto_shard=data --set "strategy={kind: multi_worker_mirrored}" \
      --run-dir "$scratch/data" >"$scratch/data.out" 2>&1 || fail "auto_shard data failed"
    grep -q "(16 steps" "$scratch/data.out" || fail "data: wanted 2000 samples / 128 global = 16 steps"
    ;;
  file_shards)
    # auto_shard: file over 3 files whose test parts are uneven (2 of them: the third has none),
    # on 3 ranks: the worker without test samples still evaluates (empty batches), and the job's
    # figures are one process's over the same files. The validation set is the last tenth of each
    # file's own training rows, the same for any worker count. `dtrain eval --predictions` under
    # mpirun writes every test sample, and eval checks its own batch, not training's.
    tools/make_shards --input data/fashion_mnist_small.h5 --shards 2 --output-prefix "$scratch/fm" >/dev/null \
      || fail "tools/make_shards failed"
    /usr/bin/python3 - "$scratch" <<'EOF' || fail "could not write the third shard"
import sys, h5py
d = sys.argv[1]
with h5py.File(f"{d}/fm-00001-of-00002.h5", "r") as src, h5py.File(f"{d}/no_test.h5", "w") as out:
    for group in ("train", "test"):
        rows = slice(0, 300) if group == "train" else slice(0, 0)
        for name in ("x", "y"):
            out[f"{group}/{name}"] = src[f"{group}/{name}"][rows]
EOF
    files="$scratch/fm-00000-of-00002.h5, $scratch/fm-00001-of-00002.h5, $scratch/no_test.h5"
    sed -e "s|^  path: .*|  shards: [$files]|" -e 's|^strategy: .*|strategy: {kind: multi_worker_mirrored}|' \
      -e 's/batch_size_per_replica: 64/global_batch_size: 60/' "$small" >"$scratch/files.yaml"
    common=(--set train.epochs=1 --set train.steps_per_epoch=4 --set train.threads=1 --set train.progress=none
            --set data.auto_shard=file --set data.validation_split=0.1)
    mpi 3 "$dtrain" run "$scratch/files.yaml" "${common[@]}" --run-dir "$scratch/run" >"$scratch/run.out" 2>&1 \
      || fail "3 ranks over 3 files, one without test samples, failed: $(tail -5 "$scratch/run.out")"
    grep -q '"test_samples": 500,' "$scratch/run/metrics.jsonl" \
      || fail "the 500 test samples of the files were not evaluated once: $(cat "$scratch/run/metrics.jsonl")"
    ckpt=$(ls "$scratch"/run/checkpoints/ckpt-*.h5 | tail -1)
    test_line() { grep -E "^$1 Loss" "$2" | sed 's/ *[0-9]* samples.*//'; }
    "$dtrain" eval --checkpoint "$ckpt" --predictions "$scratch/p1.h5" >"$scratch/eval1" 2>&1 || fail "eval failed"
    "$dtrain" eval --checkpoint "$ckpt" --split validation >"$scratch/val1" 2>&1 || fail "eval --split validation failed"
    # The training global batch of 2 cannot reach 3 workers; evaluation's own batch of 30 does.
    mpi 3 "$dtrain" eval --checkpoint "$ckpt" --set data.global_batch_size=2 --set data.eval_batch_size=30 \
      --predictions "$scratch/p3.h5" >"$scratch/eval3" 2>&1 || fail "mpirun -n 3 eval failed: $(cat "$scratch/eval3")"
    mpi 3 "$dtrain" eval --checkpoint "$ckpt" --split validation >"$scratch/val3" 2>&1 \
      || fail "mpirun -n 3 eval --split validation failed: $(cat "$scratch/val3")"
    grep -q '500 samples' "$scratch/eval3" || fail "3 ranks did not evaluate the 500 test samples: $(cat "$scratch/eval3")"
    [ -n "$(test_line Test "$scratch/eval1")" ] && [ "$(test_line Test "$scratch/eval1")" = "$(test_line Test "$scratch/eval3")" ] \
      || fail "test figures differ: '$(test_line Test "$scratch/eval1")' / '$(test_line Test "$scratch/eval3")'"
    [ -n "$(test_line Validation "$scratch/val1")" ] &&
      [ "$(test_line Validation "$scratch/val1")" = "$(test_line Validation "$scratch/val3")" ] \
      || fail "validation figures differ: '$(test_line Validation "$scratch/val1")' / '$(test_line Validation "$scratch/val3")'"
    grep -qF "$(test_line Validation "$scratch/val1")" "$scratch/run.out" \
      || fail "eval's validation figures are not training's: $(test_line Validation "$scratch/val1") / $(grep Epoch "$scratch/run.out")"
    /usr/bin/python3 - "$scratch/p1.h5" "$scratch/p3.h5" <<'EOF' || fail "the predictions of 3 ranks are not one process's"
import sys, h5py, numpy as np
one, three = (h5py.File(f, "r") for f in sys.argv[1:])
assert one["labels"].shape[0] == three["labels"].shape[0] == 500, (one["labels"].shape, three["labels"].shape)
assert np.array_equal(one["labels"][()], three["labels"][()]), "labels differ"
assert np.allclose(one["logits"][()], three["logits"][()], rtol=1e-5, atol=1e-6), "logits differ"
EOF
    # Under mpirun every rank's eval-batch refusal is the chief's one line, without an abort.
    mpi 3 "$dtrain" eval --checkpoint "$ckpt" --set data.eval_batch_size=2 >"$scratch/bad_eval.out" 2>&1
    rc=$?
    [ "$rc" -eq 2 ] || fail "an eval batch of 2 over 3 workers: exit $rc, wanted 2"
    [ "$(grep -c '^dtrain: error:' "$scratch/bad_eval.out")" -eq 1 ] || fail "wanted one error line: $(cat "$scratch/bad_eval.out")"
    grep -q "MPI_ABORT" "$scratch/bad_eval.out" && fail "an eval batch of 2 over 3 workers: the job was aborted"
    # A bad label in the third file, which rank 2 alone reads: it reports it with its rank, the
    # chief says so, exit 2, no abort.
    # bad_copy SRC DST SAMPLE LABEL: SRC with training label LABEL at SAMPLE, written to DST.
    bad_copy() {
      /usr/bin/python3 - "$@" <<'EOF' || fail "could not write $2"
import sys, h5py
src_path, dst_path, sample, label = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
with h5py.File(src_path, "r") as src, h5py.File(dst_path, "w") as out:
    for group in ("train", "test"):
        for name in ("x", "y"):
            out[f"{group}/{name}"] = src[f"{group}/{name}"][()]
    y = out["train/y"][()]
    y[sample] = label
    out["train/y"][...] = y
EOF
    }
    # bad_shards NAME RANKS SHARDS PATTERN...: RANKS ranks on SHARDS exit 2, without an abort, and
    # print a line matching each PATTERN.
    bad_shards() {
      local name=$1 ranks=$2 shards=$3 pattern
      shift 3
      mpi "$ranks" "$dtrain" run "$scratch/files.yaml" "${common[@]}" --set "data.shards=$shards" \
        --run-dir "$scratch/$name" >"$scratch/$name.out" 2>&1
      local rc=$?
      [ "$rc" -eq 2 ] || fail "$name: exit $rc, wanted 2: $(cat "$scratch/$name.out")"
      for pattern in "$@"; do
        grep -q "$pattern" "$scratch/$name.out" || fail "$name: no line '$pattern': $(cat "$scratch/$name.out")"
      done
      grep -q "MPI_ABORT" "$scratch/$name.out" && fail "$name: the job was aborted"
    }
    # A bad label in rank 2's file: rank 2 reports it, the chief says another rank failed.
    bad_copy "$scratch/no_test.h5" "$scratch/bad_label.h5" 5 12
    bad_shards bad 3 "[$scratch/fm-00000-of-00002.h5, $scratch/fm-00001-of-00002.h5, $scratch/bad_label.h5]" \
      "^dtrain: error: rank 2: .*bad_label.h5 /train/y: label 12 of sample 5 is outside 0..9" \
      "^dtrain: error: other ranks failed building the model or checking the data"
    # Both ranks' files bad, each its own way: each reports its own with its rank.
    bad_copy "$scratch/fm-00000-of-00002.h5" "$scratch/bad_first.h5" 7 13
    bad_shards bad2 2 "[$scratch/bad_first.h5, $scratch/bad_label.h5]" \
      "^dtrain: error: rank 0: .*bad_first.h5 /train/y: label 13 of sample 7" \
      "^dtrain: error: rank 1: .*bad_label.h5 /train/y: label 12 of sample 5"
    # A resume on another worker count reads other files per worker: said, with what a resume
    # within the epoch does to it.
    mpi 2 "$dtrain" resume "$scratch/run" --set train.epochs=2 >"$scratch/resume.out" 2>&1 \
      || fail "resume on 2 ranks failed: $(tail -5 "$scratch/resume.out")"
    grep -q "warning: the checkpoint was written by 3 replicas in 3 processes, this run has 2 replicas in 2 processes; under data.auto_shard: file each worker reads files of its own" \
      "$scratch/resume.out" || fail "no warning that the workers read other files: $(grep -E 'note|warning' "$scratch/resume.out")"
    grep -q "last bits" "$scratch/resume.out" && fail "the resume says only the last bits change"
    ;;
  exact_eval)
    "$dtrain" run "$small" --set train.epochs=1 --set train.progress=none --run-dir "$scratch/run" >/dev/null || fail "run failed"
    ckpt="$scratch/run/checkpoints/ckpt-32.h5"
    for n in 1 2 4; do
      if [ "$n" -eq 1 ]; then "$dtrain" eval --checkpoint "$ckpt" >"$scratch/eval$n" || fail "eval failed"
      else mpi "$n" "$dtrain" eval --checkpoint "$ckpt" >"$scratch/eval$n" 2>&1 || fail "mpirun -n $n eval failed: $(cat "$scratch/eval$n")"; fi
      grep '^Test' "$scratch/eval$n"
      grep -q '500 samples' "$scratch/eval$n" || fail "$n ranks did not evaluate exactly the 500 test samples once"
    done
    acc() { sed -nE 's/.*Test Accuracy: ([0-9.]+).*/\1/p' "$scratch/eval$1"; }
    [ "$(acc 1)" = "$(acc 2)" ] && [ "$(acc 1)" = "$(acc 4)" ] || fail "test accuracy differs: $(acc 1) / $(acc 2) / $(acc 4)"
    ;;
  resume_other_world)
    # A checkpoint written by 2 ranks goes on with 4 ranks or in one process. With a fixed global
    # batch and data sharding each step takes the same samples whatever the world, so the result
    # matches the uninterrupted 2-rank run up to the order of floating-point sums.
    sed 's/batch_size_per_replica: 64/global_batch_size: 128/' "$small" >"$scratch/global128.yaml"
    small="$scratch/global128.yaml"
    common=(--set train.threads=1 --set train.progress=none
            --set "strategy={kind: multi_worker_mirrored, communication: {implementation: ring}}")
    mpi 2 "$dtrain" run "$small" "${common[@]}" --set train.epochs=2 --run-dir "$scratch/ref" >"$scratch/ref.out" 2>&1 \
      || fail "reference failed: $(tail -5 "$scratch/ref.out")"
    for world in 4 1; do
      run="$scratch/from2to$world"
      mpi 2 "$dtrain" run "$small" "${common[@]}" --set train.epochs=1 --run-dir "$run" >"$run.out" 2>&1 || fail "first epoch failed"
      if [ "$world" -eq 1 ]; then "$dtrain" resume "$run" --set train.epochs=2 >>"$run.out" 2>&1 || fail "resume in one process failed"
      else mpi "$world" "$dtrain" resume "$run" --set train.epochs=2 >>"$run.out" 2>&1 || fail "resume with $world ranks failed: $(tail -5 "$run.out")"; fi
      grep -q "Resuming from .*ckpt-16.h5 at epoch 2" "$run.out" || fail "did not resume from the epoch-1 checkpoint"
      tools/compare_weights "$run/checkpoints/ckpt-32.h5" "$scratch/ref/checkpoints/ckpt-32.h5" --rtol 1e-4 \
        || fail "2 ranks then $world differ from 2 ranks throughout"
      echo "ok: a 2-rank checkpoint resumed with $world rank(s) ends where the 2-rank run ends (1e-4)"
    done
    ;;
  roles)
    # An evaluator rank takes no part in training and evaluates each checkpoint; its figures for
    # the epoch-end checkpoint are the chief's Test figures of that epoch (same weights, same set).
    common=(--set train.epochs=2 --set train.threads=1 --set train.progress=none)
    # evaluated_run NAME MPIRUN-ARGS...: 3 ranks, rank 2 the evaluator, into $scratch/NAME (output
    # in $scratch/NAME.out); wants one evaluation per epoch. The evaluator takes the newest
    # checkpoint when several arrived since its last look, so the two training ranks hold after
    # the first step past the epoch-1 checkpoint (ckpt-16) until the evaluator has written its
    # line for it: on a fast machine both checkpoints came within one look.
    evaluated_run() {
      local name=$1
      shift
      hold_env "$scratch/$name.hold" 17
      env "${hold[@]}" timeout 300 mpirun -n 3 --oversubscribe "$@" --run-dir "$scratch/$name" >"$scratch/$name.out" 2>&1 &
      local launcher=$!
      wait_held "$scratch/$name.hold" 2 "$launcher"
      for _ in $(seq 1 6000); do
        [ "$(wc -l <"$scratch/$name/evaluator.jsonl" 2>/dev/null || echo 0)" -ge 1 ] && break
        kill -0 "$launcher" 2>/dev/null || fail "$name: the run ended before the evaluator's first line"
        sleep 0.05
      done
      grep -q '"checkpoint": "ckpt-16.h5"' "$scratch/$name/evaluator.jsonl" ||
        fail "$name: the evaluator's first line is not ckpt-16.h5: $(cat "$scratch/$name/evaluator.jsonl" 2>/dev/null)"
      release_hold "$scratch/$name.hold"
      wait "$launcher" || fail "$name: the run failed: $(tail -5 "$scratch/$name.out")"
      [ "$(wc -l <"$scratch/$name/evaluator.jsonl")" -eq 2 ] || fail "$name: wanted 2 evaluations: $(cat "$scratch/$name/evaluator.jsonl")"
    }
    evaluated_run eval_role "$dtrain" run "$small" "${common[@]}" --set "strategy={kind: multi_worker_mirrored, roles: {evaluator: 1}}"
    grep -q "roles (strategy.roles): 1 chief, 1 worker, 1 evaluator; rank 2 evaluates" "$scratch/eval_role.out" || fail "no roles line"
    grep -q "| workers 2 | replicas 2 " "$scratch/eval_role.out" || fail "the evaluator must not train: $(grep '^dtrain' "$scratch/eval_role.out")"
    # It restores each checkpoint on its own layout (1 replica, not the training's 2) and resumes
    # nothing: resume's note of a layout change is not its to print.
    grep -q "checkpoint was written by" "$scratch/eval_role.out" &&
      fail "the evaluator printed resume's layout note: $(grep "checkpoint was written by" "$scratch/eval_role.out" | head -1)"
    chief=$(sed -nE 's/^Epoch 2, .*Test Loss: ([0-9.]+), Test Accuracy: ([0-9.]+).*/\1 \2/p' "$scratch/eval_role.out")
    evaluator=$(sed -nE 's/^Evaluator: ckpt-32.h5 .*Test Loss: ([0-9.]+), Test Accuracy: ([0-9.]+).*/\1 \2/p' "$scratch/eval_role.out")
    [ -n "$chief" ] && [ "$chief" = "$evaluator" ] || fail "evaluator '$evaluator' differs from the chief's epoch 2 '$chief'"
    echo "ok: the evaluator rank reports Test Loss/Accuracy $evaluator for the final checkpoint, as the chief does"

    # TF_CONFIG, one per rank (its task from the MPI rank), gives the same roles.
    cat >"$scratch/tf_config.sh" <<'EOF'
#!/usr/bin/env bash
r=$OMPI_COMM_WORLD_RANK
case $r in 0) task='"chief", "index": 0' ;; 1) task='"worker", "index": 0' ;; *) task='"evaluator", "index": 0' ;; esac
export TF_CONFIG="{\"cluster\": {\"chief\": [\"h0:2222\"], \"worker\": [\"h1:2222\"], \"evaluator\": [\"h2:2222\"]}, \"task\": {\"type\": $task}}"
exec "$@"
EOF
    chmod +x "$scratch/tf_config.sh"
    evaluated_run tf "$scratch/tf_config.sh" "$dtrain" run "$small" "${common[@]}" --set "strategy={kind: multi_worker_mirrored}"
    grep -q "roles (TF_CONFIG): 1 chief, 1 worker, 1 evaluator" "$scratch/tf.out" || fail "TF_CONFIG roles not used"
    # The chief's and the evaluator's lines each in their own order: how the two ranks' lines
    # interleave in mpirun's output is a race.
    for lines in '^Epoch' '^Evaluator: ckpt'; do
      cmp <(grep -v samples/s "$scratch/tf.out" | grep "$lines") <(grep -v samples/s "$scratch/eval_role.out" | grep "$lines") \
        || fail "TF_CONFIG run differs in its '$lines' lines"
    done

    # Disagreements are refused before any training (exit 2), saying what disagrees.
    TF_CONFIG='{"cluster": {"worker": ["a:1", "b:1", "c:1", "d:1"]}, "task": {"type": "worker", "index": 0}}' \
      mpi 2 -x TF_CONFIG "$dtrain" run "$small" "${common[@]}" --set "strategy={kind: multi_worker_mirrored}" \
      --run-dir "$scratch/bad_tf" >"$scratch/bad_tf.out" 2>&1
    rc=$?
    [ "$rc" -eq 2 ] || fail "TF_CONFIG with 4 tasks under 2 ranks: exit $rc, wanted 2"
    grep -q "TF_CONFIG describes 4 tasks (0 chief, 4 workers, 0 evaluator) but mpirun started 2 ranks" "$scratch/bad_tf.out" \
      || fail "no clear TF_CONFIG error: $(head -3 "$scratch/bad_tf.out")"
    mpi 2 "$dtrain" run "$small" "${common[@]}" --set "strategy={kind: multi_worker_mirrored, roles: {worker: 3}}" \
      --run-dir "$scratch/bad_roles" >"$scratch/bad_roles.out" 2>&1
    rc=$?
    [ "$rc" -eq 2 ] || fail "roles for 4 ranks under 2: exit $rc, wanted 2"
    grep -q "strategy.roles (1 chief, 3 workers) name 4 ranks, but mpirun started 2" "$scratch/bad_roles.out" \
      || fail "no clear roles error: $(head -3 "$scratch/bad_roles.out")"
    # Both are every rank's error: the chief's one line, and the job ends without an abort (each
    # rank printed it, and MPI_ABORT made the others announce a checkpoint they never wrote).
    for out in bad_tf bad_roles; do
      [ "$(grep -c '^dtrain: error:' "$scratch/$out.out")" -eq 1 ] || fail "$out: wanted one error line: $(cat "$scratch/$out.out")"
      grep -q "MPI_ABORT" "$scratch/$out.out" && fail "$out: the job was aborted"
      grep -q "stopping after this step" "$scratch/$out.out" && fail "$out: a rank announced a checkpoint"
    done
    # A TF_CONFIG wrong on one rank alone (both say worker 0): that rank reports it with its rank,
    # the chief says others failed, exit 2, no abort.
    cat >"$scratch/tf_twice.sh" <<'EOF'
#!/usr/bin/env bash
export TF_CONFIG='{"cluster": {"worker": ["h0:1", "h1:1"]}, "task": {"type": "worker", "index": 0}}'
exec "$@"
EOF
    chmod +x "$scratch/tf_twice.sh"
    mpi 2 "$scratch/tf_twice.sh" "$dtrain" run "$small" "${common[@]}" --set "strategy={kind: multi_worker_mirrored}" \
      --run-dir "$scratch/tf_twice" >"$scratch/tf_twice.out" 2>&1
    rc=$?
    [ "$rc" -eq 2 ] || fail "TF_CONFIG of worker 0 on both ranks: exit $rc, wanted 2: $(cat "$scratch/tf_twice.out")"
    grep -q "^dtrain: error: rank 1: TF_CONFIG says this process is worker 0, which is rank 0" "$scratch/tf_twice.out" \
      || fail "the rank whose TF_CONFIG is wrong did not say so: $(cat "$scratch/tf_twice.out")"
    grep -q "^dtrain: error: other ranks failed assigning the roles" "$scratch/tf_twice.out" \
      || fail "the chief did not say that another rank failed: $(cat "$scratch/tf_twice.out")"
    grep -q "MPI_ABORT" "$scratch/tf_twice.out" && fail "TF_CONFIG wrong on one rank: the job was aborted"
    [ ! -e "$scratch/tf_twice" ] || fail "TF_CONFIG wrong on one rank: the run directory was written"
    # TF_CONFIGs that each fit their rank but describe different jobs (a chief and a worker; two
    # workers) are refused before the ranks split: the chief's one line, exit 2.
    cat >"$scratch/tf_other_jobs.sh" <<'EOF'
#!/usr/bin/env bash
if [ "$OMPI_COMM_WORLD_RANK" = 0 ]; then
  export TF_CONFIG='{"cluster": {"chief": ["h0:1"], "worker": ["h1:1"]}, "task": {"type": "chief", "index": 0}}'
else
  export TF_CONFIG='{"cluster": {"worker": ["h0:1", "h1:1"]}, "task": {"type": "worker", "index": 1}}'
fi
exec "$@"
EOF
    chmod +x "$scratch/tf_other_jobs.sh"
    mpi 2 "$scratch/tf_other_jobs.sh" "$dtrain" run "$small" "${common[@]}" --set "strategy={kind: multi_worker_mirrored}" \
      --run-dir "$scratch/tf_other_jobs" >"$scratch/tf_other_jobs.out" 2>&1
    rc=$?
    [ "$rc" -eq 2 ] || fail "TF_CONFIGs of different jobs: exit $rc, wanted 2: $(cat "$scratch/tf_other_jobs.out")"
    [ "$(grep -c '^dtrain: error:' "$scratch/tf_other_jobs.out")" -eq 1 ] \
      || fail "TF_CONFIGs of different jobs: wanted one error line: $(cat "$scratch/tf_other_jobs.out")"
    grep -q "^dtrain: error: the ranks' TF_CONFIG describe different jobs (rank 0's: 1 chief, 1 worker)" \
      "$scratch/tf_other_jobs.out" || fail "TF_CONFIGs of different jobs: no clear error: $(cat "$scratch/tf_other_jobs.out")"
    grep -q "MPI_ABORT" "$scratch/tf_other_jobs.out" && fail "TF_CONFIGs of different jobs: the job was aborted"
    ;;
  regularization)
    # L2 is divided by the replicas in sync over ALL workers, whatever each worker's replica count:
    # one step of 1 process x 1 replica (global 64), 2 ranks x 1 replica and 2 ranks x 2 local
    # replicas ends on the same weights and reports the same loss. The strong L2 makes any
    # mistake in the division show.
    sed -e 's/- dense: {units: 64, activation: relu}/- dense: {units: 64, activation: relu, kernel_regularizer: {l2: 0.05}}/' \
        -e 's/- dense: {units: 10}/- dense: {units: 10, kernel_regularizer: {l2: 0.05}}/' "$small" >"$scratch/l2.yaml"
    grep -q "l2: 0.05}}" "$scratch/l2.yaml" || fail "could not add the regularizers"
    "$dtrain" run "$scratch/l2.yaml" "${one_step[@]}" --run-dir "$scratch/default" >"$scratch/default.out" 2>&1 \
      || fail "default run failed: $(tail -3 "$scratch/default.out")"
    loss() { sed -nE 's/^Epoch 1, Loss: ([0-9.]+),.*/\1/p' "$1"; }
    for spec in "2 32 auto" "2 16 [cpu:0, cpu:1]"; do
      read -r n per devices <<<"$spec"
      run="$scratch/mw_${n}_${per}"
      mpi "$n" "$dtrain" run "$scratch/l2.yaml" "${one_step[@]}" --set data.batch_size_per_replica="$per" \
        --set "strategy={kind: multi_worker_mirrored, devices: $devices, communication: {timeout_seconds: 60}}" \
        --run-dir "$run" >"$run.out" 2>&1 || fail "mpirun -n $n with devices $devices failed: $(tail -5 "$run.out")"
      tools/compare_weights "$run/checkpoints/ckpt-1.h5" "$scratch/default/checkpoints/ckpt-1.h5" --rtol 1e-5 \
        || fail "$n workers with devices $devices differ from the default strategy after one step"
      awk -v a="$(loss "$run.out")" -v b="$(loss "$scratch/default.out")" \
        'BEGIN { exit !(a != "" && (a - b) ^ 2 <= (1e-4 * b) ^ 2) }' \
        || fail "loss $(loss "$run.out") with $n workers x devices $devices, $(loss "$scratch/default.out") in one process"
      echo "ok: $n workers x devices $devices: loss $(loss "$run.out"), weights as the default strategy"
    done
    ;;
  overlap)
    # Each pack's all-reduce overlapping backward gives the same bits as summing after backward:
    # the same packs in the same order. Several packs (4 KiB and 64 KiB), both implementations,
    # L2 on (its gradient is added layer by layer before the hand-over), 2 and 3 ranks.
    sed -e 's/- dense: {units: 64, activation: relu}/- dense: {units: 64, activation: relu, kernel_regularizer: {l2: 0.001}}/' \
      "$small" >"$scratch/l2.yaml"
    common=(--set train.epochs=1 --set train.steps_per_epoch=6 --set train.threads=1 --set train.progress=none)
    for spec in "2 mpi 4096" "2 ring 65536" "3 ring 4096"; do
      read -r n impl bytes <<<"$spec"
      for overlap in true false; do
        run="$scratch/${n}_${impl}_${bytes}_$overlap"
        mpi "$n" "$dtrain" run "$scratch/l2.yaml" "${common[@]}" --run-dir "$run" --set "strategy={kind: multi_worker_mirrored,
          communication: {implementation: $impl, bytes_per_pack: $bytes, overlap: $overlap, timeout_seconds: 60}}" \
          >"$run.out" 2>&1 || fail "mpirun -n $n ($impl, $bytes, overlap $overlap) failed: $(tail -5 "$run.out")"
      done
      on="$scratch/${n}_${impl}_${bytes}_true" off="$scratch/${n}_${impl}_${bytes}_false"
      grep -q "packs of $bytes bytes, overlapping backward" "$on.out" || fail "header: $(grep '^dtrain' "$on.out")"
      grep -q "ms/step in flight overlapping backward, [0-9.]* ms/step waited for" "$on.out" || fail "no wait figure: $(grep samples/s "$on.out")"
      grep -q "overlapping" "$off.out" && fail "overlap false still overlaps"
      h5diff "$on/checkpoints/ckpt-6.h5" "$off/checkpoints/ckpt-6.h5" /model /model >/dev/null \
        || fail "$n ranks, $impl, packs of $bytes: overlapped sums differ from sums after backward"
      cmp <(grep '^Epoch' "$on.out") <(grep '^Epoch' "$off.out") || fail "epoch lines differ"
      echo "ok: $n ranks, $impl, packs of $bytes bytes: overlap on and off end on the same bits"
    done
    ;;
  kill_rank)
    # Reference: 4 ranks, 3 epochs of 32 steps, uninterrupted. Checkpoints every 10 steps as well
    # as at each epoch's end, so a resume may start in the middle of an epoch.
    common=(--set train.epochs=3 --set train.threads=1 --set train.progress=none --set data.batch_size_per_replica=16
            --set checkpoint.every_steps=10 --set checkpoint.max_to_keep=20 --set "$(mwm mpi)")
    mpi 4 "$dtrain" run "$small" "${common[@]}" --run-dir "$scratch/ref" >"$scratch/ref.out" 2>&1 || fail "reference failed"
    # Kill points: up to 0.09 s (a few steps: random) after the checkpoint of step 10 (epoch 1),
    # 30 (epoch 1), 50 (epoch 2) and 70 (epoch 3) of 96; each time another rank is the victim,
    # the chief included.
    for point in 1 2 3 4; do
      run="$scratch/killed$point"
      after=$(cut -d' ' -f"$point" <<<"10 30 50 70")
      # Every rank holds at a random step after that checkpoint, and the victim dies there.
      hold_env "$run.hold" $((after + 1 + RANDOM % 9))
      env "${hold[@]}" timeout 300 mpirun -n 4 --oversubscribe "$dtrain" run "$small" "${common[@]}" --run-dir "$run" \
        >"$run.out" 2>&1 &
      launcher=$!
      wait_held "$run.hold" 4 "$launcher"
      [ -e "$run/checkpoints/ckpt-$after.h5" ] || fail "checkpoint ckpt-$after.h5 was never written"
      victim_rank=$(cut -d' ' -f"$point" <<<"2 0 3 1")
      victim=$(rank_pids "$run" | awk -v r="$victim_rank" '$2 == r {print $1}')
      [ -n "$victim" ] || fail "rank $victim_rank not found"
      echo "killing rank $victim_rank (pid $victim)"
      start=$SECONDS
      kill -9 "$victim"
      wait "$launcher"
      rc=$?
      elapsed=$((SECONDS - start))
      [ "$rc" -ne 0 ] || fail "mpirun returned 0 after a rank was killed"
      [ "$elapsed" -le 60 ] || fail "mpirun took ${elapsed}s to notice the dead rank"
      grep -Eiq "rank [0-9]+ .*(killed|signal 9)|signal 9" "$run.out" || fail "the output does not name the dead rank: $(tail -20 "$run.out")"
      grep -Ei "rank|signal" "$run.out" | head -3
      mpi 4 "$dtrain" resume "$run" >"$run.resume.out" 2>&1 || fail "resume failed: $(tail -5 "$run.resume.out")"
      h5diff "$scratch/ref/checkpoints/ckpt-96.h5" "$run/checkpoints/ckpt-96.h5" /model /model >/dev/null \
        || fail "final weights after resume differ from the uninterrupted 4-rank run"
      grep -o "Resuming from .*" "$run.resume.out" | head -1
      echo "ok: kill point $point, mpirun exit $rc after ${elapsed}s, resumed bitwise equal"
    done
    ;;
  watchdog)
    # A rank that stops answering (SIGSTOP: alive but stuck) must not hang the others: after the
    # timeout every live rank names it, and the job is aborted with exit code 5.
    mpi 3 "$dtrain" run "$small" --set train.epochs=50 --set train.threads=1 --set train.progress=none \
      --set data.batch_size_per_replica=16 --set "strategy={kind: multi_worker_mirrored, communication: {timeout_seconds: 5}}" \
      --run-dir "$scratch/run" >"$scratch/out" 2>&1 &
    launcher=$!
    for _ in $(seq 1 600); do [ -s "$scratch/run/metrics.jsonl" ] && break; sleep 0.05; done
    [ -s "$scratch/run/metrics.jsonl" ] || fail "epoch 1 never finished"
    [ "$(rank_pids "$scratch/run" | wc -l)" -eq 3 ] || fail "wanted 3 rank processes: $(rank_pids "$scratch/run")"
    stuck=$(rank_pids "$scratch/run" | awk '$2 == 2 {print $1}')
    [ -n "$stuck" ] || fail "rank 2 not found"
    kill -STOP "$stuck"
    start=$SECONDS
    wait "$launcher"
    rc=$?
    elapsed=$((SECONDS - start))
    cat "$scratch/out" | grep -v '^Epoch\|samples/s' | head -8
    [ "$rc" -ne 0 ] || fail "mpirun returned 0"
    [ "$elapsed" -le 60 ] || fail "the job took ${elapsed}s to abort"
    grep -q "did not complete within 5 s; ranks that did not arrive: rank 2 (no answer" "$scratch/out" \
      || fail "no rank named the stuck rank 2"
    for live in 0 1; do
      grep -q "^dtrain: rank $live: .*ranks that did not arrive: .*rank 2 (no answer" "$scratch/out" || fail "live rank $live did not report"
    done
    # Under --enable-recovery mpirun exits 0 whatever the ranks did, so tools/dtrain-mpirun takes
    # the chief's recorded code: the chief records 5 as it times out (or hears that another rank
    # did) before the abort ends it. It recorded nothing, and the script said 1.
    # (timeout -k: the script traps SIGTERM; the stopped rank is killed whatever becomes of the job.)
    trap 'kill -KILL "${stuck:-}" 2>/dev/null' EXIT
    timeout -k 10 300 tools/dtrain-mpirun -n 3 --oversubscribe --enable-recovery "$dtrain" run "$small" --set train.epochs=50 \
      --set train.threads=1 --set train.progress=none --set data.batch_size_per_replica=16 \
      --set "strategy={kind: multi_worker_mirrored, communication: {timeout_seconds: 5}}" \
      --run-dir "$scratch/recovery" >"$scratch/recovery.out" 2>&1 &
    launcher=$!
    for _ in $(seq 1 600); do [ -s "$scratch/recovery/metrics.jsonl" ] && break; sleep 0.05; done
    [ -s "$scratch/recovery/metrics.jsonl" ] || fail "epoch 1 never finished under --enable-recovery"
    stuck=$(rank_pids "$scratch/recovery" | awk '$2 == 2 {print $1}')
    [ -n "$stuck" ] || fail "rank 2 not found under --enable-recovery"
    kill -STOP "$stuck"
    wait "$launcher"
    rc=$?
    [ "$rc" -eq 5 ] || fail "tools/dtrain-mpirun --enable-recovery exited $rc after the watchdog, wanted 5: $(grep dtrain "$scratch/recovery.out" | tail -3)"
    echo "ok: tools/dtrain-mpirun --enable-recovery exits 5 after the watchdog's abort"
    ;;
  uneven)
    # A global batch of 65, which 2 and 3 workers do not divide: each worker takes its replicas'
    # rows of every global batch one process takes (33 + 32; 22 + 22 + 21; the short last batch
    # of 50 too), so a whole epoch has the default strategy's 31 steps, epoch line and weights.
    sed '/batch_size_per_replica/d' "$small" >"$scratch/g65.yaml"
    common=(--set train.epochs=1 --set train.threads=1 --set train.progress=none --set data.global_batch_size=65)
    "$dtrain" run "$scratch/g65.yaml" "${common[@]}" --run-dir "$scratch/default" >"$scratch/default.out" 2>&1 \
      || fail "default run failed: $(tail -3 "$scratch/default.out")"
    grep -q "(31 steps" "$scratch/default.out" || fail "one process: wanted 31 steps: $(head -2 "$scratch/default.out")"
    epoch_numbers() { grep '^Epoch 1,' "$1" | grep -oE '[0-9]+\.[0-9]+'; }
    for n in 2 3; do
      run="$scratch/mw$n"
      mpi "$n" "$dtrain" run "$scratch/g65.yaml" "${common[@]}" --set "$(mwm ring)" --set data.auto_shard=data \
        --run-dir "$run" >"$run.out" 2>&1 || fail "mpirun -n $n failed: $(tail -5 "$run.out")"
      grep -q "(31 steps" "$run.out" || fail "$n workers: wanted 31 steps: $(grep steps "$run.out" | head -2)"
      paste <(epoch_numbers "$scratch/default.out") <(epoch_numbers "$run.out") | awk -v n="$n" '
        { c++; d = $1 - $2; if (d < 0) d = -d; if (d > 1.5e-4 && !(NR % 2 == 0 && d <= 0.011)) bad = bad " " $1 "/" $2 }
        END { if (c != 4 || bad != "") { print n " workers: epoch line differs:" bad " (" c " numbers)"; exit 1 } }' \
        || fail "epoch lines: $(grep '^Epoch 1,' "$scratch/default.out") / $(grep '^Epoch 1,' "$run.out")"
      # Float rounding alone moves 31 Adam steps of N replicas about 2e-4 from one replica; N
      # mirrored replicas in one process take the same rows, so they match the workers closely.
      tools/compare_weights "$run/checkpoints/ckpt-31.h5" "$scratch/default/checkpoints/ckpt-31.h5" --rtol 1e-3 \
        || fail "$n workers differ from the default strategy after an epoch of global batch 65"
      devices=$(seq -s, -f 'cpu:%g' 0 $((n - 1)))
      "$dtrain" run "$scratch/g65.yaml" "${common[@]}" --set "strategy={kind: mirrored, devices: [$devices]}" \
        --run-dir "$scratch/mirrored$n" >/dev/null 2>&1 || fail "mirrored over $n devices failed"
      tools/compare_weights "$run/checkpoints/ckpt-31.h5" "$scratch/mirrored$n/checkpoints/ckpt-31.h5" --rtol 1e-6 \
        || fail "$n workers differ from $n mirrored replicas after an epoch of global batch 65"
      echo "ok: global batch 65 over $n workers: 31 steps, the default strategy's epoch line, $n mirrored replicas' weights"
    done
    # Where each worker reads only its own data, a global batch they do not divide is refused.
    mpi 2 "$dtrain" run "$scratch/g65.yaml" "${common[@]}" --set "$(mwm ring)" --set data.auto_shard=off \
      --run-dir "$scratch/off" >"$scratch/off.out" 2>&1
    rc=$?
    [ "$rc" -eq 2 ] || fail "auto_shard off with global batch 65 over 2 workers: exit $rc, wanted 2"
    grep -q "^dtrain: error: --set data.global_batch_size=65: data.global_batch_size 65 does not divide among the 2 workers, and under data.auto_shard off" \
      "$scratch/off.out" || fail "no clear refusal: $(grep error "$scratch/off.out" | head -2)"
    [ "$(grep -c '^dtrain: error:' "$scratch/off.out")" -eq 1 ] || fail "wanted the chief's error alone: $(cat "$scratch/off.out")"
    ;;
  tiny_batch)
    # A global (or evaluation) batch smaller than the worker count: every rank finds it alike, so
    # the chief reports it once, at the key's --set or file:line:column, and every rank exits 2
    # without an MPI abort and before writing anything.
    sed '/batch_size_per_replica/d' "$small" >"$scratch/g.yaml"
    for key in global_batch_size eval_batch_size; do
      extra=(--set data.global_batch_size=4)
      [ "$key" = global_batch_size ] && extra=()
      mpi 2 "$dtrain" run "$scratch/g.yaml" "${one_step[@]}" --set "$(mwm mpi)" "${extra[@]}" --set "data.$key=1" \
        --run-dir "$scratch/$key" >"$scratch/$key.out" 2>"$scratch/$key.err"
      rc=$?
      cat "$scratch/$key.err"
      [ "$rc" -eq 2 ] || fail "$key 1 over 2 workers: exit $rc, wanted 2"
      [ "$(grep -c '^dtrain: error:' "$scratch/$key.err")" -eq 1 ] || fail "$key: wanted one error line, the chief's"
      grep -q "^dtrain: error: --set data.$key=1: data.$key 1 leaves some of the 2 workers without samples" \
        "$scratch/$key.err" || fail "$key: no located error"
      grep -q "MPI_ABORT" "$scratch/$key.err" "$scratch/$key.out" && fail "$key: the job was aborted"
      [ ! -e "$scratch/$key" ] || fail "$key: the run directory was written"
    done
    # So does a global batch that tf.distribute's split leaves a worker none of (9 over 4: 3, 3,
    # 3, 0), an experiment no rank can load (a key the layer does not have) and a data file no
    # rank can read: the chief's one line, exit 2, no abort. (Every rank printed the bad key or
    # file, and the job ended in MPI_ABORT.)
    for bad in "data.global_batch_size=9" "model.layers.0.conv2d.stride=2" "data.path=$scratch/missing.h5"; do
      name=${bad%%=*}
      mpi 4 "$dtrain" run "$scratch/g.yaml" "${one_step[@]}" --set "$(mwm mpi)" --set "$bad" \
        --run-dir "$scratch/$name" >"$scratch/$name.out" 2>"$scratch/$name.err"
      rc=$?
      [ "$rc" -eq 2 ] || fail "$bad over 4 workers: exit $rc, wanted 2: $(cat "$scratch/$name.err")"
      [ "$(grep -c '^dtrain: error:' "$scratch/$name.err")" -eq 1 ] || fail "$bad: wanted one error line: $(cat "$scratch/$name.err")"
      grep -q "^dtrain: error: --set $bad: " "$scratch/$name.err" || fail "$bad: not located: $(cat "$scratch/$name.err")"
      grep -q "MPI_ABORT" "$scratch/$name.err" "$scratch/$name.out" && fail "$bad: the job was aborted"
      grep -q "stopping after this step" "$scratch/$name.err" && fail "$bad: a rank announced a checkpoint"
      [ ! -e "$scratch/$name" ] || fail "$bad: the run directory was written"
      echo "ok: $bad over 4 workers: $(cat "$scratch/$name.err")"
    done
    # A data file one worker alone cannot read (shards of their own): that rank reports it with
    # its rank, the chief says others failed, exit 2, and no rank aborts the others (none waits
    # in a collective).
    mpi 2 "$dtrain" run "$scratch/g.yaml" "${one_step[@]}" --set "$(mwm mpi)" --set data.path=null \
      --set "data.shards=[$(pwd)/data/fashion_mnist_small.h5, $scratch/missing.h5]" --run-dir "$scratch/shard" \
      >"$scratch/shard.out" 2>"$scratch/shard.err"
    rc=$?
    [ "$rc" -eq 2 ] || fail "a missing shard: exit $rc, wanted 2: $(cat "$scratch/shard.err")"
    grep -q "^dtrain: error: rank 1: --set data.shards=.*$scratch/missing.h5: no such file" "$scratch/shard.err" \
      || fail "a missing shard: not reported by its rank: $(cat "$scratch/shard.err")"
    grep -q "^dtrain: error: other ranks failed loading the data" "$scratch/shard.err" \
      || fail "a missing shard: the chief did not say so: $(cat "$scratch/shard.err")"
    grep -q "MPI_ABORT" "$scratch/shard.err" "$scratch/shard.out" && fail "a missing shard: the job was aborted"
    [ ! -e "$scratch/shard" ] || fail "a missing shard: the run directory was written"
    echo "ok: a shard one worker cannot read: $(grep '^dtrain: error' "$scratch/shard.err")"
    ;;
  *) fail "unknown case" ;;
esac
echo "ok [$case_name]"
