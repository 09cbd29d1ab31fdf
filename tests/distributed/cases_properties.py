"""Property-based cases (hypothesis) on real ranks, against unsharded torch.

Each case runs a bounded, derandomized hypothesis search: every rank draws the
same examples in the same order (derandomize=True seeds from the test's code),
so the ranks call the same collectives. Shrinking is off: a rank that shrank
differently from its peers would call different collectives. Tolerance: 1e-10
in float64 (tests/reference.py's tolerance for other dtypes)."""
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import shardtorch as ts
from tests.distributed.cases_linear import _check_layer
from tests.reference import cross_entropy_reference, shard_of, tolerance

EXAMPLES = 25
SETTINGS = settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
                    phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck),
                    print_blob=False)


def _close(actual, expected, dtype, what):
    rtol, atol = tolerance(dtype)
    torch.testing.assert_close(actual.double(), expected.double(), rtol=rtol, atol=atol, equal_nan=True,
                               msg=lambda m: f"{what}: {m}")


def _counter():
    return {"n": 0}


# Features from 1 (fewer than the ranks: empty shards) to uneven and even splits.
features = st.integers(min_value=1, max_value=13)
batch_shapes = st.sampled_from([(1,), (5,), (2, 3), (0,)])


def case_parallel_linear_matches_nn_linear():
    seen = _counter()

    @SETTINGS
    @given(in_f=features, out_f=features, bias=st.booleans(), dim=st.sampled_from([0, 1, -1, None]),
           dtype=st.sampled_from([torch.float64, torch.float64, torch.float64, torch.float32]),
           batch=batch_shapes, whole=st.booleans())
    def check(in_f, out_f, bias, dim, dtype, batch, whole):
        seen["n"] += 1
        _check_layer(in_f, out_f, bias, dim, dtype, batch, whole_input=whole or dim != 0)

    check()
    assert seen["n"] >= EXAMPLES // 2, seen




@st.composite
def ce_inputs(draw):
    classes = draw(st.integers(min_value=1, max_value=4 * ts.distributed.get_group_size() + 3))
    lead = draw(st.sampled_from([(1,), (6,), (2, 3), (0,)]))
    ignore_index = draw(st.sampled_from([-100, -1, 0, 2]))
    rows = 1
    for n in lead:
        rows *= n
    targets = draw(st.lists(st.one_of(st.integers(0, classes - 1), st.just(ignore_index)),
                            min_size=rows, max_size=rows))
    # ignore_index may be a valid class (then those rows are ignored, as in F.cross_entropy),
    # or negative and out of range; other targets are always valid.
    targets = [t for t in targets]
    return dict(
        classes=classes, lead=lead, ignore_index=ignore_index, targets=targets,
        reduction=draw(st.sampled_from(["mean", "sum", "none"])),
        label_smoothing=draw(st.sampled_from([0.0, 0.0, 0.1, 0.37, 1.0])),
        weighted=draw(st.booleans()),
        weight_shard=draw(st.booleans()),
        z_loss=draw(st.sampled_from([0.0, 0.0, 1e-3])),
        scale=draw(st.sampled_from([1.0, 30.0])),
        seed=draw(st.integers(0, 2**31 - 1)),
        marked=draw(st.booleans()),
        num_classes_known=draw(st.booleans()),
    )


def case_parallel_cross_entropy_matches_f_cross_entropy():
    seen = _counter()

    @SETTINGS
    @given(ex=ce_inputs())
    def check(ex):
        seen["n"] += 1
        classes, lead = ex["classes"], ex["lead"]
        gen = torch.Generator().manual_seed(ex["seed"])
        full = (torch.randn(*lead, classes, generator=gen, dtype=torch.float64) * ex["scale"])
        target = torch.tensor(ex["targets"], dtype=torch.long).reshape(lead)
        weight = torch.rand(classes, generator=gen, dtype=torch.float64) + 0.1 if ex["weighted"] else None
        upstream = torch.randn(*lead, generator=gen, dtype=torch.float64)
        kwargs = dict(ignore_index=ex["ignore_index"], reduction=ex["reduction"],
                      label_smoothing=ex["label_smoothing"], z_loss=ex["z_loss"])

        ref_in = full.clone().requires_grad_()
        expected = cross_entropy_reference(ref_in, target, weight=weight, **kwargs)
        (expected * upstream if ex["reduction"] == "none" else expected).sum().backward()

        mine = shard_of(full, -1).clone().requires_grad_()
        logits = ts.utils.register_parallel_dim(mine, -1) if ex["marked"] else mine
        w = None if weight is None else (shard_of(weight, 0) if ex["weight_shard"] else weight)
        loss = ts.nn.functional.parallel_cross_entropy(
            logits, target, weight=w, parallel=None if ex["marked"] else True,
            num_classes=classes if ex["num_classes_known"] else None, **kwargs)
        what = f"{ex}"
        _close(loss, expected, torch.float64, "loss " + what)
        (loss * upstream if ex["reduction"] == "none" else loss).sum().backward()
        _close(mine.grad, shard_of(ref_in.grad, -1), torch.float64, "grad " + what)

    check()
    assert seen["n"] >= EXAMPLES // 2, seen


def case_parallel_linear_cross_entropy_matches_unsharded():
    seen = _counter()

    @SETTINGS
    @given(ex=ce_inputs(), in_f=st.integers(1, 7), bias=st.booleans(), chunk=st.integers(1, 6))
    def check(ex, in_f, bias, chunk):
        seen["n"] += 1
        classes, lead = ex["classes"], ex["lead"]
        gen = torch.Generator().manual_seed(ex["seed"])
        x = torch.randn(*lead, in_f, generator=gen, dtype=torch.float64)
        W = torch.randn(classes, in_f, generator=gen, dtype=torch.float64)
        b = torch.randn(classes, generator=gen, dtype=torch.float64) if bias else None
        target = torch.tensor(ex["targets"], dtype=torch.long).reshape(lead)
        weight = torch.rand(classes, generator=gen, dtype=torch.float64) + 0.1 if ex["weighted"] else None
        kwargs = dict(ignore_index=ex["ignore_index"], reduction=ex["reduction"],
                      label_smoothing=ex["label_smoothing"], z_loss=ex["z_loss"])

        xr, Wr = x.clone().requires_grad_(), W.clone().requires_grad_()
        br = b.clone().requires_grad_() if bias else None
        expected = cross_entropy_reference(F.linear(xr, Wr, br), target, weight=weight, **kwargs)
        expected.sum().backward()

        xs = x.clone().requires_grad_()
        Ws = shard_of(W, 0).clone().requires_grad_()
        bs = shard_of(b, 0).clone().requires_grad_() if bias else None
        w = None if weight is None else (shard_of(weight, 0) if ex["weight_shard"] else weight)
        loss = ts.nn.functional.parallel_linear_cross_entropy(
            xs, Ws, bs, target, class_weight=w, chunk_size=chunk,
            num_classes=classes if ex["num_classes_known"] else None, **kwargs)
        what = f"{ex} in={in_f} bias={bias} chunk={chunk}"
        _close(loss, expected, torch.float64, "loss " + what)
        loss.sum().backward()
        _close(xs.grad, xr.grad, torch.float64, "grad input " + what)
        _close(Ws.grad, shard_of(Wr.grad, 0), torch.float64, "grad weight " + what)
        if bias:
            _close(bs.grad, shard_of(br.grad, 0), torch.float64, "grad bias " + what)

    check()
    assert seen["n"] >= EXAMPLES // 2, seen
