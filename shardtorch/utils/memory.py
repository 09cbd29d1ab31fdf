"""Peak memory of tensors, on CPU as on CUDA.

torch keeps allocator statistics only for CUDA. ``track_cpu_memory()`` wraps
the CPU allocator (in the C++ core) so that every CPU tensor allocation, inside
ops too, is counted until freed; tensors that existed before are not counted.

The fused heads keep their large CPU buffers (a weight gradient, the gathered
kept rows, blocks of logits) for their next call instead of freeing them
(csrc/ops/recycled_buffers.h): ``free_recycled_buffers()`` lets go of those
nobody holds. ``SHARDTORCH_RECYCLE_BUFFERS=0`` turns the recycling off.
"""
import torch

from .. import _C


def track_cpu_memory() -> None:
    """Starts counting CPU tensor memory (for the rest of the process)."""
    _C.install_cpu_memory_tracker()


def free_recycled_buffers() -> int:
    """Frees the CPU buffers the fused heads keep for their next call and that
    nothing else holds (a gradient the caller still holds stays); returns the
    bytes freed. Like ``torch.cuda.empty_cache()`` for their CPU buffers: call
    it where the memory is needed for something else (an evaluation between
    epochs, say); the next training step allocates them again."""
    return _C.free_recycled_buffers()


class PeakMemory:
    """``with PeakMemory(device) as m: ...`` then ``m.peak_bytes``: the largest
    amount of tensor memory alive during the block beyond what was alive when it
    began (CPU needs track_cpu_memory() first; it is called here if not). On
    the CPU it first frees the buffers the fused heads keep between calls
    (free_recycled_buffers()), so that the block's own buffers count."""

    def __init__(self, device="cpu"):
        self.device = torch.device(device)

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
        else:
            track_cpu_memory()
            free_recycled_buffers()
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
