"""parallel_topk and parallel_linear_topk against a stable descending sort of
the gathered logits (torch.topk's values, ties to the lower class index), at
even and uneven class splits, with ties, -inf and k beyond a rank's share."""
import torch
import torch.distributed as dist

import shardtorch as ts
from tests.reference import expect_error


def _reference(full: torch.Tensor, k: int):
    values, indices = torch.sort(full, dim=-1, descending=True, stable=True)
    return values[..., :k], indices[..., :k]


def _my_slice(classes: int):
    start, stop = ts.utils.shards.shard_range(classes, dist.get_world_size(), dist.get_rank())
    return slice(start, stop)


def _check(got, full, k):
    values, indices = _reference(full, k)
    assert torch.equal(got[1], indices), (got[1], indices)
    assert torch.equal(got[0], values)
    assert got[0].dtype == full.dtype and got[1].dtype == torch.long


def case_topk_equals_a_stable_sort_of_the_gathered_logits():
    torch.manual_seed(0)
    for classes in (7, 12, 30):  # uneven and even over 2 and 3 ranks
        for k in (1, 3, 5):
            # Few distinct values: many ties, across ranks too.
            full = torch.randint(-3, 3, (4, classes)).to(torch.float64)
            full[0, :] = 1.0  # a row of one value: the k lowest indices
            full[1, classes // 2:] = float("-inf")
            _check(ts.nn.functional.parallel_topk(full[:, _my_slice(classes)], k), full, k)


def case_topk_keeps_leading_dims_and_half_precision():
    torch.manual_seed(1)
    full = torch.randn(2, 3, 11).to(torch.bfloat16)
    _check(ts.nn.functional.parallel_topk(full[..., _my_slice(11)], 4), full, 4)


def case_k_beyond_a_ranks_share_and_empty_shards():
    torch.manual_seed(2)
    classes = dist.get_world_size() + 1  # a rank holds 1 or 2 classes
    full = torch.randn(3, classes, dtype=torch.float64)
    _check(ts.nn.functional.parallel_topk(full[:, _my_slice(classes)], classes), full, classes)
    # Fewer classes than ranks: the last rank holds none.
    few = torch.randn(2, dist.get_world_size() - 1, dtype=torch.float64)
    _check(ts.nn.functional.parallel_topk(few[:, _my_slice(few.size(1))], 1), few, 1)


def case_linear_topk_equals_the_top_of_the_full_classifier():
    torch.manual_seed(3)
    for classes, chunk in ((13, 4), (40, 64)):
        x = torch.randn(5, 6, dtype=torch.float64)
        weight = torch.randn(classes, 6, dtype=torch.float64)
        bias = torch.randn(classes, dtype=torch.float64)
        mine = _my_slice(classes)
        got = ts.nn.functional.parallel_linear_topk(x, weight[mine], bias[mine], k=5, chunk_size=chunk)
        # (a product over a chunk of rows may round differently from the whole)
        values, indices = _reference(x @ weight.t() + bias, 5)
        assert torch.equal(got[1], indices)
        torch.testing.assert_close(got[0], values, rtol=0, atol=1e-13)
        cosine = torch.nn.functional.normalize(x, dim=-1) @ torch.nn.functional.normalize(weight, dim=-1).t()
        got = ts.nn.functional.parallel_linear_topk(x, weight[mine], k=3, normalize=True, chunk_size=chunk)
        values, indices = _reference(cosine, 3)
        assert torch.equal(got[1], indices)
        torch.testing.assert_close(got[0], values, rtol=0, atol=1e-15)


def case_linear_topk_ties_go_to_the_lower_class():
    x = torch.ones(2, 3, dtype=torch.float64)
    weight = torch.zeros(9, 3, dtype=torch.float64)  # every logit 0
    got = ts.nn.functional.parallel_linear_topk(x, weight[_my_slice(9)], k=4, chunk_size=2)
    assert got[1].tolist() == [[0, 1, 2, 3]] * 2


def case_bad_k_fails_clearly_on_every_rank():
    logits = torch.randn(2, 5 if dist.get_rank() == 0 else 4)
    total = 5 + 4 * (dist.get_world_size() - 1)
    expect_error(lambda: ts.nn.functional.parallel_topk(logits, total + 1),
                 f"k must be at most the number of classes {total}, got {total + 1}", exception=ValueError)
    expect_error(lambda: ts.nn.functional.parallel_topk(logits, 0), "k must be a positive int", exception=ValueError)
    expect_error(lambda: ts.nn.functional.parallel_linear_topk(torch.randn(2, 3), torch.randn(4, 5)),
                 "must agree", exception=ValueError)
