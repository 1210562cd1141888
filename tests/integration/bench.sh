#!/usr/bin/env bash
# dtrain bench end to end, on the small experiment with few steps:
#   tests/integration/bench.sh CASE DTRAIN_BINARY SCRATCH_DIR
# The table and the JSON name every layer and every phase; the phases add up to no more than the
# step's wall time (and to most of it); the JSON parses and follows the schema in docs/performance.md.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh" "$@"

small=experiments/fashion_mnist_small.yaml
# 40 timed steps cross an epoch of the small set (2,000 samples: 31 steps of 64, the last short).
few=(--steps 40 --warmup 3 --set train.threads=1)
phases=(data forward loss backward reduction optimizer)

# check_table FILE WORKERS
check_table() {
  local out=$1 workers=$2
  cat "$out"
  grep -q "^dtrain .* | experiment fashion_mnist_small" "$out" || fail "no header line"
  grep -Eq "^timed 40 steps after 3 warm-up steps: global batch 64 .*1 short last batch" "$out" \
    || fail "no summary line (or the short batch was not left out)"
  for layer in conv2d conv2d_1 max_pooling2d_1 flatten dense dense_1; do
    grep -Eq "^$layer +[a-z_0-9]+ +[0-9.]+" "$out" || fail "no row for layer $layer"
  done
  # The first convolution computes the pooling above it (training wants no input gradient).
  grep -Eq "^max_pooling2d +max_pool2d in conv2d +[0-9.]+" "$out" || fail "no row for max_pooling2d in conv2d"
  grep -q "'in <layer>': computed" "$out" || fail "the table does not say what 'in <layer>' means"
  for p in "${phases[@]}"; do grep -Eq "^$p +[0-9.]+" "$out" || fail "no row for phase $p"; done
  grep -Eq "^sum of phases +[0-9.]+" "$out" || fail "no phase sum"
  grep -Eq "^step \(wall\) +[0-9.]+" "$out" || fail "no step time"
  grep -Eq "^throughput: [0-9.]+ samples/s x 14\.910 MFLOP/sample = [0-9.]+ GFLOP/s$" "$out" || fail "no throughput line"
  grep -Eq "^untimed layers: [0-9./]+ ms/step, [0-9.]+ samples/s = [0-9.]+ GFLOP/s \([0-9]+ more steps timed whole" "$out" || fail "no untimed line"
  grep -Eq "^GEMM peak: oneDNN matmul f32 x f32 -> f32 at [0-9]+\^3 .*training reaches [0-9.]+ % of it$" "$out" \
    || fail "no GEMM peak line"
  if [ "$workers" -gt 1 ]; then
    grep -q "times are mean/max over $workers workers" "$out" || fail "the table does not say it aggregates the workers"
  fi
}

