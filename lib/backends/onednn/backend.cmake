# The CPU backend: oneDNN (Debian's libdnnl-dev) plus dtrain's own vector loops. Included by the
# top-level CMakeLists.txt, as every lib/backends/<name>/backend.cmake is, after dtrain_lib exists.
find_package(dnnl REQUIRED)
file(GLOB _onednn_sources CONFIGURE_DEPENDS ${CMAKE_CURRENT_LIST_DIR}/*.cpp)
target_sources(dtrain_lib PRIVATE ${_onednn_sources})
target_link_libraries(dtrain_lib PUBLIC DNNL::dnnl)

# The optimizer's and the sums' loops: vectorized sqrt, no contraction (see the file's comment).
set_source_files_properties(${CMAKE_CURRENT_LIST_DIR}/numerics.cpp PROPERTIES COMPILE_OPTIONS "-fno-math-errno;-ffp-contract=off")
# The backend's own loops (lanes.hpp) pass GCC vector types between inline helpers of one file,
# built for several ISAs (target_clones): GCC's note that such values would be passed differently
# across an ABI boundary does not apply to functions no other file calls.
set_source_files_properties(${CMAKE_CURRENT_LIST_DIR}/max_pool2d.cpp ${CMAKE_CURRENT_LIST_DIR}/average_pooling2d.cpp
                            ${CMAKE_CURRENT_LIST_DIR}/dropout.cpp PROPERTIES COMPILE_OPTIONS "-Wno-psabi")
# The convolution's weight-gradient sums and the small dense layers' products: multiply-adds fused
# where the CPU has FMA (as oneDNN's kernels do), so their last bits depend on the CPU's ISA, as
# oneDNN's already do. The loops write `sum += a * b` and leave the fusing to GCC, whose pass that
# forms FMAs runs only under -fexpensive-optimizations (on from -O2): named here so that a -O1 build
# (the sanitizers') fuses as Release does, and Debug's -O0, which never fuses, is raised to -O1.
# Without it the loops' bits depended on the optimization level. (Intrinsics cannot say it instead:
# the loops are one body built for several ISAs by target_clones, the plain x86-64 one without FMA.)
set_source_files_properties(${CMAKE_CURRENT_LIST_DIR}/conv2d.cpp ${CMAKE_CURRENT_LIST_DIR}/dense.cpp
                            PROPERTIES COMPILE_OPTIONS "-Wno-psabi;-ffp-contract=fast;-fexpensive-optimizations;$<$<CONFIG:Debug>:-O1>")
# Batch normalization's loops (lanes.hpp), built for AVX-512 and AVX2 too: no contraction into
# fused multiply-adds, so every build rounds as layer_math's formulas (the CUDA cores) do.
set_source_files_properties(${CMAKE_CURRENT_LIST_DIR}/batch_normalization.cpp PROPERTIES COMPILE_OPTIONS "-Wno-psabi;-ffp-contract=off")
