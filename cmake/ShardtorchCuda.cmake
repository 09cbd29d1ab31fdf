# Decides whether the CUDA part is built (SHARDTORCH_WITH_CUDA) and prepares
# torch's CMake CUDA detection, which on these machines guesses the toolkit root
# wrongly and builds every architecture unless told otherwise.
set(SHARDTORCH_WITH_CUDA OFF)

# setup.py tells whether torch has CUDA and where the nvidia-* wheels are; a
# plain CMake build (no Python) finds out from torch's files: a CUDA build of
# torch has lib/libtorch_cuda.so beside its share/cmake/Torch, and the wheels
# sit next to torch in site-packages.
if(NOT DEFINED SHARDTORCH_TORCH_HAS_CUDA OR NOT DEFINED SHARDTORCH_NVIDIA_ROOT)
  find_path(_shardtorch_torch_config_dir TorchConfig.cmake PATH_SUFFIXES Torch share/cmake/Torch NO_CACHE)
  if(_shardtorch_torch_config_dir)
    get_filename_component(_shardtorch_torch_root "${_shardtorch_torch_config_dir}/../../.." ABSOLUTE)
    if(NOT DEFINED SHARDTORCH_TORCH_HAS_CUDA)
      if(EXISTS "${_shardtorch_torch_root}/lib/libtorch_cuda.so")
        set(SHARDTORCH_TORCH_HAS_CUDA ON)
      else()
        set(SHARDTORCH_TORCH_HAS_CUDA OFF)
      endif()
    endif()
    if(NOT DEFINED SHARDTORCH_NVIDIA_ROOT AND EXISTS "${_shardtorch_torch_root}/../nvidia")
      get_filename_component(SHARDTORCH_NVIDIA_ROOT "${_shardtorch_torch_root}/../nvidia" ABSOLUTE)
    endif()
  endif()
endif()
# nvcc is looked for whenever torch has CUDA: with SHARDTORCH_CUDA=OFF no CUDA
# code is built, but torch's own config still needs the toolkit's root.
if(NOT SHARDTORCH_CUDA STREQUAL "OFF" OR SHARDTORCH_TORCH_HAS_CUDA)
  if(NOT CMAKE_CUDA_COMPILER)
    find_program(_shardtorch_nvcc nvcc PATHS /usr/local/cuda/bin "$ENV{CUDA_HOME}/bin" NO_CACHE)
    if(_shardtorch_nvcc)
      # /usr/local/bin/nvcc may be a wrapper: use the toolkit's own binary.
      get_filename_component(_shardtorch_nvcc "${_shardtorch_nvcc}" REALPATH)
      if(EXISTS /usr/local/cuda/bin/nvcc)
        set(_shardtorch_nvcc /usr/local/cuda/bin/nvcc)
      endif()
      set(CMAKE_CUDA_COMPILER "${_shardtorch_nvcc}")
    endif()
  endif()
endif()
# AUTO builds the CUDA part only where it can run, as torchvision does: a machine
# without a GPU would pay for nvcc (about a minute) and never use it. ON builds
# it anyway (CI, and builds for another machine). setup.py says whether torch
# sees a GPU; a plain CMake build asks nvidia-smi.
if(SHARDTORCH_CUDA STREQUAL "AUTO" AND NOT DEFINED SHARDTORCH_GPU_VISIBLE)
  execute_process(COMMAND nvidia-smi -L RESULT_VARIABLE _shardtorch_smi_result
                  OUTPUT_VARIABLE _shardtorch_smi_out ERROR_QUIET)
  if(_shardtorch_smi_result EQUAL 0 AND _shardtorch_smi_out MATCHES "GPU")
    set(SHARDTORCH_GPU_VISIBLE ON)
  else()
    set(SHARDTORCH_GPU_VISIBLE OFF)
  endif()
endif()
if(SHARDTORCH_CUDA STREQUAL "ON" OR (SHARDTORCH_CUDA STREQUAL "AUTO" AND SHARDTORCH_GPU_VISIBLE))
  if(SHARDTORCH_TORCH_HAS_CUDA AND CMAKE_CUDA_COMPILER)
    set(SHARDTORCH_WITH_CUDA ON)
  elseif(SHARDTORCH_CUDA STREQUAL "ON")
    message(FATAL_ERROR "SHARDTORCH_CUDA=ON but torch has CUDA=${SHARDTORCH_TORCH_HAS_CUDA} "
                        "and nvcc='${CMAKE_CUDA_COMPILER}'")
  endif()
endif()
# CMake before 3.25.2 does not know nvcc 12+'s flag for the C++20 dialect.
if(SHARDTORCH_WITH_CUDA AND CMAKE_VERSION VERSION_LESS 3.25.2)
  message(FATAL_ERROR "shardtorch: the CUDA part needs CMake >= 3.25.2 (this is ${CMAKE_VERSION}, "
                      "${CMAKE_COMMAND}): `pip install cmake`, or build without it with SHARDTORCH_CUDA=0")
endif()

if(SHARDTORCH_TORCH_HAS_CUDA)
  # torch's own config needs the toolkit even when we build no CUDA code.
  if(CMAKE_CUDA_COMPILER)
    get_filename_component(_shardtorch_cuda_bin "${CMAKE_CUDA_COMPILER}" DIRECTORY)
    get_filename_component(_shardtorch_cuda_root "${_shardtorch_cuda_bin}" DIRECTORY)
    set(CUDA_TOOLKIT_ROOT_DIR "${_shardtorch_cuda_root}" CACHE PATH "CUDA toolkit root")
    set(CUDAToolkit_ROOT "${_shardtorch_cuda_root}")
  endif()
  set(ENV{TORCH_CUDA_ARCH_LIST} "${SHARDTORCH_CUDA_ARCH}")
  set(CMAKE_CUDA_RUNTIME_LIBRARY Shared)
  if(SHARDTORCH_NVIDIA_ROOT)
    find_library(CUDA_nvrtc_LIBRARY NAMES libnvrtc.so.13 libnvrtc.so.12 nvrtc
      PATHS "${SHARDTORCH_NVIDIA_ROOT}/cu13/lib" "${SHARDTORCH_NVIDIA_ROOT}/cuda_nvrtc/lib"
      "${CUDA_TOOLKIT_ROOT_DIR}/lib64" NO_DEFAULT_PATH)
  endif()
endif()
if(SHARDTORCH_WITH_CUDA)
  enable_language(CUDA)
  # torch's CMake takes the architectures from TORCH_CUDA_ARCH_LIST (set above)
  # and warns when CMAKE_CUDA_ARCHITECTURES is also defined.
  unset(CMAKE_CUDA_ARCHITECTURES)
  unset(CMAKE_CUDA_ARCHITECTURES CACHE)
endif()
message(STATUS "shardtorch: CUDA part ${SHARDTORCH_WITH_CUDA} (SHARDTORCH_CUDA=${SHARDTORCH_CUDA}, "
               "GPU visible: ${SHARDTORCH_GPU_VISIBLE}, torch CUDA: ${SHARDTORCH_TORCH_HAS_CUDA}, "
               "nvcc: ${CMAKE_CUDA_COMPILER}, arch: ${SHARDTORCH_CUDA_ARCH})")
