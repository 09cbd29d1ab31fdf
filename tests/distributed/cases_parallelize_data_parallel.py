"""ts.nn.parallelize composed with data parallelism, on 4 ranks as 2 data-parallel x 2 tensor-parallel groups
(launched only in that layout): DDP and FSDP2 (ts.nn.parallel.fully_shard, both layouts) around a parallelized
model train exactly like the unsharded model on the global batch (float64); and a sharded checkpoint saved at
group size 2 loads at 2 and, after the groups are re-made, at 4 (uneven heads and vocabulary)."""
import contextlib
import shutil
import tempfile

import torch

import shardtorch as ts
from tests.distributed import parallelize_models as models
from tests.distributed.cases_parallelize import _causal_reference_loss, _pair, _tokens, _whole
from tests.reference import assert_close

F64 = torch.float64


def _reference_step(ref, optimizer, batches):
    optimizer.zero_grad()
    whole = torch.cat(batches)
    logits = ref(input_ids=whole).logits
    _causal_reference_loss(logits, whole).backward()  # no ignored labels: the mean of equal per-batch means
    optimizer.step()


def _assert_trained_alike(ref, par, what):
    collected = ts.collect_state_dict(par, par.state_dict())
    for key, value in ref.state_dict().items():
        assert_close(collected[key], value, F64, f"{what}: {key}")


def case_ddp_2d_trains_like_unsharded_on_the_global_batch():
    # DDP over the data-parallel group (layout "2d") around a parallelized Llama (GQA): each data-parallel
    # rank reads its own batch; training equals the unsharded model on the concatenated batch.
    dp_size, dp_rank = ts.distributed.get_data_parallel_size(), ts.distributed.get_data_parallel_rank()
    assert dp_size == 2, f"launched as 2 x 2, got data-parallel size {dp_size}"
    ref, par = _pair(models.llama)
    ddp = ts.nn.parallel.DistributedDataParallel(par, layout="2d")
    optimizers = [torch.optim.AdamW(ref.parameters(), lr=1e-2), torch.optim.AdamW(ddp.parameters(), lr=1e-2)]
    for step in range(3):
        batches = [_tokens(100 + 10 * step + r, batch=2)[0] for r in range(dp_size)]
        _reference_step(ref, optimizers[0], batches)
        optimizers[1].zero_grad()
        mine = batches[dp_rank]
        ddp(input_ids=mine, labels=mine).loss.backward()
        optimizers[1].step()
    _assert_trained_alike(ref, par, "llama under 2-D DDP after 3 AdamW steps")


def _fully_sharded_tied_gpt2(layout):
    # GPT-2's lm_head.weight is wte.weight: after parallelize both modules hold the one vocabulary shard, and
    # fully_shard must make them a single FSDP unit (FSDP2 manages each parameter in exactly one unit).
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    dp_size, dp_rank = ts.distributed.get_data_parallel_size(), ts.distributed.get_data_parallel_rank()
    ref, par = _pair(models.gpt2)
    assert par.lm_head.weight is par.transformer.wte.weight, "parallelize untied GPT-2's LM head"
    ts.nn.parallel.fully_shard(par, layout=layout)
    optimizers = [torch.optim.AdamW(ref.parameters(), lr=1e-2), torch.optim.AdamW(par.parameters(), lr=1e-2)]
    for step in range(3):
        if layout == "2d":  # one batch per data-parallel rank, the same across its tensor-parallel group
            batches = [_tokens(200 + 10 * step + r, batch=2)[0] for r in range(dp_size)]
            mine = batches[dp_rank]
        else:  # "hybrid": one batch per rank, gathered over the tensor-parallel group before the sharded model
            batches = [_tokens(300 + 10 * step + r, batch=2)[0] for r in range(world)]
            mine = ts.distributed.gather(batches[rank], dim=0)
        _reference_step(ref, optimizers[0], batches)
        optimizers[1].zero_grad()
        par(input_ids=mine, labels=mine).loss.backward()
        optimizers[1].step()
    _assert_trained_alike(ref, par, f"tied GPT-2 under fully_shard layout={layout!r} after 3 AdamW steps")


def case_fully_shard_2d_tied_gpt2_trains_like_unsharded():
    _fully_sharded_tied_gpt2("2d")


def case_fully_shard_hybrid_tied_gpt2_trains_like_unsharded():
    _fully_sharded_tied_gpt2("hybrid")


@contextlib.contextmanager
def _tensor_parallel_size(size):
    """shardtorch's groups re-made with ``size`` ranks per tensor-parallel group, then back to this launch's."""
    launched = ts.distributed.get_group_size()
    ts.distributed.destroy_process_group(keep_torch_distributed=True)
    ts.distributed.init_process_group(group_size=size)
    try:
        yield
    finally:
        ts.distributed.destroy_process_group(keep_torch_distributed=True)
        ts.distributed.init_process_group(group_size=launched)


def _adamw_step(model, parallel, optimizer, ids):
    optimizer.zero_grad()
    if parallel:
        model(input_ids=ids, labels=ids).loss.backward()
    else:
        _causal_reference_loss(model(input_ids=ids).logits, ids).backward()
    optimizer.step()


def case_sharded_checkpoint_of_head_split_entries_loads_at_other_group_sizes():
    # GPT-2's fused c_attn (q, k, v pieces per rank) and Llama's GQA q/k/v/o split by whole heads: after one
    # AdamW step, save_sharded (model and optimizer) at group size 2 (heads 5,5 and 6,6), load_sharded at 2
    # and at 4 (GPT-2 3,3,2,2; Llama 3,3,3,3 with 1 kv head each; vocabulary 97 as 25,24,24,24): the logits
    # equal the unsharded model's, and so do they after one more step from the loaded optimizer state.
    ids, _ = _tokens(9)
    more, _ = _tokens(10)
    directory = [tempfile.mkdtemp(prefix="parallelize_sharded_") if torch.distributed.get_rank() == 0 else None]
    torch.distributed.broadcast_object_list(directory, src=0)
    try:
        for build in (models.gpt2, models.llama):
            path = f"{directory[0]}/{build.__name__}"
            ref, par = _pair(build)
            optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, par)]
            _adamw_step(ref, False, optimizers[0], ids)
            _adamw_step(par, True, optimizers[1], ids)
            saved = ref(input_ids=ids).logits.detach()
            ts.save_sharded(par, path, optimizer=optimizers[1])
            _adamw_step(ref, False, optimizers[0], more)
            after = ref(input_ids=ids).logits.detach()
            for size in (2, 4):
                context = _tensor_parallel_size(size) if size != ts.distributed.get_group_size() else \
                    contextlib.nullcontext()
                with context:
                    torch.manual_seed(1234)  # other weights, all replaced by the load
                    fresh = ts.nn.parallelize(build().to(F64))
                    optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
                    ts.load_sharded(fresh, path, optimizer=optimizer)
                    what = f"{build.__name__} saved at 2, loaded at {size}"
                    assert_close(_whole(fresh(input_ids=ids).logits, True), saved, F64, f"{what}: logits")
                    _adamw_step(fresh, True, optimizer, more)
                    assert_close(_whole(fresh(input_ids=ids).logits, True), after, F64,
                                 f"{what}: logits after one more AdamW step from the loaded state")
    finally:
        torch.distributed.barrier()
        if torch.distributed.get_rank() == 0:
            shutil.rmtree(directory[0], ignore_errors=True)
