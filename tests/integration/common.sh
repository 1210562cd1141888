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
