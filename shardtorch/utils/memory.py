"""Peak memory of tensors, on CPU as on CUDA.

torch keeps allocator statistics only for CUDA. ``track_cpu_memory()`` wraps
the CPU allocator (in the C++ core) so that every CPU tensor allocation, inside
ops too, is counted until freed; tensors that existed before are not counted.
"""
import torch

from .. import _C


def track_cpu_memory() -> None:
    """Starts counting CPU tensor memory (for the rest of the process)."""
    _C.install_cpu_memory_tracker()


class PeakMemory:
    """``with PeakMemory(device) as m: ...`` then ``m.peak_bytes``: the largest
    amount of tensor memory alive during the block beyond what was alive when it
    began (CPU needs track_cpu_memory() first; it is called here if not)."""

    def __init__(self, device="cpu"):
        self.device = torch.device(device)

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
        else:
            track_cpu_memory()
            _C.reset_cpu_peak_memory()
            self._start = _C.cpu_memory_stats()[0]
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device) - self._start
        else:
            self.peak_bytes = _C.cpu_memory_stats()[1] - self._start
        return False
