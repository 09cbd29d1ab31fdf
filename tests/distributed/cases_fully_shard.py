"""FSDP2 (torch's fully_shard) x tensor parallel at world 4 = 2 x 2, on Gloo/CPU.

Training: ts.nn.parallel.fully_shard in both layouts against single-process
unsharded training on the global batch (every rank builds the reference from
the same seed and compares its slice of every parameter, gathered over the
data-parallel mesh). Checkpoints: every function that reads the shard facts
(collect/relocate, save_sharded/load_sharded, DCP, optimizer state, the DDP
wrapper, converters, the fused loss) on fully_shard-ed models, against the
unsharded reference or the run that was not interrupted; a ParallelMarginLoss
head (cases_margin_fully_shard.py). One launch runs
all cases (test_fully_shard.py); ``case_hand_off_to_two_ranks`` also leaves a
checkpoint in the session's scratch folder (HANDOFF_DIR) that the 2-rank
launches (cases_fully_shard_resume.py) load under DDP x TP.
"""
import copy
import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

import shardtorch as ts
from tests.distributed import checkpoint_models
from tests.distributed.cases_margin_fully_shard import (  # noqa: F401  (run in this launch)
    case_margin_loss_head_trains_like_the_unsharded_model, case_margin_loss_sampling_under_fully_shard_is_refused)
from tests.distributed.cases_data_parallel import IN_FEATURES, NUM_CLASSES, Net, _local_batch, _make_optimizer
from tests.reference import expect_error, split_range

# In the session's scratch folder (harness.scratch_dir): the error report test_fully_shard.py
# prints, and the checkpoint case_hand_off_to_two_ranks leaves for cases_fully_shard_resume.py.
REPORT_FILE, HANDOFF_DIR = "fully-shard-errors.txt", "fully-shard-handoff"
BATCH = 16  # global batch, the same at every world size (the 2-rank resume reads it too)
#: Which dimension of each parameter the head splits over "tp" (the unsharded
#: model's names): column-parallel up/classifier split their rows, the
#: row-parallel down its columns; its bias is whole. Written out, not read
#: from the layers, so the comparison does not trust what it tests.
SHARD_DIMS = {"head.up.weight": 0, "head.up.bias": 0, "head.down.weight": 1,
              "head.classifier.weight": 0, "head.classifier.bias": 0}


class FusedNet(Net):
    """Net returning the features before its classifier, for the fused loss."""

    def forward(self, x):
        h = self.backbone(x)
        if self.gather_batch:
            h = ts.distributed.gather(h, dim=0)
        head = self.head
        return h + head.down(torch.relu(head.up(h)))


def global_batch(step: int, dtype=torch.float64):
    generator = torch.Generator().manual_seed(500 + step)
    x = torch.randn(BATCH, IN_FEATURES, generator=generator, dtype=torch.float64).to(dtype)
    return x, torch.randint(0, NUM_CLASSES, (BATCH,), generator=generator)


def build(parallel: bool, dtype=torch.float64, seed: int = 1234, cls=Net, **kwargs) -> nn.Module:
    torch.manual_seed(seed)  # ParallelLinear draws nn.Linear's numbers and slices them
    return cls(parallel, **kwargs).to(dtype)


def fsdp_model(layout: str, dtype=torch.float64, seed: int = 1234, cls=Net, checkpoint_head=False, **fsdp_kwargs):
    model = build(True, dtype, seed, cls, gather_batch=(layout == "hybrid"), checkpoint_head=checkpoint_head)
    return ts.nn.parallel.fully_shard(model, layout=layout, **fsdp_kwargs)


def reference_step(reference, optimizer, step: int, dtype=torch.float64):
    x, y = global_batch(step, dtype)
    optimizer.zero_grad()
    F.cross_entropy(reference(x), y).backward()
    optimizer.step()


def sharded_step(model, optimizer, layout: str, step: int, dtype=torch.float64, fused: bool = False):
    x, y = _local_batch(layout, *global_batch(step, dtype), step)
    if layout == "hybrid":  # the targets of the gathered batch
        y = ts.distributed.gather(y, dim=0)
    optimizer.zero_grad()
    if fused:
        loss = ts.nn.ParallelLinearCrossEntropyLoss(model.head.classifier)(model(x), y)
    else:
        # parallel=None: the loss finds out from the head's output mark.
        loss = ts.nn.ParallelCrossEntropyLoss()(model(x), y)
    loss.backward()
    optimizer.step()


