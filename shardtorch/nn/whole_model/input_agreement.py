"""Whether the ranks of a tensor-parallel group were given the same inputs.

The ranks of a group compute one model together: each must see the same
batch. A data loader that hands each process its own batches (a sampler over
every process, Hugging Face's Trainer under torchrun) trains another model,
silently. One all-gather of a 64-bit digest per rank, of every tensor among
the inputs (by its bytes), says so; where they differ every rank raises the
same ValueError, with the fix. ``parallelize`` makes this check at a
model's first training forward; ``TensorParallelTrainer`` at its first step."""
import hashlib

import torch
from torch import nn

from ...distributed import collectives
from ...distributed import state


def _feed(value, digest) -> None:
    if isinstance(value, torch.Tensor):
        data = value.detach().to("cpu").contiguous()
        digest.update(f"{tuple(data.shape)}{data.dtype}".encode())
        if data.numel():
            digest.update(data.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(value, dict) or hasattr(value, "items"):
        for key, item in sorted(value.items(), key=lambda kv: str(kv[0])):
            digest.update(str(key).encode())
            _feed(item, digest)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _feed(item, digest)


def inputs_digest(inputs) -> int:
    digest = hashlib.sha256()
    _feed(inputs, digest)
    return int.from_bytes(digest.digest()[:8], "little", signed=True)


def check_inputs_agree(who: str, group: str, inputs, fix: str) -> None:
    """Raises ValueError on every rank of ``group`` if the tensors of ``inputs`` differ between its ranks."""
    size = state.get_group_size(group)
    if size == 1:
        return
    mine = torch.tensor([inputs_digest(inputs)], dtype=torch.int64)
    everyone = [torch.empty_like(mine) for _ in range(size)]
    collectives.all_gather(everyone, mine, group=state.get_group(group))
    differ = [rank for rank, digest in enumerate(everyone) if int(digest) != int(everyone[0])]
    if differ:
        raise ValueError(f"{who}: the ranks of tensor-parallel group {group!r} were given different inputs (group "
                         f"rank(s) {differ} differ from group rank 0): every rank of a group computes the same "
                         f"model on the same batch, so this would train another model. Fix: {fix}")


_FIRST_STEP_FIX = ("give every rank of a tensor-parallel group the same batches: shard the data over the "
                   "data-parallel group only (ts.utils.data.DistributedGroupSampler; Hugging Face's Trainer: "
                   "shardtorch.utils.trainer.TensorParallelTrainer)")


def check_inputs_at_first_training_forward(model: nn.Module, group: str) -> None:
    """Checks, at ``model``'s first forward that trains (training mode, gradients on, eager), that the ranks of
    ``group`` were given the same inputs, then stops checking (one all-gather of a digest, once)."""
    if state.get_group_size(group) == 1:
        return
    handle = None

    def hook(module, args, kwargs):
        if not module.training or not torch.is_grad_enabled() or torch.compiler.is_compiling():
            return None
        handle.remove()
        check_inputs_agree("parallelize", group, (args, kwargs), _FIRST_STEP_FIX)
        return None
    handle = model.register_forward_pre_hook(hook, with_kwargs=True, prepend=True)
