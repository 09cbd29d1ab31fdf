"""ts.nn.parallelize on real ranks: whole models (Hugging Face GPT-2, Llama,
BERT, timm ViT, a minGPT-style model) sharded in one call against the same
model unsharded, in float64: logits, loss, every parameter's gradient
(collected), and every parameter after 5 AdamW steps."""
import collections
import os
import tempfile

import torch
import torch.nn.functional as F

import shardtorch as ts
from tests.distributed import parallelize_models as models
from tests.reference import assert_close, expect_error

F64 = torch.float64
STEPS = 5


def _pair(build):
    """(reference, parallelized): the same weights, drawn under one seed."""
    torch.manual_seed(0)
    ref = build().to(F64)
    torch.manual_seed(0)
    par = build().to(F64)
    ts.nn.parallelize(par)
    return ref, par


def _tokens(seed=1, batch=3):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, models.VOCAB, (batch, models.SEQ), generator=generator)
    labels = ids.clone()
    labels[0, 2] = -100
    labels[1, :3] = -100
    return ids, labels


def _whole(logits, sharded):
    if not sharded:
        return logits.detach()
    assert ts.utils.get_parallel_dim(logits) == -1, "sharded logits are not marked"
    with torch.no_grad():
        return ts.distributed.gather_replicated(logits.detach(), -1, full_size=models.VOCAB)


def _causal_reference_loss(logits, labels):
    shifted = F.pad(labels, (0, 1), value=-100)[..., 1:]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), shifted.reshape(-1), ignore_index=-100)


def _sharded_loss(logits, labels):
    return ts.nn.functional.parallel_cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                                   parallel=True, num_classes=models.VOCAB)


def _causal_step(model, parallel, seed):
    ids, labels = _tokens(seed)
    if parallel:
        out = model(input_ids=ids, labels=labels)
        return out.loss, _whole(out.logits, True)
    logits = model(input_ids=ids).logits
    return _causal_reference_loss(logits, labels), logits.detach()


def _masked_step(model, parallel, seed):
    ids, labels = _tokens(seed)
    labels[:, ::2] = -100
    logits = model(input_ids=ids).logits
    if parallel:
        return _sharded_loss(logits, labels), _whole(logits, True)
    return F.cross_entropy(logits.reshape(-1, models.VOCAB), labels.reshape(-1)), logits.detach()


def _image_step(model, parallel, seed):
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(2, 3, 16, 16, generator=generator, dtype=F64)
    target = torch.randint(0, 10, (2,), generator=generator)
    logits = model(images)
    return F.cross_entropy(logits, target), logits.detach()


def _plain_lm_step(model, parallel, seed):
    ids, labels = _tokens(seed)
    logits = model(ids)
    if parallel:
        return _sharded_loss(logits, labels), _whole(logits, True)
    return F.cross_entropy(logits.reshape(-1, models.VOCAB), labels.reshape(-1)), logits.detach()


def collected_grads(model):
    """The gradients as the unsharded model's state dict would hold them."""
    params = dict(model.named_parameters(remove_duplicate=False))
    grads = collections.OrderedDict()
    for key, value in model.state_dict().items():
        if key in params:
            grad = params[key].grad
            grads[key] = torch.zeros_like(params[key]) if grad is None else grad
        else:
            grads[key] = value
    return ts.collect_state_dict(model, grads)


def check_against_unsharded(build, step, name):
    ref, par = _pair(build)
    loss_ref, logits_ref = step(ref, False, 1)
    loss_par, logits_par = step(par, True, 1)
    assert_close(logits_par, logits_ref, F64, f"{name} logits")
    assert_close(loss_par.detach(), loss_ref.detach(), F64, f"{name} loss")
    loss_ref.backward()
    loss_par.backward()
    grads = collected_grads(par)
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    assert set(ref_params) <= set(grads), f"{name}: parameters missing from the collected gradients"
    for key, param in ref_params.items():
        expected = torch.zeros_like(param) if param.grad is None else param.grad
        assert_close(grads[key], expected, F64, f"{name} gradient of {key}")
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, par)]
    for index in range(STEPS):
        for model, optimizer, parallel in ((ref, optimizers[0], False), (par, optimizers[1], True)):
            optimizer.zero_grad()
            step(model, parallel, 10 + index)[0].backward()
            optimizer.step()
    collected = ts.collect_state_dict(par, par.state_dict())
    for key, value in ref.state_dict().items():
        assert_close(collected[key], value, F64, f"{name} {key} after {STEPS} AdamW steps")
    return ref, par


def case_gpt2_matches_unsharded():
    check_against_unsharded(models.gpt2, _causal_step, "gpt2")


def case_llama_gqa_matches_unsharded():
    check_against_unsharded(models.llama, _causal_step, "llama kv=4")


def case_llama_fewer_kv_heads_than_ranks_matches_unsharded():
    # 2 key/value heads: split over 2 ranks, replicated over 3 and 4 (8 query heads: 3,3,2 over 3).
    check_against_unsharded(lambda: models.llama(kv_heads=2, heads=8), _causal_step, "llama kv=2")


def case_bert_matches_unsharded():
    check_against_unsharded(models.bert, _masked_step, "bert")


def case_vit_matches_unsharded():
    check_against_unsharded(models.vit, _image_step, "vit")


def case_mingpt_matches_unsharded():
    check_against_unsharded(models.mingpt, _plain_lm_step, "mingpt")
