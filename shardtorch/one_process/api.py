"""``shardtorch.tensor_parallel(model, devices)``: tensor parallelism from one Python process (a
notebook, a script run with ``python``), with the same splits, ops and collectives as torchrun's
ranks. docs/one-process.md says how it works and why the ranks are processes."""
import os
from typing import Optional, Sequence

import torch
from torch import nn

from ..distributed.state import default_timeout
from .model import TensorParallelModel
from .pool import WorkerPool

_NOT_HERE = ("group",)


def _devices(devices, what: str):
    if isinstance(devices, (str, torch.device, int)) or not isinstance(devices, (list, tuple)) or not devices:
        raise ValueError(f"{what}: devices must be a non-empty list, such as ['cuda:0', 'cuda:1'] or "
                         f"['cpu', 'cpu'], got {devices!r}")
    parsed = []
    for device in devices:
        try:
            parsed.append(torch.device(f"cuda:{device}" if isinstance(device, int) else device))
        except (RuntimeError, TypeError):
            raise ValueError(f"{what}: {device!r} is not a device") from None
    kinds = {d.type for d in parsed}
    if len(kinds) > 1:
        raise ValueError(f"{what}: devices {[str(d) for d in parsed]} mix kinds; the ranks of one group use one kind "
                         "of device (their collectives are Gloo for CPU tensors or NCCL for CUDA ones, not both)")
    kind = kinds.pop()
    if kind == "cpu":
        return parsed
    if kind != "cuda":
        raise ValueError(f"{what}: devices must be 'cpu' or CUDA devices, got {str(parsed[0])!r}")
    if any(d.index is None for d in parsed):
        raise ValueError(f"{what}: name each CUDA device with its index ('cuda:0', 'cuda:1'), got "
                         f"{[str(d) for d in parsed]}")
    if len({d.index for d in parsed}) != len(parsed):
        raise ValueError(f"{what}: a CUDA device appears twice in {[str(d) for d in parsed]}; NCCL takes one rank "
                         "per device")
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    missing = [str(d) for d in parsed if d.index >= available]
    if missing:
        raise ValueError(f"{what}: {missing} not found: this machine has {available} CUDA device(s)")
    return parsed


def _threads(devices, threads: Optional[int]) -> int:
    if threads is not None:
        if not isinstance(threads, int) or threads < 1:
            raise ValueError(f"tensor_parallel: threads must be a positive int, got {threads!r}")
        return threads
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // len(devices))


def _pool(devices, threads, build):
    return WorkerPool(devices, _threads(devices, threads), build, default_timeout().total_seconds(), grace_s=5.0)


def tensor_parallel(model: nn.Module, devices: Optional[Sequence] = None, *, threads: Optional[int] = None,
                    device_ids: Optional[Sequence] = None, **parallelize_options) -> TensorParallelModel:
    """``model`` split over ``devices`` from this one process, used as the unsharded model is.

    Starts one worker process per device (a rank of a group of all of them), gives each the model,
    and splits it there with ``ts.nn.parallelize`` (every split it knows, proven exact the same way;
    ``parallelize_options`` are its options: ``plan``, ``sequence_parallel``, ``logits``,
    ``verify``, ...). The result's ``forward`` returns the unsharded model's outputs; ``backward``
    and an optimizer over its ``parameters()`` train it; ``generate``, ``state_dict`` (whole
    tensors), ``load_state_dict`` and ``save_pretrained`` work as on the unsharded model.

    Args:
        model: the unsharded model, on the CPU (each rank moves its slices to its device).
        devices: one per rank: CUDA devices (``["cuda:0", "cuda:1"]``) or ``"cpu"`` repeated.
        threads: CPU threads per rank (default: this process's cores divided among the ranks).
        device_ids: another name for ``devices`` (tensor_parallel's, for code written for it).

    ``close()`` (or the model's garbage collection, or exit) stops the workers. A rank's exception
    is raised here; see docs/one-process.md for faults and Ctrl-C.
    """
    if device_ids is not None:
        if devices is not None:
            raise TypeError("tensor_parallel: pass devices or device_ids (the same argument), not both")
        devices = device_ids
    devices = _devices(devices, "tensor_parallel")
    if not isinstance(model, nn.Module):
        raise TypeError(f"tensor_parallel: model must be a torch.nn.Module, got {type(model).__name__}")
    for key in _NOT_HERE:
        if key in parallelize_options:
            raise TypeError(f"tensor_parallel: {key}= is not an option here: the ranks form one group of all the "
                            "devices")
    placed = {t.device.type for t in list(model.parameters()) + list(model.buffers())}
    if placed - {"cpu"}:
        raise ValueError(f"tensor_parallel: the model has tensors on {sorted(placed - {'cpu'})}; pass it on the CPU "
                         "(each rank moves only its slices to its device)")
    build = dict(how="parallelize", model=model, kwargs=parallelize_options)
    return TensorParallelModel(_pool(devices, threads, build), model)


def from_pretrained_on(devices: Sequence, args, kwargs, threads: Optional[int] = None) -> TensorParallelModel:
    """``ts.nn.from_pretrained(*args, devices=devices, **kwargs)``: each rank loads only its slices."""
    devices = _devices(devices, "from_pretrained")
    for key in _NOT_HERE + ("device",):
        if key in kwargs:
            raise TypeError(f"from_pretrained: {key}= does not go with devices=: each rank's device is its "
                            "entry of devices")
    pool = _pool(devices, threads, dict(how="from_pretrained", args=args, kwargs=kwargs))
    return TensorParallelModel(pool, _ConfigOnly(pool))


class _ConfigOnly:
    """Stands for the source model when there is none in this process: its config comes from rank 0."""

    def __init__(self, pool: WorkerPool):
        self.config, self.generation_config = pool.run("configs", {}, ranks=[0])[0]
