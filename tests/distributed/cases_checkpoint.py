"""collect/relocate and sharded checkpoints across launches of different sizes.

The pytest side (test_checkpoint.py) runs launches in order, passing a shared
directory in SHARDTORCH_CKPT_DIR: a launch at one tensor-parallel size saves
checkpoints that later launches at other sizes load. Each launch runs only the
cases its phase names."""
import os

import torch
import torch.distributed as dist
from torch import nn

import shardtorch as ts
from shardtorch.checkpoint import sharded_format
from tests.distributed.checkpoint_models import assert_state_equal, build, die_after_writing_shard_file
from tests.reference import expect_error

SAVED_SEED, FRESH_SEED = 11, 22


def _dir(*parts):
    return os.path.join(os.environ["SHARDTORCH_CKPT_DIR"], *parts)


def _size():
    return ts.distributed.get_group_size()


def _check_model_is_saved_one(model, what):
    """model holds the weights of the SAVED_SEED reference (compared via collect)."""
    full = ts.collect_state_dict(model, model.state_dict())
    assert_state_equal(full, build(False, SAVED_SEED).state_dict(), what)


# ------------------------------------------------------------------ any size
def case_collect_equals_unsharded_reference():
    model, ref = build(True, SAVED_SEED), build(False, SAVED_SEED)
    full = ts.collect_state_dict(model, model.state_dict())
    assert_state_equal(full, ref.state_dict(), f"collect at size {_size()}")
    plain = build(False, FRESH_SEED)
    plain.load_state_dict(full)  # loadable into the plain torch model
    assert_state_equal(plain.state_dict(), ref.state_dict(), "plain model loaded from collect")
    # Only dst receives; every other rank gets None and holds no full tensor.
    for dst in range(dist.get_world_size()):
        only = ts.collect_state_dict(model, model.state_dict(), dst=dst)
        if dist.get_rank() == dst:
            assert_state_equal(only, ref.state_dict(), f"collect to dst={dst}")
        else:
            assert only is None, f"rank {dist.get_rank()} got a state dict for dst={dst}"
    # Outputs agree with the reference too (the layers are wired as documented).
    tokens = torch.randint(0, 13, (2, 4))
    model.eval(), ref.eval()
    torch.testing.assert_close(model(tokens), ref(tokens))


def case_relocate_round_trip_and_from_plain():
    model = build(True, FRESH_SEED)
    ref = build(False, SAVED_SEED)
    for src in range(dist.get_world_size()):
        plain = ref.state_dict() if dist.get_rank() == src else None
        model.load_state_dict(ts.relocate_state_dict(model, plain, src=src))
        _check_model_is_saved_one(model, f"relocate from plain model, src={src}")


def case_ddp_wrapped_and_prefix_matching():
    model = build(True, FRESH_SEED)
    ddp = nn.parallel.DistributedDataParallel(model, process_group=ts.distributed.get_data_parallel_group())
    ref = build(False, SAVED_SEED)
    plain = ref.state_dict() if dist.get_rank() == 0 else None  # no "module." prefix
    ddp.load_state_dict(ts.relocate_state_dict(ddp, plain))
    full = ts.collect_state_dict(ddp, ddp.state_dict())
    assert all(k.startswith("module.") for k in full)
    assert_state_equal({k[len("module."):]: v for k, v in full.items()}, ref.state_dict(), "DDP collect")
    # A DDP checkpoint loads into an unwrapped model too.
    bare = build(True, FRESH_SEED)
    bare.load_state_dict(ts.relocate_state_dict(bare, full if dist.get_rank() == 0 else None))
    _check_model_is_saved_one(bare, "DDP checkpoint into unwrapped model")


def case_wrong_checkpoint_names_the_key_on_every_rank():
    model = build(True, FRESH_SEED)
    good = build(False, SAVED_SEED).state_dict()
    src = dist.get_world_size() - 1
    on_src = lambda sd: sd if dist.get_rank() == src else None  # noqa: E731

    missing = dict(good)
    del missing["block.up.bias"]
    expect_error(lambda: ts.relocate_state_dict(model, on_src(missing), src=src),
                 "missing key 'block.up.bias'", "(11,)")
    unexpected = dict(good, extra=torch.zeros(3))
    expect_error(lambda: ts.relocate_state_dict(model, on_src(unexpected), src=src), "unexpected key 'extra'")
    wrong = dict(good)
    wrong["block.down.weight"] = torch.zeros(7, 12)
    expect_error(lambda: ts.relocate_state_dict(model, on_src(wrong), src=src),
                 "'block.down.weight' has shape (7, 12)", "expects (7, 11)", "dim 1")
    expect_error(lambda: ts.relocate_state_dict(model, None, src=src), "must pass the checkpoint")
    expect_error(lambda: ts.relocate_state_dict(model, good, src=99), "src must be a global rank")
    expect_error(lambda: ts.collect_state_dict(model, model.state_dict(), dst=-1), "dst must be None")
    # After the errors every rank is still in step: a good relocation works.
    model.load_state_dict(ts.relocate_state_dict(model, on_src(good), src=src))
    _check_model_is_saved_one(model, "relocate after errors")


