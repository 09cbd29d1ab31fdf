"""The margin softmax (ParallelMarginLoss, parallel_margin_cross_entropy) on
real ranks against the formulas written out on the gathered logits
(tests/reference.py). Every rank builds the same whole inputs from a fixed
seed and keeps its shard of the class weights; targets are the same
everywhere."""
import itertools
import math

import torch

import shardtorch as ts
from tests.distributed.cases_cross_entropy import _class_counts, _size
from tests.reference import (assert_close, expect_error, margin_cross_entropy_reference, shard_of,
                             shard_range)

F_TS = ts.nn.functional
PRESETS = ts.nn.MARGIN_PRESETS


def _problem(rows, classes, features, seed, ignore="none"):
    """Inputs whose target cosines cover every branch of the margin: rows near
    their class (cos ~ 1), near its opposite (cos ~ -1: insightface's fallback)
    and in between (cos < 0: easy_margin's plain branch)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(classes, features, generator=g, dtype=torch.float64)
    target = torch.randint(0, classes, (rows,), generator=g)
    x = torch.randn(rows, features, generator=g, dtype=torch.float64)
    x[0::4] = w[target[0::4]] * 2.0 + 0.05 * x[0::4]
    x[1::4] = -w[target[1::4]] * 0.5 + 0.05 * x[1::4]
    x[2::4] = -0.4 * w[target[2::4]] + 0.3 * x[2::4]
    ignore_index = -100
    if ignore == "-100":
        target[3::5] = -100
    elif ignore == "class":
        ignore_index = 1
        target[1::3] = 1
    return x, w, target, ignore_index


def _check(rows, classes, features, margins, easy_margin, reduction, ignore, smoothing,
           scale=16.0, chunk_size=2, pass_num_classes=True, leading=False, seed=0):
    x, w, target, ignore_index = _problem(rows, classes, features, seed, ignore)
    if leading:
        x, target = x.view(2, rows // 2, features), target.view(2, rows // 2)
    g = torch.Generator().manual_seed(seed + 1)
    upstream = torch.randn(target.shape if reduction == "none" else (), generator=g, dtype=torch.float64)
    x_a = x.clone().requires_grad_()
    w_a = shard_of(w, 0).clone().requires_grad_()
    loss = F_TS.parallel_margin_cross_entropy(
        x_a, w_a, target, scale, margins, easy_margin, ignore_index, reduction, smoothing,
        chunk_size=chunk_size, num_classes=classes if pass_num_classes else None)
    (loss * upstream).sum().backward()
    x_r, w_r = x.clone().requires_grad_(), w.clone().requires_grad_()
    ref = margin_cross_entropy_reference(x_r, w_r, target, scale, margins, easy_margin, ignore_index,
                                         reduction, smoothing)
    (ref * upstream).sum().backward()
    what = (f"classes={classes} margins={margins} easy={easy_margin} {reduction} ignore={ignore} "
            f"eps={smoothing} chunk={chunk_size}")
    assert loss.shape == ref.shape, what
    assert_close(loss, ref, torch.float64, "loss " + what)
    assert_close(x_a.grad, x_r.grad, torch.float64, "grad input " + what)
    assert_close(w_a.grad, shard_of(w_r.grad, 0), torch.float64, "grad weight " + what)


def case_every_preset_option_and_split_float64():
    combos = itertools.product(PRESETS.values(), (False, True), ("none", "mean", "sum"),
                               ("none", "-100", "class"), (0.0, 0.1), _class_counts().values())
    for i, (margins, easy, reduction, ignore, smoothing, classes) in enumerate(combos):
        _check(8, classes, 5, margins, easy, reduction, ignore, smoothing,
               chunk_size=(1, 2, 64)[i % 3], pass_num_classes=i % 2 == 0, leading=i % 7 == 0, seed=i)


def case_scale_and_margins_beyond_presets():
    classes = _class_counts()["uneven"]
    for margins in ((2.0, 0.1, 0.1), (1.0, 0.0, 0.0), (1.5, 0.5, 0.35), (1.0, 3.0, 1.0)):
        for easy in (False, True):
            _check(12, classes, 6, margins, easy, "mean", "-100", 0.05, scale=30.0, chunk_size=3)


def case_float32_close_to_float64():
    classes = _class_counts()["uneven"]
    x, w, target, _ = _problem(16, classes, 8, 3)
    x32, w32 = x.float().requires_grad_(), shard_of(w, 0).float().clone().requires_grad_()
    loss = F_TS.parallel_margin_cross_entropy(x32, w32, target, 64.0, PRESETS["arcface"],
                                              chunk_size=4, num_classes=classes)
    loss.backward()
    x_r, w_r = x.clone().requires_grad_(), w.clone().requires_grad_()
    ref = margin_cross_entropy_reference(x_r, w_r, target, 64.0, PRESETS["arcface"])
    ref.backward()
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(x32.grad.double(), x_r.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(w32.grad.double(), shard_of(w_r.grad, 0), rtol=1e-4, atol=1e-4)


def case_module_weight_is_the_slice_of_partial_fc_init_bitwise():
    for classes, features in ((_class_counts()["uneven"], 7), (1001, 16)):
        torch.manual_seed(123)
        loss_fn = ts.nn.ParallelMarginLoss(features, classes)
        after = torch.rand(3)
        torch.manual_seed(123)
        full = torch.empty(classes, features).normal_(0, 0.01)
        after_full = torch.rand(3)
        assert torch.equal(loss_fn.weight.detach(), shard_of(full, 0)), (classes, features)
        assert torch.equal(after, after_full), "the generator must end where the full draw leaves it"
        lo, hi = shard_range(classes)
        assert loss_fn.weight.shape == (hi - lo, features)


def case_module_trains_like_the_reference():
    classes, features = _class_counts()["uneven"], 6
    torch.manual_seed(7)
    loss_fn = ts.nn.ParallelMarginLoss(features, classes, scale=8.0, margins=PRESETS["combined"],
                                       label_smoothing=0.1, dtype=torch.float64, chunk_size=2)
    torch.manual_seed(7)
    w_ref = torch.empty(classes, features, dtype=torch.float64).normal_(0, 0.01).requires_grad_()
    opt = torch.optim.SGD(loss_fn.parameters(), lr=0.5, momentum=0.9)
    opt_ref = torch.optim.SGD([w_ref], lr=0.5, momentum=0.9)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        x = torch.randn(10, features, generator=g, dtype=torch.float64)
        y = torch.randint(0, classes, (10,), generator=g)
        opt.zero_grad()
        opt_ref.zero_grad()
        loss = loss_fn(x, y)
        loss.backward()
        ref = margin_cross_entropy_reference(x, w_ref, y, 8.0, PRESETS["combined"], label_smoothing=0.1)
        ref.backward()
        assert_close(loss, ref, torch.float64, "module loss")
        opt.step()
        opt_ref.step()
    assert_close(loss_fn.weight, shard_of(w_ref, 0), torch.float64, "weight after training")
    lo, hi = shard_range(classes)
    assert torch.equal(loss_fn.last_sampled_classes, torch.arange(hi - lo))


def case_bad_margins_raise_on_every_rank():
    classes = _class_counts()["uneven"]
    x, w, target, _ = _problem(4, classes, 5, 0)
    w_local = shard_of(w, 0)
    for margins, fragment in (((0.5, 0.5, 0.0), "m1, multiplicative angular) must be finite and >= 1, got 0.5"),
                              ((1.0, 3.5, 0.0), "m2, additive angular) must be in [0, pi), got 3.5"),
                              ((1.0, -0.1, 0.0), "got -0.1"),
                              ((1.0, 0.0, 1.5), "m3, additive cosine) must be in [0, 1], got 1.5")):
        expect_error(lambda: F_TS.parallel_margin_cross_entropy(x, w_local, target, 64.0, margins),
                     fragment, exception=RuntimeError)
    expect_error(lambda: F_TS.parallel_margin_cross_entropy(x, w_local, target, 0.0),
                 "scale must be a finite number > 0, got 0", exception=RuntimeError)
    expect_error(lambda: F_TS.parallel_margin_cross_entropy(x, w_local, target, 64.0, (1.0, 0.5)),
                 "margins must be (m1, m2, m3)", exception=ValueError)
    for rate in (0.0, 1.5, -1.0):
        expect_error(lambda: ts.nn.ParallelMarginLoss(5, classes, sample_rate=rate),
                     f"sample_rate must be in (0, 1], got {rate}", exception=ValueError)
    # Targets out of range: every rank raises (the flag travels with the
    # statistics), whichever rank's shard the bad value would fall in.
    for bad in (classes, -3):
        wrong = target.clone()
        wrong[1] = bad
        expect_error(lambda: F_TS.parallel_margin_cross_entropy(x, w_local, wrong, num_classes=classes),
                     exception=RuntimeError,
                     match=rf"target values must be in \[0, num_classes={classes}\).*got {bad}")
    # Only rank 0's weight is too short for its shard: every rank raises.
    short = w_local[:-1] if ts.distributed.get_group_rank() == 0 else w_local
    expect_error(lambda: F_TS.parallel_margin_cross_entropy(x, short, target, num_classes=classes),
                 exception=RuntimeError, match="shard of num_classes|group rank 0 failed a check")
    # The group is still usable: nobody was left inside a collective.
    F_TS.parallel_margin_cross_entropy(x, w_local, target, num_classes=classes)


# ---------------------------------------------------------------- class sampling (PartialFC)

def _global_kept(loss_fn):
    """Every rank's kept classes as sorted global indices."""
    import torch.distributed as dist

    lo, _ = shard_range(loss_fn.num_classes)
    mine = (loss_fn.last_sampled_classes + lo).tolist()
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return torch.tensor(sorted(c for kept in everyone for c in kept), dtype=torch.int64)


