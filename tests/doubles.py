"""shardtorch._C_testing, the C++ core's test doubles (csrc/python/testing_module.cpp: fake CUDA
communicators, ranks simulated in one process, the store exchange on threads, the watchdog driven
by callables). It is built beside shardtorch._C only with SHARDTORCH_BUILD_TEST_DOUBLES=1
(scripts/test.sh and tests/gpu/run.sh set it), so that a user's build carries none of them. The
tests import it from here, which says how to build it when it is missing."""
try:
    from shardtorch import _C_testing
except ImportError as e:  # a user's build: say what to type
    raise ImportError(
        "shardtorch._C_testing, the test doubles these tests drive, is not built: build with "
        "SHARDTORCH_BUILD_TEST_DOUBLES=1 (scripts/test.sh sets it), e.g. SHARDTORCH_BUILD_TEST_DOUBLES=1 "
        "python setup.py build_ext --inplace") from e

__all__ = ["_C_testing"]
