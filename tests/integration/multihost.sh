#!/usr/bin/env bash
# Multi-host over real TCP, with faults: 2 to 4 hosts made as network namespaces on this machine
# (tools/netns_hosts: veth pairs to a bridge in a namespace of its own, addresses 198.18.0.1x/24
# that the test assigns, no other traffic), mpirun across them through an rsh agent that enters
# the namespace:
#   tests/integration/multihost.sh CASE DTRAIN_BINARY SCRATCH_DIR
# Needs root (ip netns); anywhere else each case exits 77 with one line saying why.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh" "$@"

# Names of our own, unique per run (interface names are at most 15 characters).
name="mh$(($$ % 1000000))"
kill_tree() {
  local child
  for child in $(pgrep -P "$1"); do kill_tree "$child"; done
  kill -KILL "$1" 2>/dev/null
}
# However the script ends: the background jobs and every process in the namespaces end, and
# every namespace, veth and bridge made here is deleted.
cleanup() {
  for job in $(jobs -p); do kill_tree "$job"; done
  tools/netns_hosts down "$name" 2>/dev/null
}
trap cleanup EXIT
# hosts N: N hosts, NAME_h0..; the launcher runs in NAME_h0.
hosts() {
  tools/netns_hosts up "$name" "$1" >"$scratch/hostfile" 2>"$scratch/netns.err" || {
    if [ "$(id -u)" -ne 0 ]; then echo "SKIP: network namespaces need root (ip netns add)"; exit 77; fi
    echo "SKIP: cannot make network namespaces here: $(head -1 "$scratch/netns.err")"; exit 77
  }
}
ip_of() { echo "198.18.0.$((10 + $1))"; }
across() { timeout 300 tools/netns_hosts mpirun "$name" "$@"; }
one_host() { local n=$1; shift; timeout 300 mpirun -n "$n" --oversubscribe "$@"; }
make_rc_wrapper
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }
# watch JOB FILE REGEX START: while JOB runs, the seconds from START until FILE first matched
# REGEX go to $seen ("never" if it did not before JOB ended).
watch() {
  local job=$1 file=$2 re=$3 start=$4
  seen=never
  # Bounded: under --enable-recovery mpirun may outlive every rank (it waits for a lost daemon).
  local deadline=$((SECONDS + 120))
  while kill -0 "$job" 2>/dev/null && [ "$SECONDS" -lt "$deadline" ]; do
    if grep -Eq "$re" "$file" 2>/dev/null; then seen=$(since "$start"); break; fi
    sleep 0.05
  done
  [ "$seen" = never ] && grep -Eq "$re" "$file" 2>/dev/null && seen=$(since "$start")
}
# Every checkpoint in run $1 is readable: dtrain eval of each one.
checkpoints_readable() {
  local n=0 ckpt
  for ckpt in "$1"/checkpoints/ckpt-*.h5; do
    [ -e "$ckpt" ] || continue
    "$dtrain" eval --checkpoint "$ckpt" >"$scratch/eval.out" 2>&1 || fail "checkpoint $ckpt is not readable: $(tail -3 "$scratch/eval.out")"
    n=$((n + 1))
  done
  [ "$n" -gt 0 ] || fail "no checkpoint was written in $1"
  echo "ok: all $n checkpoints of ${1##*/} evaluate"
}
# The namespace of host $1 holds no process within 60 s (its daemon gave up on the launcher).
host_empties() {
  local ns="${name}_h$1"
  for _ in $(seq 1 600); do [ -z "$(ip netns pids "$ns" 2>/dev/null)" ] && return 0; sleep 0.1; done
  fail "processes left on host $1 60 s after the job ended: $(ip netns pids "$ns" | tr '\n' ' ')"
}

small=experiments/fashion_mnist_small.yaml
common=(--set train.threads=1 --set train.progress=none)
mwm() { echo "strategy={kind: multi_worker_mirrored, communication: {implementation: $1, timeout_seconds: ${2:-60}}}"; }
ps() { echo "strategy={kind: parameter_server, roles: {chief: 1, ps: $1, worker: $2}, communication: {timeout_seconds: ${3:-60}}}"; }