# check_json FILE WORKERS
check_json() {
  python3 - "$1" "$2" <<'PY' || fail "the JSON does not hold what docs/performance.md promises"
import json, sys
with open(sys.argv[1]) as f:
    r = json.load(f)
workers = int(sys.argv[2])
assert r["schema"] == "dtrain.bench/1", r["schema"]
assert r["workers"] == workers and r["steps"] == 40 and r["warmup_steps"] == 3, r
assert r["global_batch"] == 64 and r["steps_left_out"] == 1, r
phases = ["data", "forward", "loss", "backward", "reduction", "optimizer"]
assert sorted(r["phases_ms"]) == sorted(phases), r["phases_ms"]
for p in phases:
    s = r["phases_ms"][p]
    assert 0 <= s["mean"] <= s["max"], (p, s)
total = sum(r["phases_ms"][p]["mean"] for p in phases)
assert abs(total - r["phase_sum_ms"]["mean"]) < 1e-6 * max(1, total), (total, r["phase_sum_ms"])
step = r["step_ms"]["mean"]
# Each phase is a piece of the step's wall time; what is left is dispatch between them.
assert 0.5 * step < total <= step * (1 + 1e-9), (total, step)
names = [l["name"] for l in r["layers"]]
assert names == ["conv2d", "max_pooling2d", "conv2d_1", "max_pooling2d_1", "flatten", "dense", "dense_1"], names
assert [l["computed_in"] for l in r["layers"]] == [None, "conv2d", None, None, None, None, None], r["layers"]
# The pair's bytes on conv2d's row: x, the pooled output (f32) and the winning position (a byte),
# and the 3x3x1x32 kernel and bias over the replica's batch; backward reads x, the pooled gradient
# and the winning position (which also holds the relu's derivative), and writes the variables'
# gradients.
replica_batch = r["global_batch"] / r["replicas_in_sync"]
variables = (288 + 32) * 4 / replica_batch
pair = r["layers"][0]["bytes_per_sample"]
assert abs(pair["forward"] - (28 * 28 * 4 + 13 * 13 * 32 * 5 + variables)) < 1e-6, pair
assert abs(pair["backward"] - (28 * 28 * 4 + 13 * 13 * 32 * 5 + 2 * variables)) < 1e-6, pair
assert r["layers"][1]["bound_ms"] == {"forward": 0, "backward": 0}, r["layers"][1]
for l in r["layers"]:
    for k in ("forward_ms", "backward_ms"):
        assert 0 <= l[k]["mean"] <= l[k]["max"], (l["name"], k, l[k])
    for k in ("backward_weights_ms", "backward_data_ms"):
        assert l[k] is None or 0 <= l[k]["mean"] <= l[k]["max"], (l["name"], k, l[k])
    assert set(l["flops_per_sample"]) == {"forward", "backward_data", "backward_weights"}, l
    # No layer of this model sums anything over the lanes (one lane here): no waits.
    assert l["lane_wait_ms"] == {"forward": {"mean": 0, "max": 0}, "backward": {"mean": 0, "max": 0}}, l
assert r["layers"][0]["flops_per_sample"]["forward"] == 432640, r["layers"][0]
assert r["layers"][0]["backward_computes_data"] is False and r["layers"][2]["backward_computes_data"] is True
assert sum(l["forward_ms"]["mean"] for l in r["layers"]) <= r["phases_ms"]["forward"]["mean"] * (1 + 1e-9)
# The seed CNN by hand: 3 x 2 x 2,528,000 multiply-adds, less conv1's input gradient, plus biases, relus, pools.
assert r["flops_per_sample"] == 14909812, r["flops_per_sample"]
assert r["samples_per_s"] > 0 and r["gflops"] > 0
# The same steps again, timed whole (the layers not timed).
assert 0 < r["untimed_step_ms"]["mean"] <= r["untimed_step_ms"]["max"], r["untimed_step_ms"]
assert abs(r["untimed_samples_per_s"] - r["global_batch"] / (r["untimed_step_ms"]["mean"] * 1e-3)) < 1e-6 * r["untimed_samples_per_s"]
assert abs(r["untimed_gflops"] - r["flops_per_sample"] * r["untimed_samples_per_s"] * 1e-9) < 1e-6 * r["untimed_gflops"]
peak = r["gemm_peak"]
assert peak["dtype"] == "f32" and peak["available"] is True, peak
assert peak["size"] in (512, 1024, 2048) and peak["gflops"] > 0, peak
# Five rounds of whole steps (each after 3 untimed ones: no more than --warmup), each followed by
# the peak at the sweep's size: each round's fraction is this worker's share of the job's FLOP rate
# then against that peak; one worker's fraction is their median (several: the mean of the
# workers' medians).
rounds = peak["worker_rounds"]
assert peak["rounds"] == 5 and len(rounds) == 5 and peak["round_warmup_steps"] == 3, peak
for x in rounds:
    share = r["flops_per_sample"] * r["global_batch"] / workers / (x["step_ms"] * 1e-3) * 1e-9
    assert x["gflops"] > 0 and abs(x["fraction"] - share / x["gflops"]) < 1e-9 * x["fraction"], x
if workers == 1:
    assert abs(peak["fraction"] - sorted(x["fraction"] for x in rounds)[2]) < 1e-12, peak
    assert abs(peak["gflops"] - sorted(x["gflops"] for x in rounds)[2]) < 1e-9 * peak["gflops"], peak
assert peak["fraction"] > 0, peak
assert abs(peak["gflops"] - workers * peak["gflops_per_worker"]["mean"]) < 1e-6 * peak["gflops"], peak
print(f"json ok: {r['samples_per_s']:.0f} samples/s, phases {total:.3f} of {step:.3f} ms, peak fraction {peak['fraction']:.3f}")
PY
}

