#pragma once
// Status checks for the CUDA libraries shardtorch calls directly (NCCL,
// cuBLAS/cuBLASLt). A failure throws a c10::Error carrying the library's own
// message, what was called, and file:line:
//   SHARDTORCH_NCCL_CHECK(ncclCommInitRank(...), "ncclCommInitRank for group 'tp'");
//   SHARDTORCH_CUBLAS_CHECK(cublasLtMatmul(...), "cublasLtMatmul");
// `what` is evaluated only on failure (no string is built on the hot path).
// The includer includes <nccl.h> or <cublasLt.h>; this header needs neither.

#include <c10/util/Exception.h>

#define SHARDTORCH_LIBRARY_CHECK_(expr, success, describe, library, what)                       \
  do {                                                                                          \
    const auto _shardtorch_status = (expr);                                                     \
    TORCH_CHECK(_shardtorch_status == (success), "shardtorch: ", library, " ", what,            \
                " failed: ", describe(_shardtorch_status), " (", __FILE__, ":", __LINE__, ")"); \
  } while (0)

#define SHARDTORCH_NCCL_CHECK(expr, what) \
  SHARDTORCH_LIBRARY_CHECK_(expr, ncclSuccess, ncclGetErrorString, "NCCL", what)

#define SHARDTORCH_CUBLAS_CHECK(expr, what) \
  SHARDTORCH_LIBRARY_CHECK_(expr, CUBLAS_STATUS_SUCCESS, cublasGetStatusString, "cuBLASLt", what)