case "$case_name" in
  equivalence)
    # multi_worker_mirrored over 2 and 4 hosts (one rank each) equals the one-host mpirun run bit
    # for bit (the same sums in the same order, over TCP instead of shared memory).
    hosts 4
    steps=(--set train.epochs=1 --set train.steps_per_epoch=5 --set data.batch_size_per_replica=16)
    for spec in "2 ring" "4 mpi" "4 ring"; do
      read -r n impl <<<"$spec"
      one_host "$n" "$dtrain" run "$small" "${common[@]}" "${steps[@]}" --set "$(mwm "$impl")" --run-dir "$scratch/one_${n}_$impl" \
        >"$scratch/one_${n}_$impl.out" 2>&1 || fail "one host, $n ranks ($impl) failed: $(tail -5 "$scratch/one_${n}_$impl.out")"
      hostlist=$(for i in $(seq 0 $((n - 1))); do printf '%s,' "$(ip_of "$i")"; done)
      run="$scratch/hosts_${n}_$impl"
      across -n "$n" --host "${hostlist%,}" "$dtrain" run "$small" "${common[@]}" "${steps[@]}" --set "$(mwm "$impl")" \
        --run-dir "$run" >"$run.out" 2>&1 || fail "$n hosts ($impl) failed: $(tail -5 "$run.out")"
      grep -q "| workers $n |" "$run.out" || fail "header: $(head -1 "$run.out")"
      h5diff "$run/checkpoints/ckpt-5.h5" "$scratch/one_${n}_$impl/checkpoints/ckpt-5.h5" /model /model >/dev/null \
        || fail "$n hosts ($impl) differ from $n ranks on one host"
      cmp <(grep '^Epoch' "$run.out") <(grep '^Epoch' "$scratch/one_${n}_$impl.out") || fail "$n hosts ($impl): epoch lines differ"
      echo "ok: multi_worker_mirrored over $n hosts ($impl) ends on the one-host run's bits"
    done
    # parameter_server with one worker (deterministic: one step at a time) with the chief, the
    # worker and the 2 servers on 3 hosts equals its one-host run bit for bit.
    steps=(--set train.epochs=2 --set train.steps_per_epoch=4)
    one_host 4 "$dtrain" run "$small" "${common[@]}" "${steps[@]}" --set "$(ps 2 1)" --run-dir "$scratch/ps_one" \
      >"$scratch/ps_one.out" 2>&1 || fail "one-host parameter_server failed: $(tail -5 "$scratch/ps_one.out")"
    across -n 4 --host "$(ip_of 0):1,$(ip_of 1):1,$(ip_of 2):2" "$dtrain" run "$small" "${common[@]}" "${steps[@]}" \
      --set "$(ps 2 1)" --run-dir "$scratch/ps_hosts" >"$scratch/ps_hosts.out" 2>&1 \
      || fail "parameter_server over 3 hosts failed: $(tail -5 "$scratch/ps_hosts.out")"
    h5diff "$scratch/ps_hosts/checkpoints/ckpt-8.h5" "$scratch/ps_one/checkpoints/ckpt-8.h5" /model /model >/dev/null \
      || fail "parameter_server over 3 hosts differs from its one-host run"
    cmp <(grep '^Epoch' "$scratch/ps_hosts.out") <(grep '^Epoch' "$scratch/ps_one.out") || fail "parameter_server: epoch lines differ"
    echo "ok: parameter_server (chief, worker, 2 servers on 3 hosts) ends on its one-host run's bits"
    ;;
  link_cut)
    # 3 hosts, one rank each, held at a random step; host 2's link is cut, then the run released:
    # the watchdog (5 s) names rank 2 and its host, the job ends with exit 5, nothing hangs (the
    # cut host's daemon gives up too), and every checkpoint written evaluates.
    hosts 3
    run="$scratch/cut"
    hold_env "$run.hold" $((4 + RANDOM % 8))
    env "${hold[@]}" tools/netns_hosts mpirun "$name" -n 3 --host "$(ip_of 0),$(ip_of 1),$(ip_of 2)" "$dtrain" run "$small" \
      "${common[@]}" --set train.epochs=50 --set data.batch_size_per_replica=16 --set checkpoint.every_steps=3 \
      --set "$(mwm mpi 5)" --run-dir "$run" >"$run.out" 2>&1 </dev/null &
    job=$!
    wait_held "$run.hold" 3 "$job"
    ip -n "${name}_h2" link set eth0 down
    start=$(now)
    release_hold "$run.hold"
    watch "$job" "$run.out" "collective .* did not complete within 5 s; ranks that did not arrive: rank 2 on host $name-h2 \(no answer" "$start"
    detected=$seen
    waited=0
    while kill -0 "$job" 2>/dev/null && [ "$waited" -lt 1200 ]; do sleep 0.1; waited=$((waited + 1)); done
    kill -0 "$job" 2>/dev/null && fail "the job still runs 120 s after the watchdog: $(tail -5 "$run.out")"
    wait "$job"
    rc=$?
    ended=$(since "$start")
    [ "$detected" != never ] || fail "no rank named rank 2 on host $name-h2: $(grep -v '^Epoch\|samples/s' "$run.out" | head -12)"
    [ "$rc" -eq 5 ] || fail "mpirun exited $rc, wanted 5 (the watchdog's): $(tail -5 "$run.out")"
    host_empties 2
    grep -m1 "did not arrive" "$run.out"
    checkpoints_readable "$run"
    echo "ok: link cut: the watchdog named rank 2 on host $name-h2 after ${detected} s, mpirun exit $rc after $ended s; figures: detect $detected s, end $ended s"
    ;;
  killed_host)
    # Every process of host 2 killed (its daemon too) while held: mpirun names the host and ends
    # the job non-zero at once; the checkpoints written evaluate.
    hosts 3
    run="$scratch/mwm"
    hold_env "$run.hold" $((4 + RANDOM % 8))
    env "${hold[@]}" tools/netns_hosts mpirun "$name" -n 3 --host "$(ip_of 0),$(ip_of 1),$(ip_of 2)" "$dtrain" run "$small" \
      "${common[@]}" --set train.epochs=50 --set data.batch_size_per_replica=16 --set checkpoint.every_steps=3 \
      --set "$(mwm mpi 5)" --run-dir "$run" >"$run.out" 2>&1 </dev/null &
    job=$!
    wait_held "$run.hold" 3 "$job"
    kill -KILL $(ip netns pids "${name}_h2")
    start=$(now)
    release_hold "$run.hold"
    wait "$job"
    rc=$?
    ended=$(since "$start")
    [ "$rc" -ne 0 ] || fail "mpirun returned 0 after a host was lost"
    grep -q "$(ip_of 2)\|$name-h2" "$run.out" || fail "the lost host is not named: $(tail -12 "$run.out")"
    grep -m2 -E "lost communication|Remote host|$(ip_of 2)|$name-h2" "$run.out"
    checkpoints_readable "$run"
    echo "ok: killed host, multi_worker_mirrored: mpirun exit $rc after $ended s, naming the host"

    # parameter_server under --enable-recovery, the worker of host 1 lost with its host: the
    # coordinator (host 0) and the other worker and the server (host 2) finish every epoch; the
    # chief names rank 1 and exits 0, and every survivor ends (none waits in MPI_Finalize).
    run="$scratch/ps"
    hold_env "$run.hold" $((6 + RANDOM % 20))
    env "${hold[@]}" tools/netns_hosts mpirun "$name" --enable-recovery -n 4 --host "$(ip_of 0):1,$(ip_of 1):1,$(ip_of 2):2" \
      "$scratch/rc.sh" "$run" "$dtrain" run "$small" "${common[@]}" --set train.epochs=2 --set checkpoint.every_steps=5 \
      --set "$(ps 1 2 10)" --run-dir "$run" >"$run.out" 2>"$run.err" </dev/null &
    job=$!
    wait_held "$run.hold" 1 "$job"
    kill -KILL $(ip netns pids "${name}_h1")
    start=$(now)
    release_hold "$run.hold"
    watch "$job" "$run.err" "warning: worker rank 1 was lost at epoch" "$start"
    detected=$seen
    # The survivors end; OpenMPI 4.1's mpirun, under --enable-recovery, then still waits for the
    # lost host's daemon to report its rank (it never will): once all 3 survivors have exited,
    # the job is over and mpirun is stopped.
    for _ in $(seq 1 1200); do [ -e "$run.rc0" ] && [ -e "$run.rc2" ] && [ -e "$run.rc3" ] && break; sleep 0.1; done
    survivors=$(since "$start")
    for r in 0 2 3; do [ -e "$run.rc$r" ] || fail "rank $r has not ended 120 s after the loss: $(tail -5 "$run.err")"; done
    mpirun_left=no
    for _ in $(seq 1 50); do kill -0 "$job" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$job" 2>/dev/null; then
      mpirun_left=yes
      term=$(now)
      kill -TERM "$job"
      for _ in $(seq 1 300); do kill -0 "$job" 2>/dev/null || break; sleep 0.1; done
      kill -0 "$job" 2>/dev/null && fail "mpirun still runs 30 s after SIGTERM"
      mpirun_left="yes, it ended $(since "$term") s after SIGTERM"
    fi
    wait "$job"
    [ "$detected" != never ] || fail "no warning naming worker rank 1: $(cat "$run.err")"
    [ "$(cat "$run.rc0")" = 0 ] || fail "the chief exited $(cat "$run.rc0") after losing a worker host: $(tail -5 "$run.err")"
    [ "$(cat "$run.rc2")" = 0 ] && [ "$(cat "$run.rc3")" = 0 ] || fail "worker 2 / server 3 exited $(cat "$run.rc2") / $(cat "$run.rc3")"
    [ "$(grep -c '^Epoch' "$run.out")" -eq 2 ] || fail "wanted 2 epoch lines: $(cat "$run.out")"
    [ -f "$run/checkpoints/ckpt-64.h5" ] || fail "no final checkpoint: $(ls "$run/checkpoints")"
    grep -m1 "was lost" "$run.err"
    checkpoints_readable "$run"
    echo "ok: killed worker host, parameter_server --enable-recovery: rank 1 named after $detected s, survivors ended (exit 0) after $survivors s; mpirun still waiting then: $mpirun_left"
    ;;
  latency)
    # tc netem 20 ms and 1 % loss on every host's link: the step time with overlap on and off.
    hosts 2
    if ! out=$(ip netns exec "${name}_h0" tc qdisc add dev eth0 root netem delay 20ms loss 1% 2>&1); then
      echo "SKIP: tc netem is not available here (the kernel has no sch_netem: $(head -1 <<<"$out"))"; exit 77
    fi
    ip netns exec "${name}_h1" tc qdisc add dev eth0 root netem delay 20ms loss 1% || fail "netem on host 1"
    for overlap in true false; do
      run="$scratch/overlap_$overlap"
      across -n 2 --host "$(ip_of 0),$(ip_of 1)" "$dtrain" run "$small" "${common[@]}" --set train.epochs=1 \
        --set train.steps_per_epoch=20 --run-dir "$run" --set "strategy={kind: multi_worker_mirrored,
        communication: {implementation: ring, bytes_per_pack: 65536, overlap: $overlap, timeout_seconds: 120}}" \
        >"$run.out" 2>&1 || fail "overlap $overlap under netem failed: $(tail -5 "$run.out")"
      grep samples/s "$run.out"
    done
    h5diff "$scratch/overlap_true/checkpoints/ckpt-20.h5" "$scratch/overlap_false/checkpoints/ckpt-20.h5" /model /model >/dev/null \
      || fail "overlap on and off differ under netem"
    echo "ok: 20 ms and 1 % loss: the same bits with overlap on and off"
    ;;
  *) fail "unknown case" ;;
esac
echo "ok [$case_name]"