def _sampled_loss(classes, features, rate, seed, **kwargs):
    torch.manual_seed(seed)
    loss_fn = ts.nn.ParallelMarginLoss(features, classes, scale=16.0, sample_rate=rate, dtype=torch.float64,
                                       chunk_size=3, seed=seed, **kwargs)
    torch.manual_seed(seed)
    full = torch.empty(classes, features, dtype=torch.float64).normal_(0, 0.01)
    return loss_fn, full


def case_sampled_loss_and_gradients_equal_the_reference_on_kept_classes():
    size = _size()
    classes, features = 10 * size + 3, 5
    lo, hi = shard_range(classes)
    for margins, smoothing, rate in ((PRESETS["arcface"], 0.0, 0.3), (PRESETS["cosface"], 0.1, 0.5),
                                     (PRESETS["combined"], 0.2, 0.05)):
        loss_fn, full = _sampled_loss(classes, features, rate, seed=11, margins=margins,
                                      label_smoothing=smoothing)
        g = torch.Generator().manual_seed(3)
        for step in range(2):
            x = torch.randn(7, features, generator=g, dtype=torch.float64)
            y = torch.randint(0, classes, (7,), generator=g)
            y[5] = -100
            x_a = x.clone().requires_grad_()
            loss_fn.weight.grad = None
            loss = loss_fn(x_a, y)
            loss.backward()
            kept = loss_fn.last_sampled_classes
            positives = torch.unique(y[(y >= lo) & (y < hi)] - lo)
            assert kept.dtype == torch.int64 and torch.equal(kept, kept.sort().values)
            assert torch.isin(positives, kept).all(), (kept, positives)
            assert kept.numel() == max(math.ceil(rate * (hi - lo)), positives.numel()), (kept, rate)
            kept_global = _global_kept(loss_fn)
            x_r, w_r = x.clone().requires_grad_(), full.clone().requires_grad_()
            ref = margin_cross_entropy_reference(x_r, w_r, y, 16.0, margins, label_smoothing=smoothing,
                                                 kept_classes=kept_global)
            ref.backward()
            what = f"margins={margins} rate={rate} step={step}"
            assert_close(loss, ref, torch.float64, "sampled loss " + what)
            assert_close(x_a.grad, x_r.grad, torch.float64, "sampled grad input " + what)
            grad = loss_fn.weight.grad
            assert grad.is_sparse and torch.equal(grad.coalesce().indices()[0], kept), what
            assert_close(grad.to_dense(), shard_of(w_r.grad, 0), torch.float64, "sampled grad weight " + what)


