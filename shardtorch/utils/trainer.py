"""Hugging Face's ``Trainer`` over a tensor-parallel model: ``TensorParallelTrainer``.

The plain Trainer under torchrun treats every process as a data-parallel
replica: accelerate's data loader hands each rank its own batches, so the
ranks of a tensor-parallel group (which compute one model together, and must
see the same batch) train on different data, silently; and ``save_model``
calls ``save_pretrained`` on rank 0 alone, which waits for the other ranks
forever. ``TensorParallelTrainer`` is the Trainer with three changes:

- its data loaders shard the batches over the data-parallel group only
  (``ts.distributed.get_data_parallel_size()`` / ``_rank()``): every rank of a
  tensor-parallel group gets the same batches, the groups different ones;
- ``save_model`` (and the checkpoints during training) call the model's
  ``save_pretrained`` on every rank, which writes the unsharded model's
  checkpoint (rank 0 writes; the tokenizer and the training arguments too);
  of a peft model, ``ts.nn.save_adapter``: peft's plain adapter, whole;
- its first training step checks that the ranks of each group were given the
  same inputs (one all-gather of a digest) and refuses, on every rank, a
  setup that feeds them different ones.

The model is still wrapped in accelerate's DDP over every rank: shardtorch
excludes the shards from it (they are averaged over the data-parallel group
only), and the whole parameters, whose gradients are equal across a group,
average to themselves.
"""
import os
from typing import Optional

import torch
from transformers import Trainer

from ..distributed import state
from ..nn.whole_model.input_agreement import check_inputs_agree

_FIX = ("train with shardtorch.utils.trainer.TensorParallelTrainer instead of transformers.Trainer (it shards the "
        "batches over the data-parallel group only), or give every rank of a group the same batches "
        "(ts.utils.data.DistributedGroupSampler)")


def shard_by_data_parallel_group(loader):
    """Makes an accelerate-prepared data loader shard its batches over the data-parallel group instead of
    over every process; returns it."""
    from accelerate.data_loader import BatchSamplerShard, DataLoaderDispatcher, IterableDatasetShard
    if isinstance(loader, DataLoaderDispatcher):
        raise ValueError("TensorParallelTrainer: accelerate's dispatch_batches=True sends rank 0's batches to "
                         "every process; pass dispatch_batches=False (accelerator_config)")
    size, rank = state.get_data_parallel_size(), state.get_data_parallel_rank()
    for shard in (getattr(loader, "batch_sampler", None), getattr(loader, "dataset", None)):
        if isinstance(shard, (BatchSamplerShard, IterableDatasetShard)):
            shard.num_processes, shard.process_index = size, rank
    return loader


class TensorParallelTrainer(Trainer):
    """transformers.Trainer for a model parallelized by shardtorch (``ts.nn.parallelize``,
    ``ts.nn.from_pretrained``): see the module docstring. Run it on every rank, as the Trainer."""

    _inputs_checked = False

    def get_train_dataloader(self):
        return shard_by_data_parallel_group(super().get_train_dataloader())

    def get_eval_dataloader(self, eval_dataset=None):
        return shard_by_data_parallel_group(super().get_eval_dataloader(eval_dataset))

    def get_test_dataloader(self, test_dataset):
        return shard_by_data_parallel_group(super().get_test_dataloader(test_dataset))

    def training_step(self, model, inputs, *args, **kwargs):
        if not self._inputs_checked:
            check_inputs_agree("TensorParallelTrainer", state.TENSOR_PARALLEL, inputs, _FIX)
            self._inputs_checked = True
        return super().training_step(model, inputs, *args, **kwargs)

    def _save(self, output_dir: Optional[str] = None, state_dict=None) -> None:
        from transformers.trainer import TRAINING_ARGS_NAME
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if self.args.should_save:
            os.makedirs(output_dir, exist_ok=True)
        # Every rank: the unsharded checkpoint (or a peft model's whole adapter) is gathered from all of them
        # (rank 0 writes).
        model = self.accelerator.unwrap_model(self.model, keep_torch_compile=False)
        if _is_peft_model(model):
            from ..nn.whole_model.adapter_save import save_adapter
            save_adapter(model, output_dir)
        else:
            model.save_pretrained(output_dir)
        if not self.args.should_save:
            return
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))


def _is_peft_model(model) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)