case "$case_name" in
  table_and_json)
    "$dtrain" bench "$small" "${few[@]}" >"$scratch/table" || fail "bench failed"
    check_table "$scratch/table" 1
    "$dtrain" bench "$small" "${few[@]}" --json >"$scratch/json" || fail "bench --json failed"
    check_json "$scratch/json" 1
    # Mirrored replicas: the reduction across them is a phase of its own.
    "$dtrain" bench "$small" --steps 5 --warmup 1 --set "strategy={kind: mirrored, devices: [cpu:0, cpu:1]}" \
      --set data.batch_size_per_replica=32 --json >"$scratch/mirrored" || fail "bench under mirrored failed"
    python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); assert r["replicas_in_sync"] == 2 and r["replica_batch"] == 32, r' \
      "$scratch/mirrored" || fail "mirrored JSON"
    # Batch normalization on 2 lanes: the time lane 0 waited in the statistics' sums is shown (and
    # in the JSON) apart from the layer's own; it is part of the layer's time, never more.
    "$dtrain" bench experiments/fashion_mnist_bn_dropout.yaml --steps 4 --warmup 1 --set train.threads=2 \
      --set data.source=hdf5 --set data.path=data/fashion_mnist_small.h5 >"$scratch/bn_table" 2>&1 || fail "bench of the bn_dropout model failed: $(tail -3 "$scratch/bn_table")"
    grep -Eq "^layer +fwd bound ms .* fwd wait +bwd wait$" "$scratch/bn_table" || fail "no wait columns: $(cat "$scratch/bn_table")"
    grep -Eq "^\(wait: ms per step lane 0 spent in the layer's sums waiting for the replica's other lanes, [0-9.]+ % of the step,$" \
      "$scratch/bn_table" || fail "no line saying what the waits are"
    "$dtrain" bench experiments/fashion_mnist_bn_dropout.yaml --steps 4 --warmup 1 --set train.threads=2 \
      --set data.source=hdf5 --set data.path=data/fashion_mnist_small.h5 --json >"$scratch/bn_json" || fail "bench --json of the bn_dropout model failed"
    python3 - "$scratch/bn_json" <<'PY' || fail "the bn_dropout JSON's lane waits"
import json, sys
r = json.load(open(sys.argv[1]))
for l in r["layers"]:
    for d in ("forward", "backward"):
        w, t = l["lane_wait_ms"][d], l[d + "_ms"]
        assert 0 <= w["mean"] <= t["mean"] * (1 + 1e-9), (l["name"], d, w, t)
        # Only batch normalization sums over the lanes in this model.
        assert w["mean"] == 0 or l["kind"] == "batch_normalization", (l["name"], d, w)
# The first batch normalization computes the relu and the max pooling above it: the pair's bytes
# on its row, the relu moving nothing.
layers = {l["name"]: l for l in r["layers"]}
# The relu layers pass their memories through: batch normalization applies the relu forward, and
# its derivative (pooled or not).
for name in ("activation", "activation_1", "activation_2"):
    assert layers[name]["bytes_per_sample"] == {"forward": 0, "backward": 0}, layers[name]
    assert layers[name]["bound_ms"] == {"forward": 0, "backward": 0}, layers[name]
