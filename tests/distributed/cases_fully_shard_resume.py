"""A checkpoint saved under fully_shard x TP at 4 ranks (2 x 2,
cases_fully_shard.case_hand_off_to_two_ranks: 2 steps of SGD with momentum)
loads under DDP x TP at 2 ranks (1 x 2 and 2 x 1) from each of its three
forms (save_sharded, DCP, a collected file relocated), and the run continues
equal to unsharded training of all 4 steps within 1e-9."""
import os

import torch
import torch.distributed as dist

import shardtorch as ts
from tests.distributed.cases_data_parallel import Net, _local_batch, _make_optimizer
from tests.distributed.cases_fully_shard import build, global_batch, record, reference_step, relative_error


def _path(*parts):
    return os.path.join(os.environ["SHARDTORCH_FSDP_HANDOFF"], *parts)


def _continue_from(load, what):
    reference = build(False)
    opt_ref = _make_optimizer("sgd", reference.parameters())
    for step in range(4):
        reference_step(reference, opt_ref, step)
    model = build(True, seed=999, cls=Net)
    ddp = ts.nn.parallel.DistributedDataParallel(model, layout="2d")
    opt = _make_optimizer("sgd", ddp.parameters())
    load(ddp, opt)
    assert all("momentum_buffer" in s for s in opt.state.values()) and len(opt.state) > 0
    for step in range(2, 4):
        x, y = _local_batch("2d", *global_batch(step), step)
        opt.zero_grad()
        ts.nn.ParallelCrossEntropyLoss()(ddp(x), y).backward()
        opt.step()
    mine = {name: p.detach() for name, p in model.named_parameters()}
    tp = ts.distributed.get_group_size()
    if tp == 1:  # the slices expected_slice cuts are for tp = 2
        error = max(((mine[n] - p.detach()).abs().max() / p.detach().abs().max()).item()
                    for n, p in reference.named_parameters())
    else:
        error = relative_error(mine, reference)
    record(f"FSDP x TP at 4 ranks -> DDP x TP {dist.get_world_size() // tp} x {tp}, from {what}", error)
    assert error <= 1e-9, f"{what}: {error:.3g} from the unsharded run after resuming"


def case_resume_from_save_sharded():
    _continue_from(lambda m, o: ts.load_sharded(m, _path("sharded"), optimizer=o), "save_sharded")


def case_resume_from_dcp():
    # DCP keys are the names of the model it is given: the checkpoint of the
    # (unprefixed) fully_shard-ed model loads into the module inside DDP.
    _continue_from(lambda m, o: ts.checkpoint.load_dcp(m.module, _path("dcp"), optimizer=o), "DCP")


def case_resume_from_collected_file():
    def load(model, opt):
        full = torch.load(_path("full.pt"), weights_only=True) if dist.get_rank() == 0 else None
        model.load_state_dict(ts.relocate_state_dict(model, full and full["model"], src=0))
        opt.load_state_dict(ts.relocate_optimizer_state_dict(model, opt, full and full["optimizer"], src=0))

    _continue_from(load, "a collected file")

