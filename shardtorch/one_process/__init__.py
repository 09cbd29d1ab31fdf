"""Tensor parallelism from one Python process: ``shardtorch.tensor_parallel(model, devices)``.

Files, caller side first:
- api.py: ``tensor_parallel`` and ``from_pretrained(devices=...)``'s entry, and their checks;
- model.py: TensorParallelModel, the caller's module (parameters mapped from the ranks);
- remote_outputs.py: outputs joined to the caller's autograd, lazy logits fetched on read;
- pool.py: the worker processes, commands to every rank, faults and Ctrl-C;
- wire.py: how values travel (shared memory, IPC handles, classes by value);
- structure.py: walking inputs and outputs, the markers for what stays on a rank;
- worker.py and rank_model.py: a worker's process and the commands its rank runs.
"""
from .api import tensor_parallel
from .model import TensorParallelModel
from .pool import BrokenModelError, WorkerError

__all__ = ["tensor_parallel", "TensorParallelModel", "BrokenModelError", "WorkerError"]
