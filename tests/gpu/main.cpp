// The GPU tests' main: without a usable CUDA device they are skipped (exit 77, CTest's
// SKIP_RETURN_CODE), with one line that says why, so that `ctest` on a machine without a GPU
// passes and says so.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdio>

#include <cuda_runtime_api.h>

int main(int argc, char** argv) {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess || count == 0) {
    std::printf("SKIP: no CUDA device: %s\n",
                status != cudaSuccess ? cudaGetErrorString(status) : "cudaGetDeviceCount reports 0 devices");
    return 77;
  }
  doctest::Context context(argc, argv);
  return context.run();
}
