"""The catalogue of bad inputs (docs/bad_inputs.md), one entry per case.

Every rank gets the same bad input, so every rank must raise (none may be left
waiting in a collective). ENTRIES maps a name to (call, exception type, message
fragments); each becomes ``case_<name>``."""
import os
import tempfile

import torch
from torch import nn

import shardtorch as ts
from tests.reference import expect_error

S = lambda: ts.distributed.get_group_size()  # noqa: E731


def _col(in_f=8, out=None, **kw):
    return ts.nn.ParallelLinear(in_f, out or 4 * S(), dim=1, **kw)


def _logits(rows=4, classes=None, dtype=torch.float64, **kw):
    """This rank's shard of column-parallel logits over `classes` (default 4 * size)."""
    classes = classes or 4 * S()
    torch.manual_seed(0)
    layer = ts.nn.ParallelLinear(3, classes, dim=1, dtype=dtype)
    return layer(torch.randn(rows, 3, dtype=dtype, **kw))


def _ce(logits, target, **kw):
    return ts.nn.ParallelCrossEntropyLoss(**kw)(logits, target)


def _linear_ce(target, **kw):
    head = _col(8, 4 * S())
    return ts.nn.ParallelLinearCrossEntropyLoss(head, **kw)(torch.randn(4, 8), target)


def _wrong_model_checkpoint():
    model = nn.Sequential(ts.nn.ParallelLinear(6, 4 * S(), dim=1))
    other = nn.Sequential(nn.Linear(6, 4 * S() + 1))  # misshapen weight
    sd = other.state_dict() if ts.distributed.get_rank() == 0 else None
    return ts.relocate_state_dict(model, sd)


def _missing_key_checkpoint():
    model = nn.Sequential(ts.nn.ParallelLinear(6, 4 * S(), dim=1))
    sd = {"0.weight": torch.zeros(4 * S(), 6)} if ts.distributed.get_rank() == 0 else None
    return ts.relocate_state_dict(model, sd)


def _load_sharded_missing_dir():
    model = nn.Sequential(ts.nn.ParallelLinear(6, 4 * S(), dim=1))
    return ts.load_sharded(model, os.path.join(tempfile.gettempdir(), "shardtorch-no-such-checkpoint"))


def _load_sharded_other_model():
    model = nn.Sequential(ts.nn.ParallelLinear(6, 4 * S(), dim=1))
    other = nn.Sequential(ts.nn.ParallelLinear(6, 4 * S(), dim=1), nn.Linear(2, 2))
    path = os.path.join(tempfile.gettempdir(), f"shardtorch-bad-inputs-{os.environ['MASTER_PORT']}")
    ts.save_sharded(other, path)
    return ts.load_sharded(model, path)


V = ValueError
R = RuntimeError
T = TypeError
I = IndexError  # noqa: E741

