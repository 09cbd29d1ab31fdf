"""The parallel cross-entropy with class-probability (soft) targets on real
ranks, against F.cross_entropy on the gathered logits in float64. Every rank
builds the same whole logits and target from a fixed seed and keeps its shard
of the logits; the target is passed sharded like them or whole."""
import itertools

import torch
import torch.nn.functional as F
from torch import nn

import shardtorch as ts
from tests.reference import assert_close, expect_error, probability_cross_entropy_reference, shard_of

F_TS = ts.nn.functional


def _size():
    return ts.distributed.get_group_size()


def _class_counts():
    """Uneven shards, and fewer classes than ranks: at world 2 one class (rank
    0 holds every class, so both target layouts have the same size there), at
    world 3 two (the last rank holds none)."""
    size = _size()
    return (3 * size + size - 1, size - 1) if size > 1 else (4,)


def _whole(rows, classes, seed, leading=None):
    g = torch.Generator().manual_seed(seed * 1000 + classes * 10 + rows)
    shape = leading or (rows,)
    logits = torch.randn(*shape, classes, dtype=torch.float64, generator=g) * 3
    probs = torch.randn(*shape, classes, dtype=torch.float64, generator=g).mul(2).softmax(-1)
    weight = torch.rand(classes, dtype=torch.float64, generator=g) + 0.5
    return logits, probs, weight


def _check(classes, layout, reduction, weight_kind, smoothing, z_loss, pass_num_classes, dtype=torch.float64,
           leading=None, seed=0):
    full, probs, full_weight = _whole(6, classes, seed, leading)
    target = {"sharded": shard_of(probs, -1).clone(), "whole": probs}[layout]
    weight = {"none": None, "full": full_weight, "sharded": shard_of(full_weight, 0)}[weight_kind]
    shard = shard_of(full.to(dtype), -1).clone()
    x = ts.utils.register_parallel_dim(shard.requires_grad_(), -1)
    loss = F_TS.parallel_cross_entropy(x, target.to(dtype) if dtype != torch.bfloat16 else target.float(),
                                       None if weight is None else weight.to(dtype), -100, reduction, smoothing,
                                       z_loss, num_classes=classes if pass_num_classes else None)
    g = torch.Generator().manual_seed(seed + 1)
    upstream = torch.randn(loss.shape, generator=g, dtype=torch.float64)
    (loss.double() * upstream).sum().backward()

    x_ref = full.to(dtype).double().clone().requires_grad_()
    ref = probability_cross_entropy_reference(x_ref, probs, None if weight is None else full_weight,
                                              reduction, smoothing, z_loss)
    (ref * upstream).sum().backward()
    what = (f"classes={classes} layout={layout} {dtype} {reduction} weight={weight_kind} eps={smoothing} "
            f"z={z_loss} num_classes={pass_num_classes} rank={ts.distributed.get_group_rank()}")
    assert loss.dtype == dtype and loss.shape == ref.shape, what
    assert_close(loss, ref, dtype, "loss " + what)
    assert_close(x.grad, shard_of(x_ref.grad, -1), dtype, "grad " + what)


def case_every_combination_float64():
    for i, (classes, layout, reduction, weight_kind, (smoothing, z_loss)) in enumerate(itertools.product(
            _class_counts(), ("sharded", "whole"), ("none", "mean", "sum"), ("none", "sharded", "full"),
            ((0.0, 0.0), (0.15, 0.0), (0.1, 1e-2)))):
        _check(classes, layout, reduction, weight_kind, smoothing, z_loss, pass_num_classes=i % 2 == 0,
               leading=(2, 3) if i % 5 == 0 else None, seed=i)


def case_float32_and_bfloat16():
    for dtype, layout in itertools.product((torch.float32, torch.bfloat16), ("sharded", "whole")):
        _check(_class_counts()[0], layout, "mean", "sharded", 0.1, 1e-3, pass_num_classes=False, dtype=dtype)


def case_large_confident_logits_float32():
    """Logits near 1000, the target on each row's top class: each rank sums B
    (probability_target.h) relative to its own max, and the combined loss
    rebases them to the row's, so the float32 loss keeps its relative
    accuracy whichever rank holds the top class (old: B = sum w p z, up to 1%
    of the loss off). Against float64 of the same float32 logits."""
    classes = 3000 + _size() - 1
    g = torch.Generator().manual_seed(5)
    full = torch.randn(8, classes, dtype=torch.float64, generator=g)
    top = torch.randint(0, classes, (8,), generator=g)
    full[torch.arange(8), top] += 12.0
    full = (full + 1000.0).float()
    probs = torch.full((8, classes), 1e-6, dtype=torch.float64)
    probs[torch.arange(8), top] = 1.0 - 1e-6 * (classes - 1)
    probs = probs.float()
    x = ts.utils.register_parallel_dim(shard_of(full, -1).clone().requires_grad_(), -1)
    loss = F_TS.parallel_cross_entropy(x, shard_of(probs, -1).clone(), None, -100, "none")
    loss.sum().backward()
    z = full.double().requires_grad_()
    ref = -(probs.double() * (z - torch.logsumexp(z, -1, keepdim=True))).sum(-1)
    ref.sum().backward()
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-4, atol=0)
    f32 = torch.finfo(torch.float32).eps
    torch.testing.assert_close(x.grad.double(), shard_of(z.grad, -1), rtol=f32, atol=4 * f32)


