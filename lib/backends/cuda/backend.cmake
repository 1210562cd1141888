# The GPU backend: CUDA with cuDNN, cuBLAS and NCCL. Optional (DTRAIN_CUDA=AUTO|ON|OFF): a
# machine with /usr/local/cuda configures and builds it whether or not it has a GPU, so a compile
# or link error shows on every build; ON fails loudly where CUDA is absent. Sets DTRAIN_HAVE_CUDA,
# DTRAIN_HAVE_NCCL and DTRAIN_CUDA_MODULE for build_info.hpp.
set(DTRAIN_CUDA AUTO CACHE STRING "Build the CUDA backend (cuDNN, cuBLAS, NCCL): AUTO (when found), ON (required), OFF")
set_property(CACHE DTRAIN_CUDA PROPERTY STRINGS AUTO ON OFF)
set(DTRAIN_HAVE_CUDA OFF)
set(DTRAIN_HAVE_NCCL OFF)
set(DTRAIN_CUDA_MODULE "")
if(NOT DTRAIN_CUDA STREQUAL "OFF")
  if(EXISTS /usr/local/cuda AND NOT CUDAToolkit_ROOT)
    set(CUDAToolkit_ROOT /usr/local/cuda)
  endif()
  if(DTRAIN_CUDA STREQUAL "ON")
    find_package(CUDAToolkit REQUIRED)
  else()
    find_package(CUDAToolkit QUIET)
  endif()
  find_library(CUDNN_LIBRARY cudnn HINTS ${CUDAToolkit_LIBRARY_DIR} /usr/local/cuda/lib64)
  find_path(CUDNN_INCLUDE_DIR cudnn.h HINTS ${CUDAToolkit_INCLUDE_DIRS} /usr/local/cuda/include)
  find_library(NCCL_LIBRARY nccl HINTS ${CUDAToolkit_LIBRARY_DIR} /usr/local/cuda/lib64)
  find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS} /usr/local/cuda/include)
  if(CUDAToolkit_FOUND)
    set(DTRAIN_HAVE_CUDA ON)
    # The kernels are CUDA C++ (.cu): the language is on wherever the toolkit is, so that they
    # compile on every build. Hopper (H100/H200) and Ampere by default.
    if(NOT CMAKE_CUDA_ARCHITECTURES)
      set(CMAKE_CUDA_ARCHITECTURES 80 90)
    endif()
    if(NOT CMAKE_CUDA_COMPILER AND EXISTS ${CUDAToolkit_NVCC_EXECUTABLE})
      set(CMAKE_CUDA_COMPILER ${CUDAToolkit_NVCC_EXECUTABLE})
    endif()
    enable_language(CUDA)
    # The .cu files are C++20 like the rest (a target's CXX_STANDARD 20 asks for CUDA20 too).
    # CMake before 3.26 does not know nvcc's flag for it (nvcc 12+ takes -std=c++20): say it.
    if(NOT CMAKE_CUDA20_STANDARD_COMPILE_OPTION)
      set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
      set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
    endif()
    set(CMAKE_CUDA_STANDARD 20)
    # One CUDA runtime in the process: the shared libcudart that cuBLAS, cuDNN and NCCL use too
    # (CMake's default for CUDA targets is the static one).
    set(CMAKE_CUDA_RUNTIME_LIBRARY Shared)
    # The backend is a module, libdtrain_cuda.so beside dtrain, that dtrain loads the first time an
    # experiment or a command asks for a GPU (device/gpu_module.hpp). Why: linked into dtrain, the
    # CUDA libraries' initializers ran in every process: `dtrain --version` took 0.13-0.21 s and
    # 238 MB (libcublasLt's initializers alone made about 44,000 allocations), each rank of a CPU
    # run paid that again, and dtrain could not start on a machine without the CUDA libraries.
    # Its sources are an object library: the module is made of them, and dtrain_gpu_tests links
    # them in directly. They compile against dtrain_lib's headers but link none of its objects or
    # static libraries (dtrain_proto's descriptors would register twice): the module finds dtrain's
    # own functions (the registries) in the executable that loads it (ENABLE_EXPORTS).
    file(GLOB _cuda_sources CONFIGURE_DEPENDS ${CMAKE_CURRENT_LIST_DIR}/*.cpp ${CMAKE_CURRENT_LIST_DIR}/*.cu)
    add_library(dtrain_cuda_objects OBJECT ${_cuda_sources})
    set_target_properties(dtrain_cuda_objects PROPERTIES POSITION_INDEPENDENT_CODE ON CUDA_STANDARD 20
                          CUDA_ARCHITECTURES "${CMAKE_CUDA_ARCHITECTURES}" CUDA_RUNTIME_LIBRARY Shared)
    target_include_directories(dtrain_cuda_objects PUBLIC ${PROJECT_SOURCE_DIR}/lib ${PROJECT_BINARY_DIR}/generated)
    target_link_libraries(dtrain_cuda_objects PUBLIC dtrain_flags fmt::fmt CUDA::cudart CUDA::cublas)
    # nvcc gets GCC's warnings for the host code it hands to g++ (dtrain_flags' options are for C
    # and C++ compiles only; -Wpedantic is left out: nvcc's generated host code trips it).
    target_compile_options(dtrain_cuda_objects PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall,-Wextra>)
    # The numerics round as the CPU backend's (compiled with -ffp-contract=off): no fused
    # multiply-add, so the element-wise optimizer updates give the CPU's bits.
    set_source_files_properties(${CMAKE_CURRENT_LIST_DIR}/numerics.cu PROPERTIES COMPILE_OPTIONS "-fmad=false")
    if(CUDNN_LIBRARY AND CUDNN_INCLUDE_DIR)
      target_include_directories(dtrain_cuda_objects SYSTEM PUBLIC ${CUDNN_INCLUDE_DIR})
      target_link_libraries(dtrain_cuda_objects PUBLIC ${CUDNN_LIBRARY})
    elseif(DTRAIN_CUDA STREQUAL "ON")
      message(FATAL_ERROR "DTRAIN_CUDA=ON: cuDNN (cudnn.h, libcudnn) not found under ${CUDAToolkit_LIBRARY_DIR}")
    endif()
    if(NCCL_LIBRARY AND NCCL_INCLUDE_DIR)
      set(DTRAIN_HAVE_NCCL ON)
      target_include_directories(dtrain_cuda_objects SYSTEM PUBLIC ${NCCL_INCLUDE_DIR})
      target_link_libraries(dtrain_cuda_objects PUBLIC ${NCCL_LIBRARY})
      # The NCCL communicators (cross_device_ops / communication.implementation: nccl).
      target_sources(dtrain_cuda_objects PRIVATE ${PROJECT_SOURCE_DIR}/lib/distribute/nccl_communicator.cpp)
    endif()
    add_library(dtrain_cuda MODULE)
    target_link_libraries(dtrain_cuda PRIVATE dtrain_cuda_objects)
    set_target_properties(dtrain_cuda PROPERTIES LIBRARY_OUTPUT_DIRECTORY ${PROJECT_BINARY_DIR})
    # Where the loader looks after the executable's own folder: this build's (build_info.hpp).
    set(DTRAIN_CUDA_MODULE ${PROJECT_BINARY_DIR}/${CMAKE_SHARED_MODULE_PREFIX}dtrain_cuda${CMAKE_SHARED_MODULE_SUFFIX})
  endif()
endif()
message(STATUS "dtrain: CUDA ${DTRAIN_HAVE_CUDA}, NCCL ${DTRAIN_HAVE_NCCL} (DTRAIN_CUDA=${DTRAIN_CUDA})")
