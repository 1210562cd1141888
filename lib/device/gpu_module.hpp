// The CUDA backend as a module: libdtrain_cuda.so, built beside dtrain wherever CUDA was found
// (lib/backends/cuda/backend.cmake), loaded the first time something asks for a GPU: a gpu:N
// device, `devices: auto` on a machine with NVIDIA's driver, NCCL, `dtrain info`. Loading it runs
// its registrations (the gpu device kind, its layer kernels, the NCCL communicators) as linking it
// in ran them before main. A CPU run never loads it, nor the CUDA libraries it needs: linked into
// dtrain, their initializers cost every process 0.13-0.21 s and 238 MB before its first line
// (`dtrain --version`, 2-core AMD EPYC), and dtrain could not start where they were not installed.
#pragma once

#include <string>

namespace dtrain::device {

// Loads the module once per process; later calls, from any thread, return the first call's answer:
// "" where it is loaded, else why not (this build has no CUDA backend, the module is missing, or
// the loader's own words about the module or a library it needs).
const std::string& load_cuda_backend();

// Whether NVIDIA's driver library (libcuda.so.1, which the CUDA runtime loads) is installed. Where
// it is not, no GPU is usable, so `devices: auto` learns that without loading the module.
bool cuda_driver_present();

}  // namespace dtrain::device
