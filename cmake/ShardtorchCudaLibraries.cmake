# NCCL and cuBLAS come from the nvidia-* wheels torch depends on (they ship only
# versioned .so files, so link full paths) or, failing that, from the toolkit.
set(_nv "${SHARDTORCH_NVIDIA_ROOT}")
find_path(SHARDTORCH_NCCL_INCLUDE_DIR nccl.h
  PATHS "${_nv}/nccl/include" "${CUDA_TOOLKIT_ROOT_DIR}/include" /usr/include NO_DEFAULT_PATH)
find_library(SHARDTORCH_NCCL_LIBRARY NAMES libnccl.so.2 nccl
  PATHS "${_nv}/nccl/lib" "${CUDA_TOOLKIT_ROOT_DIR}/lib64" /usr/lib/x86_64-linux-gnu NO_DEFAULT_PATH)
find_path(SHARDTORCH_CUBLAS_INCLUDE_DIR cublasLt.h
  PATHS "${_nv}/cu13/include" "${_nv}/cublas/include" "${CUDA_TOOLKIT_ROOT_DIR}/include" NO_DEFAULT_PATH)
find_library(SHARDTORCH_CUBLASLT_LIBRARY NAMES libcublasLt.so.13 libcublasLt.so.12 cublasLt
  PATHS "${_nv}/cu13/lib" "${_nv}/cublas/lib" "${CUDA_TOOLKIT_ROOT_DIR}/lib64" NO_DEFAULT_PATH)
find_library(SHARDTORCH_CUBLAS_LIBRARY NAMES libcublas.so.13 libcublas.so.12 cublas
  PATHS "${_nv}/cu13/lib" "${_nv}/cublas/lib" "${CUDA_TOOLKIT_ROOT_DIR}/lib64" NO_DEFAULT_PATH)
foreach(_var SHARDTORCH_NCCL_INCLUDE_DIR SHARDTORCH_NCCL_LIBRARY SHARDTORCH_CUBLAS_INCLUDE_DIR
             SHARDTORCH_CUBLASLT_LIBRARY SHARDTORCH_CUBLAS_LIBRARY)
  if(NOT ${_var})
    message(FATAL_ERROR "shardtorch CUDA part: ${_var} not found (nvidia wheels at '${_nv}'); "
                        "set SHARDTORCH_CUDA=0 to build without CUDA")
  endif()
endforeach()
add_library(shardtorch_cuda_deps INTERFACE)
target_include_directories(shardtorch_cuda_deps INTERFACE
  "${SHARDTORCH_NCCL_INCLUDE_DIR}" "${SHARDTORCH_CUBLAS_INCLUDE_DIR}")
target_link_libraries(shardtorch_cuda_deps INTERFACE
  "${SHARDTORCH_NCCL_LIBRARY}" "${SHARDTORCH_CUBLASLT_LIBRARY}" "${SHARDTORCH_CUBLAS_LIBRARY}")
get_filename_component(_nccl_dir "${SHARDTORCH_NCCL_LIBRARY}" DIRECTORY)
get_filename_component(_cublas_dir "${SHARDTORCH_CUBLAS_LIBRARY}" DIRECTORY)
set(SHARDTORCH_NVIDIA_RPATHS "${_nccl_dir};${_cublas_dir}")
message(STATUS "shardtorch: NCCL ${SHARDTORCH_NCCL_LIBRARY}, cuBLASLt ${SHARDTORCH_CUBLASLT_LIBRARY}")