def tp_local(model) -> dict:
    """{name: the parameter as the rank would hold it without fully_shard}
    (a DTensor gathered over its mesh: collective)."""
    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for name, p in model.named_parameters()}


def expected_slice(name: str, full: torch.Tensor) -> torch.Tensor:
    if name not in SHARD_DIMS:
        return full
    dim = SHARD_DIMS[name]
    lo, hi = split_range(full.shape[dim], 2, dist.get_rank() % 2)  # tp groups {0,1} {2,3}
    return full.narrow(dim, lo, hi - lo)


def relative_error(actual: dict, reference: nn.Module, initial=None) -> float:
    """Largest over parameters of max|p - p_ref| / max|p_ref| (with
    ``initial`` = (actual's, reference's) starting values: of the updates)."""
    worst = 0.0
    for name, p_ref in reference.named_parameters():
        expected, got = expected_slice(name, p_ref.detach()), actual[name]
        if initial is not None:
            got, expected = got - initial[0][name], expected - expected_slice(name, initial[1][name])
        assert got.shape == expected.shape, (name, got.shape, expected.shape)
        scale = expected.double().abs().max().clamp_min(1e-30)
        worst = max(worst, ((got.double() - expected.double()).abs().max() / scale).item())
    return worst


def train_and_compare(layout, optimizer, steps=4, dtype=torch.float64, fused=False, checkpoint_head=False,
                      mp_policy=None, reshard_after_forward=True, tolerance=1e-9, what=""):
    reference = build(False, dtype)
    opt_ref = _make_optimizer(optimizer, reference.parameters())
    kwargs = {"reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    model = fsdp_model(layout, dtype, cls=FusedNet if fused else Net, checkpoint_head=checkpoint_head, **kwargs)
    assert all(isinstance(p, DTensor) for p in model.parameters()), "fully_shard left a parameter plain"
    opt = _make_optimizer(optimizer, model.parameters())
    initial = (tp_local(model), {n: p.detach().clone() for n, p in reference.named_parameters()})
    for step in range(steps):
        reference_step(reference, opt_ref, step, dtype)
        sharded_step(model, opt, layout, step, dtype, fused)
    error = relative_error(tp_local(model), reference, initial if mp_policy is not None else None)
    record(f"{layout} {optimizer} {what}".strip(), error)
    assert error <= tolerance, f"{layout} {optimizer} {what}: largest relative parameter error {error:.3g}"


def record(what: str, error: float) -> None:
    scratch = os.environ.get("SHARDTORCH_TEST_SCRATCH")
    if scratch and dist.get_rank() == 0:
        with open(os.path.join(scratch, REPORT_FILE), "a") as f:
            f.write(f"{what}\t{error:.3e}\n")


def shared_directory() -> str:
    box = [tempfile.mkdtemp(prefix="fsdp-ckpt-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# ------------------------------------------------------------------ training, both layouts
def case_2d_sgd_momentum():
    train_and_compare("2d", "sgd")


def case_2d_adam():
    train_and_compare("2d", "adam")


def case_hybrid_sgd_momentum():
    train_and_compare("hybrid", "sgd")


def case_hybrid_adam():
    train_and_compare("hybrid", "adam")


def case_activation_checkpointing_and_reshard_after_forward():
    for layout in ("2d", "hybrid"):
        for reshard in (True, False):
            train_and_compare(layout, "sgd", steps=3, checkpoint_head=True, reshard_after_forward=reshard,
                              what=f"checkpointed head, reshard_after_forward={reshard}")


def case_fused_loss():
    for layout in ("2d", "hybrid"):
        train_and_compare(layout, "adam", steps=3, fused=True, what="fused linear cross-entropy")


def bfloat16_compute_updates(steps: int) -> float:
    """How far bfloat16 computation itself moves the updates of unsharded
    training from float32's (the tolerance of the mixed-precision run): float32
    master parameters, each step's forward and backward on a bfloat16 copy,
    the gradients applied in float32, as MixedPrecisionPolicy(param_dtype=bfloat16) does."""
    master, exact = build(False, torch.float32), build(False, torch.float32)
    opt, opt_exact = _make_optimizer("sgd", master.parameters()), _make_optimizer("sgd", exact.parameters())
    initial = {n: p.detach().clone() for n, p in master.named_parameters()}
    for step in range(steps):
        reference_step(exact, opt_exact, step, torch.float32)
        x, y = global_batch(step, torch.float32)
        compute = copy.deepcopy(master).to(torch.bfloat16)
        F.cross_entropy(compute(x.to(torch.bfloat16)), y).backward()
        for p, c in zip(master.parameters(), compute.parameters()):
            p.grad = c.grad.float()
        opt.step()
    worst = 0.0
    for (name, p), q in zip(master.named_parameters(), exact.parameters()):
        update, expected = p.detach() - initial[name], q.detach() - initial[name]
        worst = max(worst, ((update - expected).abs().max() / expected.abs().max()).item())
    return worst


def case_mixed_precision_bfloat16_within_bfloat16_of_float32():
    # Parameters held in float32, computed in bfloat16, gradients reduced in
    # float32: the updates are as close to float32 unsharded training as
    # bfloat16 computation of the unsharded model is (twice its deviation).
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    floor = bfloat16_compute_updates(3)
    record("unsharded, bfloat16 compute, updates vs float32", floor)
    for layout in ("2d", "hybrid"):
        train_and_compare(layout, "sgd", steps=3, dtype=torch.float32, mp_policy=policy, tolerance=2 * floor,
                          what="MixedPrecisionPolicy(bfloat16), updates vs float32")


# ------------------------------------------------------------------ the issue's scenario
def case_collect_of_the_issue_gives_full_tensors():
    """2 x 2, fully_shard over the data-parallel group on each layer and the
    root (torch's own fully_shard, as a user writes it), an (11, 8)
    column-parallel head: dst receives '1.weight' (11, 8), the unsharded one."""
    torch.manual_seed(7)
    plain = nn.Sequential(nn.Linear(5, 8), nn.Linear(8, 11)).double()
    torch.manual_seed(7)
    model = nn.Sequential(nn.Linear(5, 8), ts.nn.ParallelLinear(8, 11, dim=1)).double()
    dp = ts.distributed.device_mesh("cpu")["dp"]
    for layer in model:
        torch_fully_shard(layer, mesh=dp)
    torch_fully_shard(model, mesh=dp)
    rows = (6, 5)[dist.get_rank() % 2]  # 11 classes over 2: the tensor-parallel shard, as a DTensor
    assert isinstance(model[1].weight, DTensor) and tuple(model[1].weight.shape) == (rows, 8)
    for dst in (0, 3, None):
        full = ts.collect_state_dict(model, model.state_dict(), dst=dst)
        if dst is not None and dist.get_rank() != dst:
            assert full is None
            continue
        assert list(full) == ["0.weight", "0.bias", "1.weight", "1.bias"]
        for key, expected in plain.state_dict().items():
            assert type(full[key]) is torch.Tensor, f"{key} is a {type(full[key]).__name__}, not a plain tensor"
            assert full[key].shape == expected.shape, (key, full[key].shape)
            assert torch.equal(full[key], expected), key
        again = nn.Sequential(nn.Linear(5, 8), nn.Linear(8, 11)).double()
        again.load_state_dict(full)  # the plain torch model loads it


# ------------------------------------------------------------------ checkpoints under fully_shard
def case_collect_and_relocate_every_kind_of_entry():
    """checkpoint_models.Net (embeddings sharded on either dim, uneven
    column- and row-parallel linears, LayerNorm, BatchNorm buffers) under
    fully_shard: collect equals the unsharded model; relocating the unsharded
    model's state into a fresh one restores it, its forward included."""
    reference = checkpoint_models.build(False, 11)
    model = ts.nn.parallel.fully_shard(checkpoint_models.build(True, 11))
    full = ts.collect_state_dict(model, model.state_dict())
    checkpoint_models.assert_state_equal(full, reference.state_dict(), "collect under fully_shard")
    fresh = ts.nn.parallel.fully_shard(checkpoint_models.build(True, 22))
    for src in (0, 3):
        fresh.load_state_dict(ts.relocate_state_dict(fresh, reference.state_dict() if dist.get_rank() == src
                                                     else None, src=src))
        checkpoint_models.assert_state_equal(ts.collect_state_dict(fresh, fresh.state_dict()),
                                             reference.state_dict(), f"relocate under fully_shard, src={src}")
    tokens = torch.randint(0, checkpoint_models.VOCAB, (2, 4), generator=torch.Generator().manual_seed(3))
    fresh.eval(), reference.eval()
    torch.testing.assert_close(fresh(tokens), reference(tokens), rtol=0, atol=1e-6)


def _trained_with_adam(layout):
    """(unsharded reference, its Adam, the fully_shard-ed model, its Adam) after 2 steps."""
    reference = build(False)
    opt_ref = _make_optimizer("adam", reference.parameters())
    model = fsdp_model(layout)
    opt = _make_optimizer("adam", model.parameters())
    for step in range(2):
        reference_step(reference, opt_ref, step)
        sharded_step(model, opt, layout, step)
    return reference, opt_ref, model, opt


def _continue_equal(layout, make_checkpoint, load, what):
    """Trains 2 steps (Adam), checkpoints, loads into a model built from
    another seed, continues 2 steps beside the original: the same parameters,
    and the unsharded run's within 1e-9."""
    reference, opt_ref, model, opt = _trained_with_adam(layout)
    handle = make_checkpoint(model, opt)
    fresh = fsdp_model(layout, seed=999)
    fresh_opt = _make_optimizer("adam", fresh.parameters())
    load(fresh, fresh_opt, handle)
    assert all(isinstance(p, DTensor) for p in fresh.parameters())
    for state in fresh_opt.state.values():
        assert isinstance(state["exp_avg"], DTensor), "loaded optimizer state is not a DTensor like its parameter"
    for step in range(2, 4):
        reference_step(reference, opt_ref, step)
        sharded_step(model, opt, layout, step)
        sharded_step(fresh, fresh_opt, layout, step)
    original, resumed = tp_local(model), tp_local(fresh)
    for name in original:
        assert torch.equal(original[name], resumed[name]), \
            f"{what} {layout}: {name} differs after resuming by {(original[name] - resumed[name]).abs().max():.3g}"
    error = relative_error(resumed, reference)
    record(f"{layout} adam resumed from {what}", error)
    assert error <= 1e-9, f"{what} {layout}: {error:.3g} from the unsharded run"


def case_save_sharded_and_load_sharded_with_optimizer():
    for layout in ("2d", "hybrid"):
        path = shared_directory()
        _continue_equal(layout, lambda m, o: ts.save_sharded(m, path, optimizer=o),
                        lambda m, o, _: ts.load_sharded(m, path, optimizer=o), "save_sharded")


def case_dcp_with_optimizer():
    for layout in ("2d", "hybrid"):
        path = os.path.join(shared_directory(), "dcp")
        _continue_equal(layout, lambda m, o: ts.checkpoint.save_dcp(m, path, optimizer=o),
                        lambda m, o, _: ts.checkpoint.load_dcp(m, path, optimizer=o), "DCP")


def case_collect_and_relocate_optimizer_state():
    def collect(model, opt):
        return (ts.collect_state_dict(model, model.state_dict(), dst=0),
                ts.collect_optimizer_state_dict(model, opt, dst=0))

    def relocate(model, opt, collected):
        model.load_state_dict(ts.relocate_state_dict(model, collected[0], src=0))
        opt.load_state_dict(ts.relocate_optimizer_state_dict(model, opt, collected[1], src=0))

    for layout in ("2d", "hybrid"):
        _continue_equal(layout, collect, relocate, "collect/relocate")


def case_collected_optimizer_state_loads_into_plain_torch():
    """The collected state is the unsharded optimizer's: a single-process
    model and torch.optim.Adam loaded from it continue like the unsharded run."""
    for layout in ("2d", "hybrid"):
        reference, opt_ref, model, opt = _trained_with_adam(layout)
        weights = ts.collect_state_dict(model, model.state_dict(), dst=1)
        state = ts.collect_optimizer_state_dict(model, opt, dst=1)
        if dist.get_rank() != 1:
            assert weights is None and state is None
            continue
        expected = opt_ref.state_dict()
        for index, values in expected["state"].items():
            for key, value in values.items():
                assert type(state["state"][index][key]) is torch.Tensor, (index, key)
                torch.testing.assert_close(state["state"][index][key], value, rtol=1e-9, atol=1e-12)
        plain = build(False, seed=999)
        plain.load_state_dict(weights)
        plain_opt = _make_optimizer("adam", plain.parameters())
        plain_opt.load_state_dict(state)
        for step in range(2, 4):
            reference_step(reference, opt_ref, step)
            reference_step(plain, plain_opt, step)
        for (name, p), q in zip(plain.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-12, msg=name)


def case_hand_off_to_two_ranks():
    """2 steps of SGD with momentum under fully_shard (2d); the checkpoint in
    three forms for cases_fully_shard_resume.py to load under DDP x TP."""
    scratch = os.environ.get("SHARDTORCH_TEST_SCRATCH")
    if not scratch:
        return  # launched alone (not by the harness)
    path = os.path.join(scratch, HANDOFF_DIR)
    os.makedirs(path, exist_ok=True)
    model = fsdp_model("2d")
    opt = _make_optimizer("sgd", model.parameters())
    for step in range(2):
        sharded_step(model, opt, "2d", step)
    ts.save_sharded(model, os.path.join(path, "sharded"), optimizer=opt)
    ts.checkpoint.save_dcp(model, os.path.join(path, "dcp"), optimizer=opt)
    weights = ts.collect_state_dict(model, model.state_dict(), dst=0)
    state = ts.collect_optimizer_state_dict(model, opt, dst=0)
    if dist.get_rank() == 0:
        torch.save({"model": weights, "optimizer": state}, os.path.join(path, "full.pt"))


# ------------------------------------------------------------------ what cannot work says so
def case_sharded_parameters_are_known_under_fully_shard():
    model = fsdp_model("2d")
    names = ts.nn.parallel.sharded_parameter_names(model)
    assert sorted(names) == sorted(SHARD_DIMS), names


def case_ddp_and_converters_refuse_a_fully_sharded_model():
    model = fsdp_model("2d")
    expect_error(lambda: ts.nn.parallel.DistributedDataParallel(model, layout="2d"),
                 "already data-parallel under fully_shard", "use one of DDP or fully_shard", exception=TypeError)
    expect_error(lambda: ts.nn.parallel.fully_shard(model), "already under fully_shard", exception=ValueError)
    plain = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3)).double()
    torch_fully_shard(plain, mesh=ts.distributed.device_mesh("cpu")["dp"])
    expect_error(lambda: ts.nn.ParallelLinear.convert_parallel_linear(plain, dim=1),
                 "the model is under fully_shard", "convert first, then call fully_shard", exception=TypeError)


def case_a_shard_fully_sharded_over_other_shards_is_refused():
    """fully_shard over the world mixes the two tensor-parallel shards of the
    head: no checkpoint of that is right, so every reader raises."""
    torch.manual_seed(7)
    model = nn.Sequential(nn.Linear(5, 8), ts.nn.ParallelLinear(8, 11, dim=1)).double()
    torch_fully_shard(model, mesh=torch.distributed.device_mesh.init_device_mesh("cpu", (4,)))
    for function in (lambda: ts.collect_state_dict(model, model.state_dict()),
                     lambda: ts.relocate_state_dict(model, None, src=0)):
        expect_error(function, "'1.weight' is a shard over group 'tp'", "over ranks [0, 1, 2, 3]",
                     "the data-parallel group", exception=ValueError)


def case_torch_get_state_dict_of_tensor_parallel_shards_says_what_to_do():
    """Under fully_shard a tensor-parallel shard is a DTensor over the data-parallel mesh only, which
    describes the shard as the whole tensor: torch's full state dict of it raises on every rank,
    naming collect, and its sharded state dict warns that dcp.save of it would lose shards."""
    import warnings
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict
    from shardtorch.utils import torch_state_dict
    model = fsdp_model("2d")
    optimizer = _make_optimizer("adam", model.parameters())
    sharded_step(model, optimizer, "2d", 0)
    expect_error(lambda: get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)),
                 "get_state_dict(full_state_dict=True) cannot gather 'head.up.weight'", "group 'tp' (2 ranks)",
                 "ts.collect_state_dict", exception=NotImplementedError)
    torch_state_dict._warned_under_fully_shard = False  # once per process: another case may have taken it
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model_state, _ = get_state_dict(model, optimizer)
    messages = [str(w.message) for w in caught]
    assert any("dcp.save of this state dict would keep one tensor-parallel rank's shard" in m for m in messages), \
        messages
    # What the warning points to reads the same state dict rightly.
    collected = ts.collect_state_dict(model, model_state)
    assert torch.equal(collected["head.up.weight"], ts.collect_state_dict(model, model.state_dict())["head.up.weight"])


