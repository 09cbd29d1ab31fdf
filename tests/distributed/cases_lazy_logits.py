"""parallelize's default logits="lazy" on real ranks (Gloo, CPU, float64), tiny GPT-2 and Llama against
the same model unsharded: a step that reads only the loss gathers nothing and gives the unsharded loss
and gradients; the logits read on every rank, in any way, are the unsharded model's; a read on rank 0
alone returns them too, also once the other ranks have freed their output; a loss
computed from the lazy logits on every rank gives the unsharded gradients."""
import collections
import copy
import pickle

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import shardtorch as ts
from shardtorch.nn.whole_model.lazy_logits import LazyLogits
from tests.distributed import parallelize_models as models
from tests.distributed.cases_parallelize import collected_grads
from tests.reference import assert_close

F64 = torch.float64
BUILDS = {"gpt2": models.gpt2, "llama": models.llama}


def _pair(build):
    torch.manual_seed(0)
    reference = build().to(F64)
    torch.manual_seed(0)
    return reference, ts.nn.parallelize(build().to(F64))  # the default: logits="lazy"


def _batch():
    ids = torch.randint(0, models.VOCAB, (3, models.SEQ), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[1, :3] = -100
    return ids, labels


def _causal_loss(logits, labels):
    shifted = F.pad(labels, (0, 1), value=-100)[..., 1:]
    return F.cross_entropy(logits.reshape(-1, models.VOCAB), shifted.reshape(-1), ignore_index=-100)


class _ShardOps(TorchDispatchMode):
    """Counts the shard:: ops (the collectives) a block calls."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "shard":
            self.counts[func.__name__.split(".")[0]] += 1
        return func(*args, **(kwargs or {}))


def _shard_ops(run):
    """({shard op: calls}, run's result)."""
    with _ShardOps() as mode:
        result = run()
    return mode.counts, result


def _reference_grads(reference):
    return {key: p.grad for key, p in reference.named_parameters(remove_duplicate=False)}


def _check_grads(model, reference, what):
    grads = collected_grads(model)
    for key, expected in _reference_grads(reference).items():
        assert_close(grads[key], expected, F64, f"{what}: gradient of {key}")


def case_loss_only_step_gathers_no_logits_and_matches_unsharded():
    ids, labels = _batch()
    for name, build in BUILDS.items():
        reference, model = _pair(build)
        torch.manual_seed(0)
        sharded = ts.nn.parallelize(build().to(F64), logits="sharded")
        sharded(input_ids=ids, labels=labels)  # the first training forward checks the inputs (one all-gather)
        model(input_ids=ids, labels=labels)
        expected, _ = _shard_ops(lambda: sharded(input_ids=ids, labels=labels))
        model.zero_grad()
        ops, out = _shard_ops(lambda: model(input_ids=ids, labels=labels))
        assert ops == expected and "gather_replicated" not in ops, \
            f"{name}: {dict(ops)} with lazy logits, {dict(expected)} with sharded"
        assert isinstance(out.logits, LazyLogits) and out.logits.shape == (3, models.SEQ, models.VOCAB)
        reference_loss = _causal_loss(reference(input_ids=ids).logits, labels)  # in float64 (HF's upcasts to 32)
        assert_close(out.loss.detach(), reference_loss.detach(), F64, f"{name} loss")
        reference_loss.backward()
        out.loss.backward()
        assert out.logits._whole is None, f"{name}: the logits were gathered though never read"
        _check_grads(model, reference, name)


def case_logits_read_on_every_rank_are_unsharded():
    ids, labels = _batch()
    for name, build in BUILDS.items():
        reference, model = _pair(build)
        with torch.no_grad():
            expected = reference(input_ids=ids).logits
            for out in (model(input_ids=ids), model(input_ids=ids, labels=labels)):
                logits = out.logits
                assert (logits.shape, logits.dtype, logits.device) == (expected.shape, F64, expected.device)
                assert_close(logits + 0, expected, F64, f"{name} logits")
                assert torch.equal(logits.argmax(-1), expected.argmax(-1)), name
                assert_close(logits[:, -1, 5:9], expected[:, -1, 5:9], F64, f"{name} slice")
                assert torch.equal(logits > 0, expected > 0), name
                assert abs(logits[0, 0, 0].item() - expected[0, 0, 0].item()) < 1e-12, name
                assert_close(torch.from_numpy(logits.numpy()), expected, F64, f"{name} numpy")
                assert_close(torch.tensor(logits.tolist(), dtype=F64), expected, F64, f"{name} tolist")
                assert_close(pickle.loads(pickle.dumps(logits)), expected, F64, f"{name} pickled")
                assert_close(copy.deepcopy(logits), expected, F64, f"{name} deepcopy")
                assert "tensor(" in repr(logits), name


def case_read_on_rank_zero_alone_gives_whole_logits():
    """Rank 0 reads, rank 1 does not: the whole logits, while rank 1 goes on to its next forward, and also
    after rank 1 has freed its output (never a hang, never a shard)."""
    ids, _ = _batch()
    rank = ts.distributed.get_group_rank()
    for name, build in BUILDS.items():
        reference, model = _pair(build)
        with torch.no_grad():
            expected = reference(input_ids=ids).logits
            out = model(input_ids=ids)
            if rank == 0:
                assert torch.equal(out.logits.argmax(-1), expected.argmax(-1)), name
                assert_close(out.logits[:, -1], expected[:, -1], F64, f"{name} rank 0's read")
            following = model(input_ids=ids)  # the other ranks go on meanwhile
            if rank != 0:
                del following
            dist.barrier()  # the other ranks have freed the second output
            if rank == 0:
                assert_close(following.logits[:, 1:3], expected[:, 1:3], F64, f"{name} read after the peers freed")
                del following
            del out
            model(input_ids=ids)  # the group goes on


def case_loss_over_lazy_logits_gives_unsharded_gradients():
    ids, labels = _batch()
    for name, build in BUILDS.items():
        reference, model = _pair(build)
        loss = F.cross_entropy(model(input_ids=ids).logits.view(-1, models.VOCAB), labels.view(-1))
        reference_loss = F.cross_entropy(reference(input_ids=ids).logits.view(-1, models.VOCAB), labels.view(-1))
        assert_close(loss.detach(), reference_loss.detach(), F64, f"{name} user loss")
        loss.backward()
        reference_loss.backward()
        _check_grads(model, reference, f"{name} user loss")


def case_generate_and_explicit_modes_keep_their_logits():
    """generate reads whole logits (gathered eagerly inside it); "whole" returns plain gathered logits and
    "sharded" the shards, as before "lazy" became the default."""
    ids, _ = _batch()
    reference, model = _pair(models.llama)
    with torch.no_grad():
        expected = reference.generate(ids, max_new_tokens=3, do_sample=False)
        assert torch.equal(model.generate(ids, max_new_tokens=3, do_sample=False), expected)
        logits = reference(input_ids=ids).logits
        torch.manual_seed(0)
        whole = ts.nn.parallelize(models.llama().to(F64), logits="whole")(input_ids=ids).logits
        assert type(whole) is torch.Tensor and whole.shape[-1] == models.VOCAB
        assert_close(whole, logits, F64, "logits='whole'")
        torch.manual_seed(0)
        shard = ts.nn.parallelize(models.llama().to(F64), logits="sharded")(input_ids=ids).logits
        assert type(shard) is torch.Tensor and shard.shape[-1] < models.VOCAB
