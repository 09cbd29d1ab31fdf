"""Counting the host's waits for a CUDA device during one call: the one place the GPU tests
(tests/gpu) and benchmarks/gpu_probe.py count them.

No single tool sees them all. ``torch.cuda.set_sync_debug_mode`` reports torch's implicit
synchronisations (``.item()``, a boolean mask, a device-to-host copy) but not a wait on a CUDA
event; the profiler sees the runtime calls (``cudaEventSynchronize``, ...) and the copies, but
not whose they are; shardtorch counts its own waits for the deferred argument checks of its NCCL
communicators (docs/cuda.md, "Errors without host synchronisation"). ``host_syncs`` gives the
first and the last; ``profiled_host_syncs`` the profiler's.
"""
import warnings
from dataclasses import dataclass
from typing import Callable, List

import torch

from .. import _C

#: Runtime calls that block the host until the device is done with earlier work.
SYNC_CALLS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cuStreamSynchronize",
              "cuEventSynchronize", "cuCtxSynchronize")


@dataclass
class HostSyncs:
    #: What torch.cuda.set_sync_debug_mode("warn") reported, one message per synchronisation.
    debug_mode: List[str]
    #: shardtorch's deferred checks whose copy was not on the host yet when their verdict was due:
    #: the host waited for a CUDA event (sync_debug_mode does not see these).
    deferred_check_waits: int
    #: Deferred checks whose verdict was given during the call (with or without a wait).
    deferred_checks_settled: int


def host_syncs(fn: Callable[[], object]) -> HostSyncs:
    """Runs ``fn()`` once, after the device has finished earlier work (so that nothing left from
    before makes the host wait), and counts the host's waits for the device during it."""
    torch.cuda.synchronize()
    before = _C._deferred_check_counts()
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    after = _C._deferred_check_counts()
    return HostSyncs(debug_mode=[str(w.message) for w in caught if "synchroniz" in str(w.message)],
                     deferred_check_waits=after["waits"] - before["waits"],
                     deferred_checks_settled=after["settled"] - before["settled"])


@dataclass
class ProfiledSyncs:
    #: Blocking runtime calls (SYNC_CALLS) the profiler saw, whoever made them.
    sync_calls: int
    #: Device-to-host copies (each one waits for the device unless pinned and asynchronous).
    memcpy_dtoh: int


def profiled_host_syncs(fn: Callable[[], object]) -> ProfiledSyncs:
    """Runs ``fn()`` once under the profiler; the profiler's own closing synchronisation is not
    counted."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()  # the profiler's own
    names = [e.name for e in prof.events()]
    return ProfiledSyncs(sync_calls=max(0, sum(n in SYNC_CALLS for n in names) - 1),
                         memcpy_dtoh=sum("Memcpy DtoH" in n for n in names))
