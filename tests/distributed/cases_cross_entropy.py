"""The parallel cross-entropy on real ranks against F.cross_entropy on the
gathered logits. Every rank builds the same whole logits from a fixed seed and
keeps its shard; targets are the same everywhere."""
import itertools

import torch
from torch import nn

import shardtorch as ts
from tests.reference import assert_close, cross_entropy_reference, expect_error, shard_of, split_range

F_TS = ts.nn.functional


def _size():
    return ts.distributed.get_group_size()


def _class_counts():
    size = _size()
    return {"even": 3 * size, "uneven": 3 * size + size - 1}


def _targets(rows, classes, ignore):
    """Targets for an ignore setting: None, -100, a class id, or all ignored."""
    g = torch.Generator().manual_seed(rows * 1000 + classes)
    target = torch.randint(0, classes, (rows,), generator=g)
    if ignore == "none":
        return target, -100
    if ignore == "-100":
        target[::3] = -100
        return target, -100
    if ignore == "class":
        ignored = 1
        target[::2] = ignored
        return target, ignored
    return torch.full((rows,), -100), -100  # all ignored


def _check(rows, classes, dtype, reduction, ignore, weight_kind, smoothing, z_loss,
           pass_num_classes, extra_leading=False):
    g = torch.Generator().manual_seed(classes * 7 + rows)
    full = (torch.randn(rows, classes, generator=g, dtype=torch.float64) * 3).to(dtype)
    target, ignore_index = _targets(rows, classes, ignore)
    full_weight = torch.rand(classes, generator=g, dtype=torch.float64) + 0.5
    weight = {"none": None, "full": full_weight, "sharded": shard_of(full_weight, 0)}[weight_kind]
    if weight is not None:
        weight = weight.to(dtype)
    if extra_leading:
        full, target = full.view(2, rows // 2, classes), target.view(2, rows // 2)
    upstream = torch.randn(() if reduction != "none" else target.shape, generator=g,
                           dtype=torch.float64)

    shard = shard_of(full, -1).clone()
    before = shard.clone()
    x = ts.utils.register_parallel_dim(shard.requires_grad_(), -1)
    loss = F_TS.parallel_cross_entropy(x, target, weight, ignore_index, reduction, smoothing,
                                       z_loss, group="tp",
                                       num_classes=classes if pass_num_classes else None)
    (loss.double() * upstream).sum().backward()
    assert torch.equal(shard.detach(), before), "logits were modified"

    x_ref = full.double().clone().requires_grad_()
    ref = cross_entropy_reference(x_ref, target, full_weight if weight is not None else None,
                                  ignore_index, reduction, smoothing, z_loss)
    (ref * upstream).sum().backward()
    what = (f"rows={rows} classes={classes} {dtype} {reduction} ignore={ignore} "
            f"weight={weight_kind} eps={smoothing} z={z_loss}")
    assert loss.dtype == dtype and loss.shape == ref.shape, what
    if ignore == "all" and reduction == "mean":
        assert torch.isnan(loss) and torch.isnan(ref), what
    else:
        assert_close(loss, ref, dtype, "loss " + what)
    assert_close(x.grad, shard_of(x_ref.grad, -1), dtype, "grad " + what)


def case_every_combination_float64():
    for i, (reduction, ignore, weight_kind, smoothing, z_loss, classes) in enumerate(itertools.product(
            ("none", "mean", "sum"), ("none", "-100", "class", "all"), ("none", "sharded", "full"),
            (0.0, 0.15), (0.0, 1e-2), _class_counts().values())):
        _check(6, classes, torch.float64, reduction, ignore, weight_kind, smoothing, z_loss,
               pass_num_classes=i % 2 == 0, extra_leading=i % 5 == 0)


def case_float32_and_bfloat16():
    for dtype, reduction, weight_kind in itertools.product(
            (torch.float32, torch.bfloat16), ("mean", "none"), ("none", "sharded")):
        _check(8, _class_counts()["uneven"], dtype, reduction, "-100", weight_kind, 0.1, 1e-3,
               pass_num_classes=False)


def case_more_ranks_than_classes():
    size = _size()
    if size <= 2:
        return
    # Some ranks hold no class at all.
    _check(4, size - 1, torch.float64, "mean", "-100", "sharded", 0.1, 1e-2, True)
    torch.manual_seed(5)
    ref_head = nn.Linear(3, size - 1, dtype=torch.float64)
    head = ts.nn.ParallelLinear.from_linear(ref_head, dim=1)
    x = torch.randn(4, 3, dtype=torch.float64)
    target = torch.tensor([0, 1, -100, size - 2])
    x_a, x_b = x.clone().requires_grad_(), x.clone().requires_grad_()
    loss = ts.nn.ParallelLinearCrossEntropyLoss(head, chunk_size=1)(x_a, target)
    loss.backward()
    ref = cross_entropy_reference(ref_head(x_b), target)
    ref.backward()
    assert_close(loss, ref, torch.float64, "fused loss with empty shards")
    assert_close(x_a.grad, x_b.grad, torch.float64, "fused grad input with empty shards")


def case_fused_equals_linear_then_loss():
    size = _size()
    classes, features, rows = 5 * size + 1, 6, 8
    for bias, smoothing, weight_kind, chunk in ((True, 0.0, "none", 2), (False, 0.1, "sharded", 64),
                                                (True, 0.2, "full", 3)):
        torch.manual_seed(11)
        ref_head = nn.Linear(features, classes, bias=bias, dtype=torch.float64)
        head = ts.nn.ParallelLinear.from_linear(ref_head, dim=1)
        fused_head = ts.nn.ParallelLinear.from_linear(ref_head, dim=1)
        target, ignore_index = _targets(rows, classes, "-100")
        full_weight = torch.rand(classes, dtype=torch.float64) + 0.5
        weight = {"none": None, "full": full_weight, "sharded": shard_of(full_weight, 0)}[weight_kind]
        x = torch.randn(rows, features, dtype=torch.float64)
        x_a, x_b = x.clone().requires_grad_(), x.clone().requires_grad_()
        loss_a = ts.nn.ParallelCrossEntropyLoss(weight, ignore_index, label_smoothing=smoothing,
                                                z_loss=1e-3)(head(x_a), target)
        loss_b = ts.nn.ParallelLinearCrossEntropyLoss(fused_head, weight, ignore_index,
                                                      label_smoothing=smoothing, z_loss=1e-3,
                                                      chunk_size=chunk)(x_b, target)
        loss_a.backward()
        loss_b.backward()
        what = f"bias={bias} eps={smoothing} weight={weight_kind} chunk={chunk}"
        assert_close(loss_b, loss_a, torch.float64, "fused loss " + what)
        assert_close(x_b.grad, x_a.grad, torch.float64, "fused grad input " + what)
        assert_close(fused_head.weight.grad, head.weight.grad, torch.float64, "fused grad weight " + what)
        if bias:
            assert_close(fused_head.bias.grad, head.bias.grad, torch.float64, "fused grad bias " + what)
        # And against unsharded torch.
        x_ref = x.clone().requires_grad_()
        ref = cross_entropy_reference(ref_head(x_ref), target, full_weight if weight is not None else None,
                                      ignore_index, "mean", smoothing, 1e-3)
        ref.backward()
        assert_close(loss_b, ref, torch.float64, "fused vs torch " + what)
        assert_close(x_b.grad, x_ref.grad, torch.float64, "fused grad input vs torch " + what)
        assert_close(fused_head.weight.grad, shard_of(ref_head.weight.grad, 0), torch.float64,
                     "fused grad weight vs torch " + what)


def case_out_of_range_target_raises_on_every_rank():
    classes = _class_counts()["uneven"]
    shard = shard_of(torch.randn(4, classes, dtype=torch.float64), -1).clone()
    target = torch.tensor([0, classes, 1, -100])
    for num_classes in (None, classes):
        expect_error(lambda: F_TS.parallel_cross_entropy(shard, target, parallel=True, num_classes=num_classes),
                     exception=RuntimeError,
                     match=rf"target values must be in \[0, num_classes={classes}\).*got {classes}")
    expect_error(lambda: F_TS.parallel_cross_entropy(shard, torch.tensor([0, -5, 1, 2]), parallel=True),
                 "got -5", exception=RuntimeError)
    # The group is still usable: nobody was left inside a collective.
    F_TS.parallel_cross_entropy(shard, torch.tensor([0, 1, 2, 3]), parallel=True)


def case_marked_tensor_mismatch_raises_on_every_rank():
    size = _size()
    classes = 3 * size + 1  # uneven: rank 0 holds 4, the others 3
    shard = ts.utils.register_parallel_dim(shard_of(torch.randn(4, classes), -1).clone(), -1)
    target = torch.tensor([0, 1, 2, 3])
    # A weight of 3 classes fits every rank but rank 0: all ranks must raise.
    expect_error(lambda: ts.nn.ParallelCrossEntropyLoss(weight=torch.ones(3))(shard, target),
                 exception=RuntimeError, match="weight must hold this rank's 4 classes|group rank 0 failed a check")
    # Logits that are not this rank's shard of the classes the caller names.
    expect_error(lambda: ts.nn.ParallelCrossEntropyLoss(num_classes=classes + 1)(shard, target),
                 exception=RuntimeError, match="shard of num_classes|failed a check")
    F_TS.parallel_cross_entropy(shard, target)  # still usable


def case_loss_takes_the_number_of_classes_from_the_mark_unless_given():
    size = _size()
    classes = 3 * size + 1  # uneven: rank 0 holds 4, the others 3
    g = torch.Generator().manual_seed(5)
    full = torch.randn(4, classes, generator=g, dtype=torch.float64)
    target = torch.tensor([0, classes - 1, 2, 1])
    expected = cross_entropy_reference(full, target)
    shard = shard_of(full, -1).clone()
    marked = ts.utils.register_parallel_dim(shard.clone(), -1, classes)
    assert_close(ts.nn.ParallelCrossEntropyLoss()(marked, target), expected, torch.float64, "marked with its size")
    # The carried size reaches the op: a wrong one (every rank's shard of it is
    # one longer than what the rank holds) is refused...
    wrong = ts.utils.register_parallel_dim(shard.clone(), -1, classes + size)
    for parallel in (None, True):
        expect_error(lambda: F_TS.parallel_cross_entropy(wrong, target, parallel=parallel),
                     f"shard of num_classes={classes + size}", exception=RuntimeError)
    # ...and an explicit num_classes wins over it.
    assert_close(F_TS.parallel_cross_entropy(wrong, target, num_classes=classes), expected, torch.float64,
                 "explicit num_classes")
    # A ParallelLinear(dim=1) output carries out_features.
    head = ts.nn.ParallelLinear(3, classes, dim=1, dtype=torch.float64)
    assert ts.utils.get_parallel_full_size(head(torch.randn(2, 3, dtype=torch.float64))) == classes
    # So does a scatter of whole logits, and the loss over it is F.cross_entropy's.
    scattered = ts.distributed.scatter(full, -1)
    assert ts.utils.get_parallel_full_size(scattered) == classes
    assert_close(ts.nn.ParallelCrossEntropyLoss()(scattered, target), expected, torch.float64, "scattered")


def case_trains_like_unsharded():
    size = _size()
    classes, features = 4 * size + 3, 5
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(7, features), nn.Tanh(), nn.Linear(features, classes)).double()
    model = nn.Sequential(nn.Linear(7, features), nn.Tanh(), ts.nn.ParallelLinear.from_linear(ref[2], dim=1)).double()
    model[0].load_state_dict(ref[0].state_dict())
    loss_fn = ts.nn.ParallelCrossEntropyLoss(label_smoothing=0.1)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.5)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    torch.manual_seed(1)
    for _ in range(4):
        x, y = torch.randn(6, 7, dtype=torch.float64), torch.randint(0, classes, (6,))
        opt_ref.zero_grad()
        opt.zero_grad()
        cross_entropy_reference(ref(x), y, label_smoothing=0.1).backward()
        loss_fn(model(x), y).backward()
        opt_ref.step()
        opt.step()
    assert_close(model[0].weight, ref[0].weight, torch.float64, "first layer after training")
    assert_close(model[2].weight, shard_of(ref[2].weight, 0), torch.float64, "head after training")


