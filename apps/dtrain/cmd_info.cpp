#include <H5public.h>
#include <mpi.h>
#include <omp.h>
#include <yaml-cpp/yaml.h>
#include <zlib.h>

#include <filesystem>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "commands.hpp"
#include "data/dataset.hpp"
#include "dtrain/build_info.hpp"
#include "device/context.hpp"
#include "device/gpu_module.hpp"
#include "distribute/nccl_communicator.hpp"
#include "nn/kernel.hpp"
#include "train/trainer.hpp"

namespace dtrain::app {

int info_command() {
  unsigned h5_major = 0, h5_minor = 0, h5_release = 0;
  H5get_libversion(&h5_major, &h5_minor, &h5_release);
  char mpi_version[MPI_MAX_LIBRARY_VERSION_STRING] = {};
  int mpi_len = 0;
  MPI_Get_library_version(mpi_version, &mpi_len);  // callable before MPI_Init
  std::string mpi(mpi_version, static_cast<std::size_t>(mpi_len));
  if (auto nl = mpi.find_first_of(",\n"); nl != std::string::npos) mpi.resize(nl);

  fmt::print("dtrain {} ({} build, {})\n", build_info::version, build_info::build_type, build_info::compiler);
  // What each backend of this build says about itself: oneDNN's version and the CPU ISA it runs.
  fmt::print("cpu backend {}: {} (CPU ISA as oneDNN dispatches)\n", device::backend_for(Device::Kind::cpu),
             device::make_context(Device{})->describe());
  const std::string no_bf16 = device::make_context(Device{})->cannot_compute_in(DType::bf16);
  fmt::print("precision mixed_bfloat16: {}\n", no_bf16.empty() ? "available (bfloat16 in hardware)" : "not available: " + no_bf16);
  fmt::print("threads: {} available (train.threads: 0 uses them all), OpenMP max {}\n", train::resolve_threads(0),
             omp_get_max_threads());
  fmt::print("MPI: {}\n", mpi);
  fmt::print("HDF5 {}.{}.{}, zlib {}, fmt {}\n", h5_major, h5_minor, h5_release, zlibVersion(), FMT_VERSION);
  if (build_info::have_cuda) {
    if (const std::string& why = device::load_cuda_backend(); !why.empty()) {
      fmt::print("CUDA: built, not loaded: {}\n", why);
    } else {
      const auto missing = nn::kinds_without_kernel(device::backend_for(Device::Kind::gpu));
      fmt::print("CUDA: built ({} backend for gpu:N){}\n", device::backend_for(Device::Kind::gpu),
                 missing.empty() ? std::string(": a kernel for every layer kind")
                                 : fmt::format("; no kernel for the layer kinds {}", fmt::join(missing, ", ")));
      for (const std::string& line : device::device_inventory(Device::Kind::gpu)) fmt::print("  {}\n", line);
    }
  } else {
    fmt::print("CUDA: not built (CUDA was not found at build time)\n");
  }
  if (const distribute::NcclFactories* nccl = distribute::nccl())
    fmt::print("NCCL: {}: cross_device_ops nccl (mirrored over local GPUs) and communication.implementation nccl "
               "(multi_worker_mirrored, one GPU per rank)\n",
               nccl->version());
  else
    fmt::print("NCCL: {}\n", !build_info::have_cuda ? "not built (CUDA was not found at build time)"
                             : !build_info::have_nccl ? "not built (CMake found no nccl.h and libnccl beside CUDA)"
                                                      : "built, not loaded (see CUDA above)");
  const bool fmnist = std::filesystem::exists(std::filesystem::path(data::kDefaultFashionMnistDir) / "train-images-idx3-ubyte.gz");
  fmt::print("Fashion-MNIST: {}\n", fmnist ? data::kDefaultFashionMnistDir : "not installed (apt-get install dataset-fashion-mnist)");
  return kOk;
}

}  // namespace dtrain::app