# ------------------------------------------------------------------ saving
def _save_all(tag):
    model = build(True, SAVED_SEED)
    full = ts.collect_state_dict(model, model.state_dict(), dst=0)
    if dist.get_rank() == 0:
        torch.save(full, _dir(f"full-{tag}.pt"))
    ts.save_sharded(model, _dir(f"sharded-{tag}"))


def case_save_size1():
    _save_all("1")
    if dist.get_rank() == 0:
        torch.save(build(False, SAVED_SEED).state_dict(), _dir("plain.pt"))


def case_save_size2():
    _save_all("2")


def case_save_size4():
    _save_all("4")


def case_save_2d():
    _save_all("2d")


# ------------------------------------------------------------------ loading
def _load_all(tag):
    model = build(True, FRESH_SEED)
    state_dict = torch.load(_dir(f"full-{tag}.pt")) if ts.distributed.get_rank() == 0 else None
    model.load_state_dict(ts.relocate_state_dict(model, state_dict))
    _check_model_is_saved_one(model, f"relocate from size {tag} at size {_size()}")
    model = build(True, FRESH_SEED)
    ts.load_sharded(model, _dir(f"sharded-{tag}"))
    _check_model_is_saved_one(model, f"load_sharded from size {tag} at size {_size()}")


def case_load_size1():
    _load_all("1")


def case_load_size2():
    _load_all("2")


def case_load_size4():
    _load_all("4")


def case_load_2d():
    _load_all("2d")


def case_load_plain():
    model = build(True, FRESH_SEED)
    state_dict = torch.load(_dir("plain.pt")) if ts.distributed.get_rank() == 0 else None
    model.load_state_dict(ts.relocate_state_dict(model, state_dict))
    _check_model_is_saved_one(model, "relocate from the plain model's checkpoint")


# ------------------------------------------------------------------ sharded robustness
def case_sharded_failed_save_keeps_previous():
    path = _dir(f"robust-{dist.get_world_size()}")
    ts.save_sharded(build(True, SAVED_SEED), path)  # the previous, good checkpoint
    writer = sharded_format.write_atomically
    failing_rank = ts.distributed.get_group_size() - 1  # a rank of the first group, which writes

    def dies_after_writing(target, write):
        writer(target, write)  # this rank's file is complete on disk ...
        if dist.get_rank() == failing_rank:
            raise OSError("No space left on device (simulated)")  # ... then the rank fails

    sharded_format.write_atomically = dies_after_writing
    try:
        expect_error(lambda: ts.save_sharded(build(True, FRESH_SEED), path),
                     "not committed", f"rank {failing_rank} failed", "No space left")
    finally:
        sharded_format.write_atomically = writer
    model = build(True, FRESH_SEED)
    ts.load_sharded(model, path)
    _check_model_is_saved_one(model, "previous checkpoint after a failed save")
    dist.barrier()
    # A later good save replaces it and removes the old version.
    ts.save_sharded(build(True, FRESH_SEED), path)
    dist.barrier()
    versions = [n for n in os.listdir(path) if n.startswith("version-")]
    assert len(versions) == 1, versions
    model = build(True, SAVED_SEED)
    ts.load_sharded(model, path)
    assert_state_equal(ts.collect_state_dict(model, model.state_dict()),
                       build(False, FRESH_SEED).state_dict(), "second save")