def case_fused_gradients_in_forward_by_blocks_and_recomputed():
    """The fused loss's two gradients-in-forward paths on ranks whose shards
    differ by one class, against the float64 reference: blocks of rows (2
    ranks x 16,002 / 16,001 classes, 300 rows: 2**22 // 16002 = 262, so two
    blocks of 150, one all-gather each) and, with 70,001 classes per rank
    (blocks of 59 rows would be too thin), the logits computed twice in
    forward. Class weights, smoothing, z-loss, ignored rows."""
    if _size() != 2:  # the reference's whole logits are large: one world size is enough
        return
    for rows, classes, reduction in ((300, 32003, "mean"), (160, 140001, "sum")):
        g = torch.Generator().manual_seed(classes)
        x = torch.randn(rows, 3, dtype=torch.float64, generator=g)
        W = torch.randn(classes, 3, dtype=torch.float64, generator=g)
        b = torch.randn(classes, dtype=torch.float64, generator=g)
        weight = torch.rand(classes, dtype=torch.float64, generator=g) + 0.5
        target = torch.randint(0, classes, (rows,), generator=g)
        target[::5] = -100
        kwargs = dict(ignore_index=-100, reduction=reduction, label_smoothing=0.1, z_loss=1e-3)
        xr, Wr, br = (t.clone().requires_grad_() for t in (x, W, b))
        ref = cross_entropy_reference(nn.functional.linear(xr, Wr, br), target, weight, **kwargs)
        (0.5 * ref).backward()
        xs = x.clone().requires_grad_()
        Ws, bs = shard_of(W, 0).clone().requires_grad_(), shard_of(b, 0).clone().requires_grad_()
        loss = F_TS.parallel_linear_cross_entropy(xs, Ws, bs, target, shard_of(weight, 0),
                                                  **kwargs)
        (0.5 * loss).backward()
        what = f"rows={rows} classes={classes}"
        assert_close(loss, ref, torch.float64, "fused loss " + what)
        assert_close(xs.grad, xr.grad, torch.float64, "fused grad input " + what)
        assert_close(Ws.grad, shard_of(Wr.grad, 0), torch.float64, "fused grad weight " + what)
        assert_close(bs.grad, shard_of(br.grad, 0), torch.float64, "fused grad bias " + what)