def case_fused_loss_on_a_head_torch_sharded_alone_says_what_to_do():
    model = build(True, cls=FusedNet)
    dp = ts.distributed.device_mesh("cpu")["dp"]
    torch_fully_shard(model.head.classifier, mesh=dp)  # its forward is never called by the fused loss
    torch_fully_shard(model, mesh=dp)
    x, y = global_batch(0)
    loss = ts.nn.ParallelLinearCrossEntropyLoss(model.head.classifier)
    expect_error(lambda: loss(model(x), y), "the weight is a DTensor",
                 "register_fsdp_forward_method(head, 'linear_cross_entropy')", exception=RuntimeError)


def case_tensor_marks_are_recorded_before_fully_shard():
    """A hand-written layer that marks its shard only on the tensor
    (TorchShard's way): fully_shard replaces the tensor, so the helper
    records the mark on the layer first and collect still finds it."""
    class Marked(nn.Module):
        def __init__(self):
            super().__init__()
            rows = split_range(9, 2, dist.get_rank() % 2)
            torch.manual_seed(5)
            full = torch.randn(9, 4, dtype=torch.float64)
            self.weight = nn.Parameter(full[rows[0]:rows[1]].clone())
            # TorchShard's meaning: layer dim 1 (column-parallel), the [out, in] weight split on its rows.
            ts.utils.register_parallel_dim(self.weight, 1)
            self.full = full

    layer = Marked()
    model = nn.Sequential(nn.Linear(4, 4).double(), layer)
    ts.nn.parallel.fully_shard(model)
    assert isinstance(layer.weight, DTensor) and isinstance(layer, FSDPModule)
    full = ts.collect_state_dict(model, model.state_dict())
    assert torch.equal(full["1.weight"], layer.full)