# The average pooling's backward reads only its gradients (5 x 5 x 64 in, 11 x 11 x 64 out), not
# the relu's output.
assert layers["average_pooling2d"]["bytes_per_sample"]["backward"] == (5 * 5 + 11 * 11) * 64 * 4, layers["average_pooling2d"]
assert layers["max_pooling2d"]["computed_in"] == "batch_normalization", layers["max_pooling2d"]
assert layers["max_pooling2d"]["bound_ms"] == {"forward": 0, "backward": 0}, layers["max_pooling2d"]
# x (26 x 26 x 32 f32), the pooled output (13 x 13 x 32 f32) and a byte per pooled element, and
# the four variables (gamma, beta and the moving statistics) over the replica's samples; backward
# also writes dx.
variables = 4 * 32 * 4 / r["replica_batch"]
fused = layers["batch_normalization"]["bytes_per_sample"]
assert abs(fused["forward"] - (26 * 26 * 32 * 4 + 13 * 13 * 32 * 5 + variables)) < 1e-6, fused
assert abs(fused["backward"] - (2 * 26 * 26 * 32 * 4 + 13 * 13 * 32 * 5 + 2 * variables)) < 1e-6, fused
PY
    # mixed_bfloat16: the peak is a bf16 matmul's (where the CPU has bfloat16; otherwise run stops at the key).
    if "$dtrain" bench "$small" --steps 3 --warmup 1 --set precision=mixed_bfloat16 --json >"$scratch/bf16" 2>"$scratch/bf16.err"; then
      python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); p=r["gemm_peak"]; assert r["compute_dtype"] == "bf16" and p["dtype"] == "bf16" and p["available"] and "bf16 x bf16" in p["what"] and r["float32_gemm_peak"]["gflops"] > 0, r' \
        "$scratch/bf16" || fail "bf16 JSON"
    else
      grep -Eq "no bfloat16 instructions|oneDNN is capped to isa" "$scratch/bf16.err" || fail "mixed_bfloat16 bench failed: $(cat "$scratch/bf16.err")"
    fi
    ;;
  bad_args)
    # The range in plain words, one line (CLI11's own check printed the largest double in full).
    for args in "--steps 0" "--steps -3" "--warmup -1" "--steps 99999999999999999999"; do
      # shellcheck disable=SC2086
      "$dtrain" bench "$small" $args >"$scratch/out" 2>"$scratch/err"
      [ $? -eq 2 ] || fail "$args should exit 2: $(cat "$scratch/err")"
      [ "$(wc -l <"$scratch/err")" -eq 1 ] || fail "$args: wanted one line: $(cat "$scratch/err")"
      grep -Eq -- "--(steps|warmup): must be a whole number (of at least [01]|from 1 to 9223372036854775807), got" \
        "$scratch/err" || fail "$args: unclear error: $(cat "$scratch/err")"
      [ "$(wc -c <"$scratch/err")" -lt 200 ] || fail "$args: a long error: $(cat "$scratch/err")"
    done
    "$dtrain" bench "$small" --set data.batch_size_per_replica=4096 --steps 2 --warmup 0 >"$scratch/out" 2>"$scratch/err"
    [ $? -eq 2 ] || fail "a batch larger than the data should exit 2"
    grep -q "no step of a full global batch" "$scratch/err" || fail "unclear error: $(cat "$scratch/err")"
    ;;
  mpi)
    # Two ranks on this machine's loopback and shared memory.
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl=self,vader \
      OMPI_MCA_btl_tcp_if_include=lo OMPI_MCA_oob_tcp_if_include=lo
    mwm="strategy={kind: multi_worker_mirrored, communication: {timeout_seconds: 60}}"
    mpirun -n 2 --oversubscribe "$dtrain" bench "$small" "${few[@]}" --set data.batch_size_per_replica=32 \
      --set "$mwm" >"$scratch/table" 2>"$scratch/err" || fail "mpirun bench failed: $(tail -5 "$scratch/err")"
    # Only the chief prints.
    [ "$(grep -c '^dtrain ' "$scratch/table")" -eq 1 ] || fail "more than one rank printed"
    check_table "$scratch/table" 2
    mpirun -n 2 --oversubscribe "$dtrain" bench "$small" "${few[@]}" --set data.batch_size_per_replica=32 \
      --set "$mwm" --json >"$scratch/json" 2>"$scratch/err" || fail "mpirun bench --json failed: $(tail -5 "$scratch/err")"
    check_json "$scratch/json" 2
    # What every rank finds alike (a key the layer lacks, an evaluator role, which bench has no
    # steps for) is the chief's one line, exit 2, without an MPI abort.
    for bad in "model.layers.0.conv2d.stride=2" "strategy.roles={evaluator: 1}"; do
      mpirun -n 2 --oversubscribe "$dtrain" bench "$small" "${few[@]}" --set data.batch_size_per_replica=32 \
        --set "$mwm" --set "$bad" >"$scratch/bad.out" 2>"$scratch/bad.err"
      rc=$?
      [ "$rc" -eq 2 ] || fail "$bad: exit $rc, wanted 2: $(cat "$scratch/bad.err")"
      [ "$(grep -c '^dtrain: error:' "$scratch/bad.err")" -eq 1 ] || fail "$bad: wanted one error line: $(cat "$scratch/bad.err")"
      grep -q "MPI_ABORT" "$scratch/bad.err" "$scratch/bad.out" && fail "$bad: the job was aborted"
    done
    ;;
  *) fail "unknown case" ;;
esac
echo "ok [$case_name]"