def case_fused_masked_classes_where_a_rank_holds_only_masked_ones():
    """Classes masked by a -inf bias, the last rank's whole shard among them:
    on that rank every row's logits are -inf (its max -inf, its sum 0), on
    the others a few are. The fused loss's one block of rows (where each logit
    is turned into its exp once and that into its gradient) against the
    float64 reference, float64 and float32: finite loss and gradients, zero
    for the masked classes; the live logits near 0 and near -100 (a
    log-sum-exp below float32's exp range: exp(0 - lse) would overflow).
    Class weights, z-loss, an ignored row."""
    size = _size()
    rows, classes = 40, 7 * size + 3
    for offset in (0.0, -100.0):
        _check_masked_classes(rows, classes, offset)


def _check_masked_classes(rows, classes, offset):
    size, rank = _size(), ts.distributed.get_group_rank()
    g = torch.Generator().manual_seed(classes)
    x = torch.randn(rows, 5, dtype=torch.float64, generator=g)
    W = torch.randn(classes, 5, dtype=torch.float64, generator=g)
    b = torch.randn(classes, dtype=torch.float64, generator=g) + offset
    last_lo = split_range(classes, size, size - 1)[0]
    b[last_lo:] = float("-inf")
    b[1:last_lo:4] = float("-inf")
    live = [c for c in range(last_lo) if c % 4 != 1]
    target = torch.tensor(live)[torch.randint(0, len(live), (rows,), generator=g)]
    target[3] = -100
    weight = torch.rand(classes, dtype=torch.float64, generator=g) + 0.5
    kwargs = dict(ignore_index=-100, z_loss=1e-3)
    xr, Wr, br = (t.clone().requires_grad_() for t in (x, W, b))
    ref = cross_entropy_reference(nn.functional.linear(xr, Wr, br), target, weight, **kwargs)
    ref.backward()
    for dtype in (torch.float64, torch.float32):
        xs, Ws, bs = (t.to(dtype).clone().requires_grad_() for t in (x, shard_of(W, 0), shard_of(b, 0)))
        loss = F_TS.parallel_linear_cross_entropy(xs, Ws, bs, target, shard_of(weight, 0).to(dtype),
                                                  **kwargs)
        loss.backward()
        what = f"{dtype} rank {rank} offset {offset}"
        assert torch.isfinite(loss), what
        assert_close(loss, ref, dtype, "masked loss " + what)
        assert_close(xs.grad, xr.grad, dtype, "masked grad input " + what)
        assert_close(Ws.grad, shard_of(Wr.grad, 0), dtype, "masked grad weight " + what)
        assert_close(bs.grad, shard_of(br.grad, 0), dtype, "masked grad bias " + what)
        masked = torch.isneginf(shard_of(b, 0))
        assert masked.any() and not bs.grad[masked].any() and not Ws.grad[masked].any(), what