def case_a_mark_naming_the_wrong_dimension_is_refused_on_every_rank():
    """Rows split (5 and 4 of 9) but marked 0, TorchShard's row-parallel
    mark (columns split): the shards differ in the dimension the mark says
    is whole, so collect refuses instead of gathering unrelated slices."""
    rows = split_range(9, 2, dist.get_rank() % 2)
    layer = nn.Linear(4, 9, bias=False).double()
    layer.weight = nn.Parameter(torch.randn(9, 4, dtype=torch.float64)[rows[0]:rows[1]].clone())
    ts.utils.register_parallel_dim(layer.weight, 0)
    expect_error(lambda: ts.collect_state_dict(layer, layer.state_dict()), "'weight'", "split along dim 1",
                 "differ in another dimension", exception=RuntimeError)


def case_fully_shard_checks_its_arguments():
    expect_error(lambda: ts.nn.parallel.fully_shard(build(True), layout="3d"),
                 "layout must be one of ('hybrid', '2d'), got '3d'", exception=ValueError)
    # dims named the other way round: "tp" holds {0, 2}, shardtorch's tensor-parallel group is {0, 1}.
    strided = torch.distributed.device_mesh.init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "dp"))
    expect_error(lambda: ts.nn.parallel.fully_shard(build(True), strided),
                 "mesh must be 2-D with dims ('dp', 'tp')", exception=ValueError)
    other = torch.distributed.device_mesh.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    transposed = torch.distributed.device_mesh.DeviceMesh.from_group(
        [other.get_group("tp"), other.get_group("dp")], "cpu", mesh=torch.arange(4).reshape(2, 2),
        mesh_dim_names=("dp", "tp"))
    expect_error(lambda: ts.nn.parallel.fully_shard(build(True), transposed),
                 "the mesh's 'dp' group has ranks", "shardtorch's 'dp' group", exception=ValueError)
    model = build(True)
    expect_error(lambda: ts.nn.parallel.fully_shard(model, units=[nn.Linear(2, 2)]),
                 "units[0] must be a submodule of model", exception=ValueError)
    expect_error(lambda: ts.nn.parallel.fully_shard(model, units=[model.head.classifier]),
                 "units[0] (ParallelLinear) holds tensor-parallel shards itself", exception=ValueError)
    expect_error(lambda: ts.nn.parallel.fully_shard(ts.nn.ParallelLinear(4, 6, dim=1), layout="hybrid"),
                 "the model itself must not hold tensor-parallel shards", exception=ValueError)
    # units: the backbone its own unit over the root's mesh, the head's layers over "dp".
    ts.nn.parallel.fully_shard(model, layout="hybrid", units=[model.backbone])
    assert isinstance(model.backbone, FSDPModule) and isinstance(model.head.up, FSDPModule)
    assert len(model.backbone.stem.weight.device_mesh.mesh.flatten()) == 4  # over the world
    assert model.head.up.weight.device_mesh.mesh.flatten().tolist() == ts.distributed.get_group_ranks("dp")