# name: (call, exception type, fragments)
ENTRIES = {
    # ---- ParallelLinear / shard::parallel_linear
    "linear_col_wrong_in_features": (lambda: _col()(torch.randn(2, 9)), R,
                                     ["input.size(-1) must equal in_features = 8"]),
    "linear_row_wrong_in_features": (lambda: ts.nn.ParallelLinear(8 * S(), 4, dim=0)(torch.randn(2, 8 * S() + 5)),
                                     R, ["dim=0", "input.size(-1)"]),
    # A whole input of 5 features over 2 ranks slices 3 + 2: rank 1's shard of in_features=4 is 2 too,
    # so the op alone let rank 1 enter the all-reduce while rank 0 raised.
    "linear_row_width_whose_slice_fits_one_rank": (
        lambda: ts.nn.ParallelLinear(2 * S(), 6, dim=0)(torch.randn(3, 2 * S() + 1)), R,
        ["dim=0", "in_features = 4", "got input of shape (3, 5)"]),
    "linear_input_dtype_mismatch": (lambda: _col()(torch.randn(2, 8, dtype=torch.float64)), R, ["same dtype"]),
    "linear_input_meta_vs_cpu_weight": (lambda: _col()(torch.randn(2, 8, device="meta")), R, ["same device"]),
    "linear_integer_input": (lambda: torch.ops.shard.parallel_linear(
        torch.randint(0, 3, (2, 4)), torch.randn(3, 4), None, 1, "tp"), R, ["floating point"]),
    "linear_scalar_input": (lambda: _col()(torch.tensor(1.0)), R, ["input"]),
    "linear_bad_dim_module": (lambda: ts.nn.ParallelLinear(4, 4, dim=2), V, ["dim must be None, 0, 1 or -1"]),
    "linear_bad_dim_op": (lambda: torch.ops.shard.parallel_linear(torch.randn(2, 4), torch.randn(3, 4), None, 2, "tp"),
                          R, ["dim must be None, 0, 1 or -1, got 2"]),
    "linear_negative_features": (lambda: ts.nn.ParallelLinear(-1, 4, dim=1), V, ["in_features", "non-negative int"]),
    "linear_unknown_group": (lambda: torch.ops.shard.parallel_linear(torch.randn(2, 4), torch.randn(3, 4), None, 1, "nope"),
                             R, ["unknown group 'nope'", "'tp'"]),
    "linear_bias_wrong_size": (lambda: torch.ops.shard.parallel_linear(
        torch.randn(2, 4), torch.randn(3, 4), torch.randn(2), 1, "tp"), R, ["bias must be 1-D of size weight.size(0) = 3"]),
    "linear_weight_1d": (lambda: torch.ops.shard.parallel_linear(torch.randn(2, 4), torch.randn(4), None, 1, "tp"),
                         R, ["weight"]),
    "linear_row_marked_input_wrong_shard": (
        lambda: ts.nn.ParallelLinear(8 * S() + 7, 2, dim=0)(ts.utils.register_parallel_dim(torch.randn(2, 3), -1)),
        V, ["marked as sharded"]),
    # ---- mappings
    "gather_full_size_too_large": (lambda: ts.distributed.gather(torch.randn(2, 3), -1, full_size=5 * S() + 100),
                                   R, ["full_size"]),
    "scatter_dim_out_of_range": (lambda: ts.distributed.scatter(torch.randn(2, 3), 5), R, ["dim must be in"]),
    "gather_dim_out_of_range": (lambda: ts.distributed.gather(torch.randn(2, 3), -3), R, ["dim must be in"]),
    "reduce_unknown_group": (lambda: ts.distributed.reduce(torch.randn(2), group="nope"), R, ["unknown group 'nope'"]),
    "get_group_unknown": (lambda: ts.distributed.get_group("nope"), V, ["unknown group 'nope'"]),
    "register_group_reserved_name": (lambda: ts.distributed.register_group("tp", ts.distributed.get_group("world")),
                                     V, ["'tp' is reserved"]),
    "init_group_size_zero": (lambda: ts.distributed.init_process_group(group_size=0), V,
                             ["group_size must be a positive int, got 0"]),
    "init_timeout_not_timedelta": (lambda: ts.distributed.init_process_group(group_size=S(), timeout=30), T,
                                   ["timeout must be a datetime.timedelta"]),
    # ---- ParallelCrossEntropyLoss
    "ce_reduction_avg": (lambda: ts.nn.ParallelCrossEntropyLoss(reduction="avg"), V,
                         ["reduction must be 'none', 'mean' or 'sum', got 'avg'"]),
    "ce_functional_reduction_avg": (lambda: ts.nn.functional.parallel_cross_entropy(
        _logits(), torch.zeros(4, dtype=torch.long), reduction="avg"), V, ["reduction", "'avg'"]),
    "ce_label_smoothing_above_1": (lambda: ts.nn.ParallelCrossEntropyLoss(label_smoothing=1.5), V,
                                   ["label_smoothing must be in [0, 1]", "1.5"]),
    "ce_label_smoothing_negative": (lambda: ts.nn.ParallelCrossEntropyLoss(label_smoothing=-0.1), V,
                                    ["label_smoothing must be in [0, 1]"]),
    "ce_functional_label_smoothing_above_1": (lambda: ts.nn.functional.parallel_cross_entropy(
        _logits(), torch.zeros(4, dtype=torch.long), label_smoothing=1.5), R, ["label_smoothing"]),
    "ce_z_loss_negative": (lambda: ts.nn.ParallelCrossEntropyLoss(z_loss=-1.0), V, ["z_loss must be >= 0"]),
    "ce_target_equals_num_classes": (lambda: _ce(_logits(), torch.full((4,), 4 * S(), dtype=torch.long)), R,
                                     ["target"]),
    "ce_target_negative_not_ignored": (lambda: _ce(_logits(), torch.full((4,), -5, dtype=torch.long)), R,
                                       ["target"]),
    "ce_target_wrong_rows": (lambda: _ce(_logits(rows=4), torch.zeros(5, dtype=torch.long)), R, ["target"]),
    "ce_target_float": (lambda: _ce(_logits(), torch.zeros(4)), R, ["target"]),
    "ce_class_weight_wrong_size": (lambda: _ce(_logits(), torch.zeros(4, dtype=torch.long),
                                               weight=torch.ones(4 * S() + 3, dtype=torch.float64)), R, ["weight"]),
    "ce_logits_meta_target_cpu": (lambda: ts.nn.functional.parallel_cross_entropy(
        torch.randn(4, 4, device="meta"), torch.zeros(4, dtype=torch.long), parallel=True), R, ["device"]),
    "ce_integer_logits": (lambda: ts.nn.functional.parallel_cross_entropy(
        torch.zeros(4, 4, dtype=torch.long), torch.zeros(4, dtype=torch.long), parallel=True), R, ["floating point"]),
    "ce_unknown_group": (lambda: ts.nn.functional.parallel_cross_entropy(
        torch.randn(4, 4), torch.zeros(4, dtype=torch.long), parallel=True, group="nope"), R, ["unknown group 'nope'"]),
    "ce_num_classes_wrong": (lambda: ts.nn.functional.parallel_cross_entropy(
        _logits(), torch.zeros(4, dtype=torch.long), num_classes=4 * S() + 1), R, ["shard of"]),
    "ce_scalar_logits": (lambda: ts.nn.functional.parallel_cross_entropy(
        torch.tensor(1.0), torch.tensor(0), parallel=True), R, ["logits must be [*, local_classes] (at least 1-D)"]),
    # ---- ParallelLinearCrossEntropyLoss
    "linear_ce_chunk_size_zero": (lambda: ts.nn.ParallelLinearCrossEntropyLoss(_col(), chunk_size=0), V,
                                  ["chunk_size must be a positive int, got 0"]),
    "linear_ce_chunk_size_negative": (lambda: ts.nn.ParallelLinearCrossEntropyLoss(_col(), chunk_size=-3), V,
                                      ["chunk_size must be a positive int"]),
    "linear_ce_functional_chunk_size_zero": (lambda: ts.nn.functional.parallel_linear_cross_entropy(
        torch.randn(4, 8), _col().weight, None, torch.zeros(4, dtype=torch.long), chunk_size=0), R, ["chunk_size"]),
    "linear_ce_row_parallel_head": (lambda: ts.nn.ParallelLinearCrossEntropyLoss(ts.nn.ParallelLinear(8, 4, dim=0)),
                                    V, ["linear must be a column-parallel"]),
    "linear_ce_reduction_avg": (lambda: ts.nn.ParallelLinearCrossEntropyLoss(_col(), reduction="avg"), V,
                                ["reduction", "'avg'"]),
    "linear_ce_target_out_of_range": (lambda: _linear_ce(torch.full((4,), 4 * S(), dtype=torch.long)), R, ["target"]),
    "linear_ce_input_wrong_features": (lambda: ts.nn.ParallelLinearCrossEntropyLoss(_col())(
        torch.randn(4, 9), torch.zeros(4, dtype=torch.long)), R, ["in"]),
    "linear_ce_label_smoothing_above_1": (lambda: _linear_ce(torch.zeros(4, dtype=torch.long), label_smoothing=2.0),
                                          (V, R), ["label_smoothing"]),
    # ---- ParallelEmbedding
    "embedding_bad_dim": (lambda: ts.nn.ParallelEmbedding(10, 4, dim=2), V, ["dim must be 0"]),
    "embedding_padding_idx_out_of_range": (lambda: ts.nn.ParallelEmbedding(10, 4, padding_idx=10, dim=0), V,
                                           ["padding_idx must be within num_embeddings"]),
    "embedding_index_out_of_range": (lambda: ts.nn.ParallelEmbedding(10, 4, dim=0)(torch.tensor([3, 10])), I,
                                     ["indices must be in [0, num_embeddings"]),
    "embedding_float_indices": (lambda: ts.nn.ParallelEmbedding(10, 4, dim=0)(torch.tensor([1.0, 2.0])), R,
                                ["input must hold indices (int64 or int32)"]),
    # ---- checkpoints, DDP, sampler
    "relocate_misshapen_checkpoint": (_wrong_model_checkpoint, R, ["0.weight"]),
    "relocate_missing_key": (_missing_key_checkpoint, R, ["0.bias"]),
    "relocate_src_out_of_range": (lambda: ts.relocate_state_dict(nn.Linear(2, 2), None, src=99), V,
                                  ["src must be a global rank"]),
    "collect_dst_out_of_range": (lambda: ts.collect_state_dict(nn.Linear(2, 2), nn.Linear(2, 2).state_dict(), dst=99),
                                 V, ["dst must be None or a global rank"]),
    "load_sharded_missing_directory": (_load_sharded_missing_dir, R, ["shardtorch-no-such-checkpoint"]),
    "load_sharded_other_model": (_load_sharded_other_model, R, ["1.weight"]),
    "ddp_bad_layout": (lambda: ts.nn.parallel.DistributedDataParallel(nn.Linear(2, 2), layout="3d"), V,
                       ["layout must be one of"]),
    "sampler_bad_rank": (lambda: ts.utils.data.DistributedGroupSampler(list(range(8)), num_replicas=2, rank=5), V,
                         ["rank must be in [0, num_replicas=2)"]),
    # Fixed after the catalogue found them (were known gaps G1-G3):
    "ce_class_weight_meta_vs_cpu_logits": (
        lambda: _ce(_logits(), torch.zeros(4, dtype=torch.long),
                    weight=torch.ones(4 * S(), dtype=torch.float64, device="meta")), R, ["weight", "device"]),
    "linear_integer_dtype": (lambda: ts.nn.ParallelLinear(4, 4 * S(), dim=1, dtype=torch.long),
                             V, ["ParallelLinear", "dtype"]),
    "ce_label_smoothing_not_a_number": (lambda: ts.nn.ParallelCrossEntropyLoss(label_smoothing="0.1"),
                                        T, ["label_smoothing"]),
}

# Was known gap G4, fixed: collect_state_dict checks the state dict against the model on
# every rank before any tensor moves.
def _collect_misshapen():
    model = nn.Sequential(ts.nn.ParallelLinear(6, 4 * S(), dim=1))
    # Every rank's shard of 0.weight has one row too many: the gathered tensor would
    # no longer have the model's shape.
    sd = {"0.weight": torch.zeros(4 + 1, 6), "0.bias": torch.zeros(4)}
    return ts.collect_state_dict(model, sd)


ENTRIES["collect_misshapen_state_dict"] = (_collect_misshapen, R, ["0.weight", "does not match the model"])


def _make(name):
    call, exception, fragments = ENTRIES[name]

    def case():
        expect_error(call, *fragments, exception=exception)
    case.__name__ = "case_" + name
    return case


for _name in ENTRIES:
    globals()["case_" + _name] = _make(_name)