def case_ranks_may_mix_the_layouts():
    """Each rank reads its own target's size: rank 0 whole, the others sharded,
    is still the same loss."""
    classes = _class_counts()[0]
    full, probs, weight = _whole(5, classes, 3)
    target = probs if ts.distributed.get_group_rank() == 0 else shard_of(probs, -1).clone()
    x = ts.utils.register_parallel_dim(shard_of(full, -1).clone().requires_grad_(), -1)
    loss = F_TS.parallel_cross_entropy(x, target, weight, label_smoothing=0.1)
    loss.backward()
    x_ref = full.clone().requires_grad_()
    ref = probability_cross_entropy_reference(x_ref, probs, weight, "mean", 0.1)
    ref.backward()
    assert_close(loss, ref, torch.float64, "mixed layouts loss")
    assert_close(x.grad, shard_of(x_ref.grad, -1), torch.float64, "mixed layouts grad")


def _trains_like_unsharded(seed, make_loss, what):
    """Three SGD steps of a column-parallel head on a teacher's softmax (a
    distillation target, whole or sharded in turn), against nn.Linear with
    F.cross_entropy; make_loss(head) gives the sharded loss of (x, target)."""
    classes = _class_counts()[0]
    torch.manual_seed(seed)
    ref_head = nn.Linear(5, classes, dtype=torch.float64)
    head = ts.nn.ParallelLinear.from_linear(ref_head, dim=1)
    loss_fn = make_loss(head)
    opt = torch.optim.SGD(head.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(ref_head.parameters(), lr=0.5)
    for step in range(3):
        x = torch.randn(8, 5, dtype=torch.float64)
        teacher = torch.randn(8, classes, dtype=torch.float64).softmax(-1)
        target = teacher if step % 2 == 0 else shard_of(teacher, -1).clone()
        for o in (opt, ref_opt):
            o.zero_grad()
        loss_fn(x, target).backward()
        probability_cross_entropy_reference(ref_head(x), teacher, label_smoothing=0.05).backward()
        opt.step()
        ref_opt.step()
    assert_close(head.weight, shard_of(ref_head.weight, 0), torch.float64, what + " weight after training")
    assert_close(head.bias, shard_of(ref_head.bias, 0), torch.float64, what + " bias after training")


def case_trains_like_unsharded():
    """ParallelCrossEntropyLoss on a column-parallel head's logits."""
    loss_fn = ts.nn.ParallelCrossEntropyLoss(label_smoothing=0.05)
    _trains_like_unsharded(7, lambda head: lambda x, target: loss_fn(head(x), target), "column-parallel head's")


def case_bad_target_size_raises_on_every_rank():
    size, rank = _size(), ts.distributed.get_group_rank()
    classes = _class_counts()[0]
    full, probs, _ = _whole(4, classes, 5)
    x = ts.utils.register_parallel_dim(shard_of(full, -1).clone(), -1)
    local = x.shape[-1]
    # Only the last rank's target is wrong (one class too many): every rank raises.
    bad = probs[:, :local + 1].clone() if rank == size - 1 else probs
    message = expect_error(lambda: F_TS.parallel_cross_entropy(x, bad), exception=RuntimeError,
                           match=f"a probability target's last dim must be this rank's {local} classes|"
                                 f"group rank {size - 1} failed a check: its probability target")
    if rank == size - 1:
        assert f"all num_classes={classes}, got {local + 1}" in message, message
    # A size every rank rejects, with num_classes given (no shard-size exchange first).
    expect_error(lambda: F_TS.parallel_cross_entropy(x, probs[:, :classes - 1].clone(), num_classes=classes),
                 "a probability target's last dim must be", exception=RuntimeError)
    # Rules every rank decides before any collective.
    expect_error(lambda: F_TS.parallel_cross_entropy(x, probs.half()), exception=RuntimeError,
                 match=r"a probability target must have the logits' dtype \(Double\) or float32, got Half")
    expect_error(lambda: F_TS.parallel_cross_entropy(x, probs[0]), exception=RuntimeError,
                 match="a probability target must be shaped like the logits")
    expect_error(lambda: F_TS.parallel_cross_entropy(x, probs.clone().requires_grad_()),
                 "probability target is not supported", exception=RuntimeError)
    # The fused op decides the same way: only the last rank's target is wrong.
    head = ts.nn.ParallelLinear(3, classes, dim=1, dtype=torch.float64)
    features = torch.randn(4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(11))  # same everywhere
    expect_error(lambda: head.linear_cross_entropy(features, bad), exception=RuntimeError,
                 match=f"parallel_linear_cross_entropy\\w*: a probability target's last dim must be this rank's "
                       f"{local} classes|group rank {size - 1} failed a check: its probability target")
    expect_error(lambda: head.linear_cross_entropy(features, probs.clone().requires_grad_()),
                 "probability target is not supported", exception=RuntimeError)
    # The group is still usable: nobody was left inside a collective.
    loss = F_TS.parallel_cross_entropy(x, probs)
    assert_close(loss, probability_cross_entropy_reference(full, probs), torch.float64, "after the errors")
    loss = head.linear_cross_entropy(features, probs)
    whole_weight = ts.distributed.all_gather(head.weight.detach(), dim=0, full_size=classes)
    whole_bias = ts.distributed.all_gather(head.bias.detach(), dim=0, full_size=classes)
    assert_close(loss, probability_cross_entropy_reference(features @ whole_weight.T + whole_bias, probs),
                 torch.float64, "fused after the errors")


# The fused linear cross-entropy: x whole on every rank, W [classes, features]
# and b sharded by classes, against F.cross_entropy(F.linear(x, W, b), p).

def _whole_head(rows, classes, features, seed):
    g = torch.Generator().manual_seed(seed * 1000 + classes * 10 + rows)
    x = torch.randn(rows, features, dtype=torch.float64, generator=g)
    W = torch.randn(classes, features, dtype=torch.float64, generator=g)
    b = torch.randn(classes, dtype=torch.float64, generator=g)
    probs = torch.randn(rows, classes, dtype=torch.float64, generator=g).mul(2).softmax(-1)
    weight = torch.rand(classes, dtype=torch.float64, generator=g) + 0.5
    return x, W, b, probs, weight


def _check_fused(classes, layout, reduction, weight_kind, smoothing, z_loss, rows=6, chunk=2, features=3,
                 pass_num_classes=False, seed=0):
    x, W, b, probs, full_weight = _whole_head(rows, classes, features, seed)
    target = {"sharded": shard_of(probs, -1).clone(), "whole": probs}[layout]
    weight = {"none": None, "full": full_weight, "sharded": shard_of(full_weight, 0)}[weight_kind]
    xs = x.clone().requires_grad_()
    Ws, bs = shard_of(W, 0).clone().requires_grad_(), shard_of(b, 0).clone().requires_grad_()
    loss = F_TS.parallel_linear_cross_entropy(xs, Ws, bs, target, weight, reduction=reduction,
                                              label_smoothing=smoothing, z_loss=z_loss, chunk_size=chunk,
                                              num_classes=classes if pass_num_classes else None)
    upstream = torch.randn(loss.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    (loss * upstream).sum().backward()
    xr, Wr, br = (t.clone().requires_grad_() for t in (x, W, b))
    ref = probability_cross_entropy_reference(F.linear(xr, Wr, br), probs, None if weight is None else full_weight,
                                              reduction, smoothing, z_loss)
    (ref * upstream).sum().backward()
    what = (f"fused classes={classes} rows={rows} layout={layout} {reduction} weight={weight_kind} "
            f"eps={smoothing} z={z_loss} rank={ts.distributed.get_group_rank()}")
    assert loss.shape == ref.shape, what
    assert_close(loss, ref, torch.float64, "loss " + what)
    assert_close(xs.grad, xr.grad, torch.float64, "grad input " + what)
    assert_close(Ws.grad, shard_of(Wr.grad, 0), torch.float64, "grad weight " + what)
    assert_close(bs.grad, shard_of(br.grad, 0), torch.float64, "grad bias " + what)


def case_fused_every_combination_float64():
    """Gradients in forward in one block (mean, sum) and the separate backward
    (none), several chunks per shard, uneven shards and a rank without classes."""
    smoothing_z = ((0.0, 0.0), (0.15, 0.0), (0.1, 1e-2))
    for i, (classes, layout, reduction, weight_kind) in enumerate(itertools.product(
            _class_counts(), ("sharded", "whole"), ("none", "mean", "sum"), ("none", "sharded", "full"))):
        smoothing, z_loss = smoothing_z[i % 3]
        _check_fused(classes, layout, reduction, weight_kind, smoothing, z_loss, pass_num_classes=i % 2 == 0,
                     seed=i)


def case_fused_row_blocks_and_recompute():
    """The largest shard decides the path on every rank alike: 29000 classes
    (blocks of at most 2**22 // 29000 = 144 rows: 150 rows in two blocks) and
    34000 (blocks would be 123 rows, under 128: the logits are computed twice
    in forward). Uneven shards (the last rank one class short); rank 0 passes
    the whole target, the others their shard."""
    size = _size()
    layout = "whole" if ts.distributed.get_group_rank() == 0 else "sharded"
    for shard, rows, reduction in ((29000, 150, "mean"), (34000, 130, "sum")):
        _check_fused(shard * size - (1 if size > 1 else 0), layout, reduction, "sharded", 0.1, 1e-3, rows=rows,
                     chunk=1024, pass_num_classes=reduction == "mean", seed=shard)


def case_fused_trains_like_unsharded():
    """ParallelLinearCrossEntropyLoss (the fused head) on the same steps."""
    _trains_like_unsharded(
        8, lambda head: ts.nn.ParallelLinearCrossEntropyLoss(head, label_smoothing=0.05, chunk_size=2), "fused")
