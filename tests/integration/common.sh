# Sourced first by every tests/integration/SCRIPT.sh CASE DTRAIN_BINARY SCRATCH_DIR: the arguments,
# a fresh scratch directory, fail(), and OpenMPI set for real mpirun on this host (as root, more
# ranks than cores, loopback and shared memory only: no network interface is probed).
case_name=$1
dtrain=$2
scratch=$3
rm -rf "$scratch" && mkdir -p "$scratch"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export OMPI_MCA_btl=self,vader OMPI_MCA_btl_tcp_if_include=lo OMPI_MCA_oob_tcp_if_include=lo

fail() { echo "FAIL [$case_name]: $*" >&2; exit 1; }

# A run started with hold_env DIR STEP (as `env "${hold[@]}" dtrain ...`) stops after global step
# STEP and waits (train/callbacks.hpp, StepHold): each of its training processes writes
# DIR/held.rank<R> and waits until it is signalled or DIR/release exists. Tests that signal or
# kill act on that event, never after a sleep.
hold_env() { hold=(DTRAIN_TEST_HOLD_DIR="$1" DTRAIN_TEST_HOLD_AT_STEP="$2"); }
# wait_held DIR [PROCESSES [PID]]: until PROCESSES (default 1) hold in DIR; fails if PID ends first.
wait_held() {
  local dir=$1 want=${2:-1} pid=${3:-}
  for _ in $(seq 1 6000); do
    [ "$(find "$dir" -maxdepth 1 -name 'held.rank*' 2>/dev/null | wc -l)" -ge "$want" ] && return 0
    if [ -n "$pid" ] && ! kill -0 "$pid" 2>/dev/null; then fail "the run ended before it held in $dir"; fi
    sleep 0.05
  done
  fail "no $want process(es) held in $dir after 300 s"
}
release_hold() { touch "$1/release"; }

# The PID of world rank $2 of the run writing into $1 (the dtrain process, not a wrapper's shell).
rank_pid() {
  for pid in $(pgrep -f -- "--run-dir $1"); do
    [ "$(readlink -f "/proc/$pid/exe")" = "$(readlink -f "$dtrain")" ] || continue
    r=$(tr '\0' '\n' <"/proc/$pid/environ" 2>/dev/null | sed -n 's/^OMPI_COMM_WORLD_RANK=//p')
    [ "$r" = "$2" ] && echo "$pid"
  done
}
# $scratch/rc.sh OUT COMMAND...: runs a rank's command and writes its exit code into OUT.rc<RANK>:
# under --enable-recovery mpirun exits 0 whatever its ranks return (OpenMPI 4.1.4), so the tests
# read each rank's own code there.
make_rc_wrapper() {
  cat >"$scratch/rc.sh" <<'EOS'
#!/usr/bin/env bash
out=$1
shift
"$@"
rc=$?
echo "$rc" >"$out.rc$OMPI_COMM_WORLD_RANK"
exit "$rc"
EOS
  chmod +x "$scratch/rc.sh"
}
