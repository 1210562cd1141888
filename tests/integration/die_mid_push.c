/* Preloaded (LD_PRELOAD) into one worker rank by tests/integration/parameter_server.sh: the
 * process dies (SIGKILL) between a push's request and its gradients, where a kill -9 from outside
 * lands only by chance. DTRAIN_TEST_DIE_AT_PUSH=N: at its Nth push. 7204 is the gradients' tag
 * (kPushDataTag in lib/distribute/ps_transport.cpp). */
#include <mpi.h>
#include <signal.h>
#include <stdlib.h>

int MPI_Isend(const void* buf, int count, MPI_Datatype type, int dest, int tag, MPI_Comm comm, MPI_Request* request) {
  static int pushes = 0;
  const char* at = getenv("DTRAIN_TEST_DIE_AT_PUSH");
  if (tag == 7204 && at && ++pushes == atoi(at)) raise(SIGKILL);
  return PMPI_Isend(buf, count, type, dest, tag, comm, request);
}