def case_sampling_is_reproducible_under_a_seed():
    classes = 20 * _size()
    y = torch.tensor([0, 3, classes - 1, 7])
    x = torch.randn(4, 6, dtype=torch.float64)
    draws = []
    for seed in (5, 5, 6):
        loss_fn, _ = _sampled_loss(classes, 6, 0.25, seed=seed)
        kept = []
        for _ in range(3):
            loss_fn(x, y)
            kept.append(loss_fn.last_sampled_classes.clone())
        draws.append(kept)
    for a, b in zip(draws[0], draws[1]):
        assert torch.equal(a, b), "the same seed must draw the same classes"
    assert any(not torch.equal(a, b) for a, b in zip(draws[0], draws[2])), "another seed, the same draws"
    assert any(not torch.equal(draws[0][0], d) for d in draws[0][1:]), "each step draws anew"
    loss_fn, _ = _sampled_loss(classes, 6, 0.25, seed=5)
    loss_fn.eval()
    loss_fn(x, y)
    assert loss_fn.last_sampled_classes.numel() == loss_fn.weight.shape[0], "eval mode uses every class"


def _per_row_reference(full, optimizer):
    """Each class row its own parameter: torch's optimizer skips the rows that
    get no gradient, so their values and state stay as they were."""
    rows = [torch.nn.Parameter(r.clone()) for r in full]
    return rows, optimizer(rows)