def case_sharded_corrupt_checkpoints_are_named():
    world, rank = dist.get_world_size(), dist.get_rank()
    base = _dir(f"corrupt-{world}")
    model = build(True, SAVED_SEED)
    for name in ("missing", "truncated", "model"):
        ts.save_sharded(model, os.path.join(base, name))
    dist.barrier()
    if rank == 0:
        def version_dir(name):
            return sharded_format.committed_version(os.path.join(base, name))
        os.remove(os.path.join(version_dir("missing"), sharded_format.rank_file_name(world - 1)))
        truncated = os.path.join(version_dir("truncated"), sharded_format.rank_file_name(0))
        with open(truncated, "r+b") as f:
            f.truncate(os.path.getsize(truncated) // 2)
        os.makedirs(os.path.join(base, "uncommitted", "version-0"), exist_ok=True)
    dist.barrier()
    fresh = build(True, FRESH_SEED)
    expect_error(lambda: ts.load_sharded(fresh, os.path.join(base, "missing")),
                 sharded_format.rank_file_name(world - 1), "is missing")
    expect_error(lambda: ts.load_sharded(fresh, os.path.join(base, "truncated")),
                 sharded_format.rank_file_name(0), "truncated")
    expect_error(lambda: ts.load_sharded(fresh, os.path.join(base, "uncommitted")),
                 "no committed checkpoint", "LATEST")
    expect_error(lambda: ts.load_sharded(fresh, os.path.join(base, "uncommitted", "version-0")),
                 "index.json", "incomplete save")
    expect_error(lambda: ts.load_sharded(fresh, os.path.join(base, "nowhere")), "no checkpoint directory")
    other = nn.Sequential(ts.nn.ParallelLinear(6, 11, dim=1))
    expect_error(lambda: ts.load_sharded(other, os.path.join(base, "model")),
                 "missing key '0.weight'", "unexpected key 'tokens.weight'")
    bigger = build(True, FRESH_SEED)
    bigger.head = ts.nn.ParallelLinear(7, 9, bias=False, dim=1)
    expect_error(lambda: ts.load_sharded(bigger, os.path.join(base, "model")),
                 "'head.weight' has shape (7, 7)", "expects (9, 7)")


# ------------------------------------------------------------------ a save killed midway
def case_save_then_die_midway():
    """Saves a good checkpoint, then starts another and dies (os._exit, no
    cleanup, no exception handling) right after writing its shard file."""
    path = _dir("killed")
    ts.save_sharded(build(True, SAVED_SEED), path)
    die_after_writing_shard_file()
    ts.save_sharded(build(True, FRESH_SEED), path)


def case_load_after_killed_save():
    path = _dir("killed")
    model = build(True, FRESH_SEED)
    ts.load_sharded(model, path)
    _check_model_is_saved_one(model, "the checkpoint before the killed save")
    committed = os.path.basename(sharded_format.committed_version(path))
    partial = [n for n in os.listdir(path) if n.startswith("version-") and n != committed]
    assert len(partial) == 1, os.listdir(path)
    expect_error(lambda: ts.load_sharded(model, os.path.join(path, partial[0])),
                 "has no index.json", "incomplete save")


# ------------------------------------------------------------------ torch.distributed.checkpoint
def case_save_dcp():
    ts.checkpoint.save_dcp(build(True, SAVED_SEED), _dir(f"dcp-{_tag()}"))


def _tag():
    world, size = dist.get_world_size(), _size()
    return str(size) if world == size else f"{world}x{size}"


def _load_dcp(tag):
    model = build(True, FRESH_SEED)
    ts.checkpoint.load_dcp(model, _dir(f"dcp-{tag}"))
    _check_model_is_saved_one(model, f"DCP checkpoint of size {tag} at size {_tag()}")


def case_load_dcp_2():
    _load_dcp("2")


def case_load_dcp_4x2():
    _load_dcp("4x2")


def case_dcp_to_torch_save_gives_the_unsharded_state_dict():
    if dist.get_rank() == 0:
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
        dcp_to_torch_save(_dir("dcp-4x2"), _dir("from-dcp.pt"))
        plain = build(False, FRESH_SEED)
        plain.load_state_dict(torch.load(_dir("from-dcp.pt")))
        assert_state_equal(plain.state_dict(), build(False, SAVED_SEED).state_dict(), "dcp_to_torch_save")


def case_dcp_with_empty_shards():
    size = _size()
    if size < 2:
        return
    torch.manual_seed(0)
    saved = nn.Sequential(ts.nn.ParallelLinear(3, size - 1, dim=1))  # the last rank holds nothing
    ts.checkpoint.save_dcp(saved, _dir(f"dcp-empty-{size}"))
    loaded = nn.Sequential(ts.nn.ParallelLinear(3, size - 1, dim=1))
    with torch.no_grad():
        for p in loaded.parameters():
            p.zero_()
    ts.checkpoint.load_dcp(loaded, _dir(f"dcp-empty-{size}"))
    for a, b in zip(saved.parameters(), loaded.parameters()):
        assert torch.equal(a, b)