def case_profiler_shows_the_time_each_collective_waited():
    """Under torch.profiler the fused loss's collectives show what the caller
    spent blocked in them, by name: the statistics' all-gather in forward and
    the input gradient's all-reduce (gradients in forward), as
    "shard::wait all_gather" and "shard::wait all_reduce" (Gloo's own events
    time its thread, not the wait). The loss is still the reference's."""
    from torch.profiler import ProfilerActivity, profile

    g = torch.Generator().manual_seed(7)
    rows, classes = 8, 6 * _size()
    x = torch.randn(rows, 5, dtype=torch.float64, generator=g)
    W = torch.randn(classes, 5, dtype=torch.float64, generator=g)
    target = torch.randint(0, classes, (rows,), generator=g)
    xs = x.clone().requires_grad_()
    Ws = shard_of(W, 0).clone().requires_grad_()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        loss = F_TS.parallel_linear_cross_entropy(xs, Ws, None, target)
        loss.backward()
    counts = {e.key: e.count for e in prof.key_averages()}
    for name in ("shard::wait all_gather", "shard::wait all_reduce"):
        assert counts.get(name, 0) >= 1, f"no {name!r} event among {sorted(counts)}"
    ref = nn.functional.cross_entropy(x @ W.T, target)
    assert_close(loss, ref, torch.float64, "loss under the profiler")