def case_sampled_training_leaves_rows_not_kept_and_their_state_alone():
    size = _size()
    classes, features = 8 * size + 1, 4
    lo, hi = shard_range(classes)
    makers = {
        "sgd": (lambda p: ts.optim.RowSparseSGD(p, lr=0.3, momentum=0.9, weight_decay=1e-2),
                lambda p: torch.optim.SGD(p, lr=0.3, momentum=0.9, weight_decay=1e-2, foreach=False),
                ("momentum_buffer",)),
        "sgd dampened": (
            lambda p: ts.optim.RowSparseSGD(p, lr=0.3, momentum=0.9, dampening=0.1),
            lambda p: torch.optim.SGD(p, lr=0.3, momentum=0.9, dampening=0.1, foreach=False),
            ("momentum_buffer",)),
        "adam": (lambda p: ts.optim.RowSparseAdam(p, lr=0.05, weight_decay=1e-2),
                 lambda p: torch.optim.Adam(p, lr=0.05, weight_decay=1e-2, foreach=False),
                 ("exp_avg", "exp_avg_sq")),
    }
    for name, (ours, theirs, state_names) in makers.items():
        loss_fn, full = _sampled_loss(classes, features, 0.2, seed=2, margins=PRESETS["arcface"])
        opt = ours(loss_fn.parameters())
        rows, opt_ref = _per_row_reference(full, theirs)
        g = torch.Generator().manual_seed(9)
        ever_kept = torch.zeros(hi - lo, dtype=torch.bool)
        for step in range(4):
            x = torch.randn(5, features, generator=g, dtype=torch.float64)
            y = torch.randint(0, classes, (5,), generator=g)
            opt.zero_grad()
            loss_fn(x, y).backward()
            kept = loss_fn.last_sampled_classes
            not_kept = torch.ones(hi - lo, dtype=torch.bool)
            not_kept[kept] = False
            before = loss_fn.weight.detach()[not_kept].clone()
            state_before = {n: opt.state[loss_fn.weight][n][not_kept].clone()
                            for n in state_names if loss_fn.weight in opt.state}
            has_steps = "row_step" in opt.state.get(loss_fn.weight, {})
            steps_before = opt.state[loss_fn.weight]["row_step"][not_kept].clone() if has_steps else None
            opt.step()
            assert torch.equal(loss_fn.weight.detach()[not_kept], before), f"{name}: a row not kept moved"
            for n, values in state_before.items():
                assert torch.equal(opt.state[loss_fn.weight][n][not_kept], values), f"{name}: {n} of a row not kept"
            if steps_before is not None:
                assert torch.equal(opt.state[loss_fn.weight]["row_step"][not_kept], steps_before), name
            ever_kept[kept] = True
            # The reference: the same loss over the kept rows, each row its own parameter.
            kept_global = _global_kept(loss_fn)
            opt_ref.zero_grad(set_to_none=True)
            margin_cross_entropy_reference(x, torch.stack(rows), y, 16.0, PRESETS["arcface"],
                                           kept_classes=kept_global).backward()
            for c, row in enumerate(rows):
                if not bool((kept_global == c).any()):
                    row.grad = None  # not in the loss: no gradient at all
            opt_ref.step()
            mine = torch.stack([r.detach() for r in rows])[lo:hi]
            assert_close(loss_fn.weight, mine, torch.float64, f"{name}: weight after step {step}")
        for n in state_names:
            ref_state = torch.stack([opt_ref.state[r][n] if r in opt_ref.state else torch.zeros_like(r)
                                     for r in rows[lo:hi]])
            assert_close(opt.state[loss_fn.weight][n], ref_state, torch.float64, f"{name}: {n}")
        if name == "adam":
            ref_steps = torch.tensor([int(opt_ref.state[r]["step"]) if r in opt_ref.state else 0
                                      for r in rows[lo:hi]])
            assert torch.equal(opt.state[loss_fn.weight]["row_step"], ref_steps), name
        untouched = ~ever_kept
        assert torch.equal(loss_fn.weight.detach()[untouched], full[lo:hi][untouched]), name
