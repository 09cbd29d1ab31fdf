"""Hugging Face's Trainer over a parallelized GPT-2 (float64), run as torchrun runs it, one Trainer per rank:
TensorParallelTrainer trains the unsharded model's weights (the batches it fed, replayed on the unsharded model
with torch's AdamW, give the same parameters) and save_model writes the unsharded checkpoint."""
import os

import torch
import torch.nn.functional as F

import shardtorch as ts
from shardtorch.utils.trainer import TensorParallelTrainer
from tests.distributed import parallelize_models as models
from tests.reference import expect_error

EXACT = 1e-10
STEPS, LR = 3, 1e-2


def _dataset(count=12):
    generator = torch.Generator().manual_seed(11)
    ids = torch.randint(0, models.VOCAB, (count, models.SEQ), generator=generator)
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def _arguments(folder, **overrides):
    from transformers import TrainingArguments
    settings = dict(output_dir=folder, per_device_train_batch_size=2, max_steps=STEPS, learning_rate=LR,
                    lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=0.0,
                    optim="adamw_torch", report_to=[], save_strategy="no", logging_strategy="no", use_cpu=True,
                    seed=0, dataloader_drop_last=True, disable_tqdm=True)
    settings.update(overrides)
    return TrainingArguments(**settings)


def _gpt2():
    torch.manual_seed(0)
    return models.gpt2().to(torch.float64)


def _relative(actual, expected):
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item()


def case_tensor_parallel_trainer_trains_and_saves_the_unsharded_model():
    from transformers import GPT2LMHeadModel
    folder = os.path.join(os.environ["SHARDTORCH_TEST_SCRATCH"], f"trainer-{ts.distributed.get_world_size()}")
    reference, model = _gpt2(), ts.nn.parallelize(_gpt2())
    fed = []

    def record(module, args, kwargs):
        fed.append((kwargs["input_ids"].clone(), kwargs["labels"].clone(), kwargs.get("num_items_in_batch")))
    model.register_forward_pre_hook(record, with_kwargs=True, prepend=True)
    trainer = TensorParallelTrainer(model=model, args=_arguments(folder), train_dataset=_dataset())
    trainer.train()
    assert len(fed) == STEPS, f"{len(fed)} forwards for {STEPS} steps"
    everyone = [None] * ts.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, [(ids.tolist(), labels.tolist()) for ids, labels, _ in fed])
    group = [everyone[r] for r in ts.distributed.get_group_ranks()]
    assert all(b == group[0] for b in group), "the ranks of the tensor-parallel group were fed different batches"
    replicas = [everyone[r] for r in ts.distributed.get_group_ranks(ts.distributed.DATA_PARALLEL)]
    steps = [[replica[step] for replica in replicas] for step in range(STEPS)]
    assert len({str(b) for step in steps for b in step}) == STEPS * len(replicas), \
        "a batch came twice: the data-parallel groups, or the steps, were fed the same batches"
    # The same steps on the unsharded model, as the Trainer takes them in one process on the global batch (the
    # data-parallel groups' batches together): the summed loss over the batch's label count (Hugging Face's
    # num_items_in_batch), torch's AdamW, the loss written out in float64.
    optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.0)
    for step in steps:
        ids = torch.cat([torch.tensor(ids_) for ids_, _ in step])
        labels = torch.cat([torch.tensor(labels_) for _, labels_ in step])
        logits = reference(input_ids=ids).logits
        shifted = F.pad(labels, (0, 1), value=-100)[..., 1:].reshape(-1)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), shifted, reduction="sum") / (labels != -100).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    trained = ts.collect_state_dict(model, model.state_dict())
    expected = reference.state_dict()
    worst = max((_relative(trained[key], expected[key]), key) for key in expected)
    assert worst[0] <= EXACT, f"the Trainer trained other weights: {worst}"
    moved = max(_relative(expected[k], v) for k, v in _gpt2().state_dict().items() if v.is_floating_point())
    assert moved > 1e-3, "training changed nothing: the comparison proves nothing"
    trainer.save_model(folder)  # every rank; used to hang on rank 0 alone
    torch.distributed.barrier()
    saved = GPT2LMHeadModel.from_pretrained(folder, dtype=torch.float64).state_dict()
    worst = max((_relative(saved[key], expected[key]), key) for key in expected)
    assert worst[0] <= EXACT, f"save_model wrote other weights: {worst}"
    torch.distributed.barrier()


def case_first_step_refuses_different_inputs_on_the_ranks_of_a_group():
    folder = os.path.join(os.environ["SHARDTORCH_TEST_SCRATCH"], "trainer-refused")
    rank = ts.distributed.get_group_rank()
    model = ts.nn.parallelize(_gpt2())
    # Each rank its own data: what a sampler over every process does to a tensor-parallel group.
    trainer = TensorParallelTrainer(model=model, args=_arguments(folder), train_dataset=_dataset()[rank:])
    expect_error(trainer.train, "TensorParallelTrainer: the ranks of tensor-parallel group 'tp' were given "
                 "different inputs", "Fix: ", exception=ValueError)
    torch.distributed.barrier()


def case_the_plain_trainer_is_refused_at_its_first_step():
    # transformers.Trainer under torchrun gives each rank its own batches: the parallelized model's first
    # training forward says so on every rank (it trained other weights silently before).
    from transformers import Trainer
    folder = os.path.join(os.environ["SHARDTORCH_TEST_SCRATCH"], "trainer-plain")
    model = ts.nn.parallelize(_gpt2())
    trainer = Trainer(model=model, args=_arguments(folder), train_dataset=_dataset())
    expect_error(trainer.train, "parallelize: the ranks of tensor-parallel group 'tp' were given different inputs",
                 "TensorParallelTrainer", exception=ValueError)
    torch.distributed.barrier()
