#include "device/gpu_module.hpp"

#include <dlfcn.h>

#include <filesystem>
#include <mutex>
#include <vector>

#include <fmt/format.h>

#include "device/context.hpp"
#include "dtrain/build_info.hpp"

namespace dtrain::device {

namespace {

// Written once, under the once flag; read after it.
struct CudaModule {
  std::once_flag once;
  std::string why_not;
};

CudaModule& cuda_module() {
  static CudaModule module;
  return module;
}

// Where the module may be: beside the running executable (a copied or installed build), then
// where this build wrote it (a test binary in build/tests/ loading build/'s).
std::vector<std::filesystem::path> module_paths() {
  const std::filesystem::path built = build_info::cuda_module;
  std::vector<std::filesystem::path> paths;
  std::error_code error;
  const std::filesystem::path exe = std::filesystem::read_symlink("/proc/self/exe", error);
  if (!error) paths.push_back(exe.parent_path() / built.filename());
  if (paths.empty() || paths[0] != built) paths.push_back(built);
  return paths;
}

std::string load() {
  if (!build_info::have_cuda) return "this build of dtrain has no CUDA backend (CUDA was not found when it was built)";
  if (backend_registered(Device::Kind::gpu)) return "";  // linked in, registered before main
  const std::vector<std::filesystem::path> paths = module_paths();
  for (const std::filesystem::path& path : paths) {
    std::error_code error;
    if (!std::filesystem::exists(path, error)) continue;
    // RTLD_NOW: a symbol missing from the executable or a library fails here, in one message,
    // not at a first call in the middle of a run. Never unloaded: its registrations stay.
    if (dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL | RTLD_NODELETE) != nullptr) return "";
    const char* why = dlerror();
    return fmt::format("the CUDA backend {} could not be loaded ({}): install the CUDA, cuDNN and NCCL libraries it was "
                       "built with, or rebuild dtrain (tools/setup)",
                       path.string(), why ? why : "no reason given");
  }
  std::string looked;
  for (const std::filesystem::path& path : paths) looked += (looked.empty() ? "" : ", ") + path.string();
  return fmt::format("the CUDA backend module is missing (looked for {}); rebuild dtrain (tools/setup) or copy {} beside it",
                     looked, paths.back().filename().string());
}

}  // namespace

const std::string& load_cuda_backend() {
  CudaModule& module = cuda_module();
  std::call_once(module.once, [&module] { module.why_not = load(); });
  return module.why_not;
}

bool cuda_driver_present() {
  void* driver = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL);
  if (driver == nullptr) return false;
  dlclose(driver);
  return true;
}

}  // namespace dtrain::device
