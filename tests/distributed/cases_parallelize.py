"""ts.nn.parallelize on real ranks: whole models (Hugging Face GPT-2, Llama,
BERT, timm ViT, a minGPT-style model) sharded in one call against the same
model unsharded, in float64: logits, loss, every parameter's gradient
(collected), and every parameter after 5 AdamW steps."""
import collections
import tempfile

import torch
import torch.nn.functional as F

import shardtorch as ts
from shardtorch.nn.whole_model import unplaced
from tests.distributed import parallelize_models as models
from tests.reference import assert_close, expect_error

F64 = torch.float64
STEPS = 5


def _pair(build, **options):
    """(reference, parallelized): the same weights, drawn under one seed."""
    torch.manual_seed(0)
    ref = build().to(F64)
    torch.manual_seed(0)
    par = build().to(F64)
    options.setdefault("logits", "sharded")  # these cases check the parallel loss on the shards
    ts.nn.parallelize(par, **options)
    return ref, par


def _tokens(seed=1, batch=3):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, models.VOCAB, (batch, models.SEQ), generator=generator)
    labels = ids.clone()
    labels[0, 2] = -100
    labels[1, :3] = -100
    return ids, labels


def _whole(logits, sharded):
    """The logits whole, for comparison (not part of the model's own collectives): a parallelized
    model returns them whole (parallelize's default) or as marked shards (logits="sharded")."""
    if not sharded or logits.shape[-1] == models.VOCAB:
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


def _causal_step(model, parallel, seed, whole=True):
    ids, labels = _tokens(seed)
    if parallel:
        out = model(input_ids=ids, labels=labels)
        return out.loss, _whole(out.logits, whole)
    logits = model(input_ids=ids).logits
    return _causal_reference_loss(logits, labels), logits.detach()


def _masked_step(model, parallel, seed, whole=True):
    ids, labels = _tokens(seed)
    labels[:, ::2] = -100
    logits = model(input_ids=ids).logits
    if parallel:
        return _sharded_loss(logits, labels), _whole(logits, whole)
    return F.cross_entropy(logits.reshape(-1, models.VOCAB), labels.reshape(-1)), logits.detach()


def _image_step(model, parallel, seed, whole=True):
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(2, 3, 16, 16, generator=generator, dtype=F64)
    target = torch.randint(0, 10, (2,), generator=generator)
    logits = model(images)
    return F.cross_entropy(logits, target), logits.detach()


def _plain_lm_step(model, parallel, seed, whole=True):
    ids, labels = _tokens(seed)
    logits = model(ids)
    if parallel:
        return _sharded_loss(logits, labels), _whole(logits, whole)
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


#: Per launch: the unsharded model's run for each reference name (the same whatever the parallel options),
#: and each parallelized model already checked with the default options, so that cases share them.
_REFERENCE_RUNS = {}
_CHECKED = {}


def _reference_run(build, step, reference):
    """(loss, logits, {parameter: gradient}, state dict after STEPS AdamW steps) of the unsharded model."""
    if reference not in _REFERENCE_RUNS:
        torch.manual_seed(0)
        ref = build().to(F64)
        loss, logits = step(ref, False, 1)
        loss.backward()
        grads = {key: torch.zeros_like(p) if p.grad is None else p.grad.clone()
                 for key, p in ref.named_parameters(remove_duplicate=False)}
        optimizer = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        for index in range(STEPS):
            optimizer.zero_grad()
            step(ref, False, 10 + index)[0].backward()
            optimizer.step()
        trained = {key: value.clone() for key, value in ref.state_dict().items()}
        _REFERENCE_RUNS[reference] = (loss.detach(), logits, grads, trained)
    return _REFERENCE_RUNS[reference]


def check_against_unsharded(build, step, name, reference=None, **options):
    """Asserts that ``build()`` parallelized with ``options`` gives the unsharded model's logits, loss and
    gradients, and its parameters after STEPS AdamW steps; returns the trained parallelized model.
    ``reference``: the name of the unsharded run to compare with (default ``name``)."""
    if not options and name in _CHECKED:
        return _CHECKED[name]
    loss_ref, logits_ref, grads_ref, trained_ref = _reference_run(build, step, reference or name)
    torch.manual_seed(0)
    par = build().to(F64)
    options.setdefault("logits", "sharded")  # these cases check the parallel loss on the shards
    ts.nn.parallelize(par, **options)
    loss_par, logits_par = step(par, True, 1)
    assert_close(logits_par, logits_ref, F64, f"{name} logits")
    assert_close(loss_par.detach(), loss_ref, F64, f"{name} loss")
    loss_par.backward()
    grads = collected_grads(par)
    assert set(grads_ref) <= set(grads), f"{name}: parameters missing from the collected gradients"
    for key, expected in grads_ref.items():
        assert_close(grads[key], expected, F64, f"{name} gradient of {key}")
    optimizer = torch.optim.AdamW(par.parameters(), lr=1e-2)
    for index in range(STEPS):
        optimizer.zero_grad()
        step(par, True, 10 + index)[0].backward()
        optimizer.step()
    collected = ts.collect_state_dict(par, par.state_dict())
    for key, value in trained_ref.items():
        assert_close(collected[key], value, F64, f"{name} {key} after {STEPS} AdamW steps")
    if not options:
        _CHECKED[name] = par
    return par


def check_relocated(build, step, what):
    """A full state dict on rank 0 relocated into a parallelized model of other weights gives the logits of
    the unsharded model holding it."""
    torch.manual_seed(123)
    source = build().to(F64)
    torch.manual_seed(7)
    target = ts.nn.parallelize(build().to(F64), logits="sharded")  # the steps compute the parallel loss
    full = source.state_dict() if ts.distributed.get_rank() == 0 else None
    target.load_state_dict(ts.relocate_state_dict(target, full, src=0), strict=True)
    assert_close(step(target, True, 3)[1], step(source, False, 3)[1], F64, what)


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


def _collectives(run):
    """{collective: count} that ``run`` issued on this rank: the Gloo process
    group's own profiler events (every collective of the C++ core goes through
    it), as "all_reduce", "all_gather", ..., and the shardtorch mapping ops
    called, as "shard::all_gather", ... (on CPU a reduce-scatter runs as a Gloo
    all-reduce, and an all-gather of uneven shards as two Gloo all-gathers, so
    sequence parallelism is counted by its ops)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        result = run()
    # Gloo's "gloo:<collective>" events and the shared-memory path's "shm:<collective>": what crossed processes.
    counts = collections.Counter(e.name.partition(":")[2] if e.name.startswith(("gloo:", "shm:")) else e.name
                                 for e in prof.events() if e.name.startswith(("gloo:", "shm:", "shard::")))
    return counts, result


def _check_collective_count(build, step, layers, name, vocab_embedding=True, vocab_head=True, kv_replicated=False,
                            sequence_parallel=False):
    torch.manual_seed(0)
    model = build().to(F64)
    # The training configuration that reads only the loss, counted on the shards themselves.
    ts.nn.parallelize(model, sequence_parallel=sequence_parallel, logits="sharded")
    ts.distributed.reduce(torch.zeros(1))  # the group's shared memory segment, set up once, not counted
    first, _ = _collectives(lambda: step(model, True, 1, whole=False))  # the steady state is counted below
    forward, (loss, _) = _collectives(lambda: step(model, True, 1, whole=False))
    assert first["all_gather"] == forward["all_gather"] + 1 and first["all_reduce"] == forward["all_reduce"], (
        f"{name}: the first training forward checks that the ranks' inputs agree (one all-gather, once): first "
        f"{dict(first)}, then {dict(forward)}")
    backward, _ = _collectives(lambda: loss.backward())
    # Megatron's minimum per block: forward one all-reduce after each row-parallel projection, backward one for
    # each block input's gradient (q/k/v, or gate/up, share it). Plus the embedding's forward all-reduce and the
    # LM head input's backward all-reduce; the vocabulary-parallel loss adds one all-gather of row statistics.
    if sequence_parallel:
        # Per block: an all-gather before the attention and the MLP, a reduce-scatter after each, both ways;
        # the region's end gathers the sequence (forward), its start slices it (all-gather backward).
        for counts, way in ((forward, "forward"), (backward, "backward")):
            assert counts["shard::all_gather"] == 2 * layers, f"{name}: {way} {dict(counts)}"
            assert counts["shard::reduce_scatter"] == 2 * layers, f"{name}: {way} {dict(counts)}"
            assert counts["shard::gather_replicated"] == 1, f"{name}: {way} {dict(counts)}"
        # No all-reduce forward but the vocabulary embedding's own.
        assert forward["shard::reduce"] == int(vocab_embedding) and forward["shard::copy"] == 0, \
            f"{name}: forward {dict(forward)}"
        return
    expected_forward = 2 * layers + int(vocab_embedding)
    expected_backward = 2 * layers + int(vocab_head) + (2 * layers if kv_replicated else 0)
    assert forward["all_reduce"] == expected_forward, f"{name}: forward all-reduces {dict(forward)}"
    assert backward["all_reduce"] == expected_backward, f"{name}: backward all-reduces {dict(backward)}"
    loss_gathers = 1 if vocab_head else 0
    assert forward["all_gather"] == loss_gathers, f"{name}: forward all-gathers {dict(forward)} (logits gathered?)"
    gloo = {kind for kind in set(forward) | set(backward) if not kind.startswith("shard::")}
    assert gloo <= {"all_reduce", "all_gather"} and backward["all_gather"] == 0, \
        f"{name}: unexpected collectives forward {dict(forward)} backward {dict(backward)}"


def case_collectives_per_block_are_megatron_minimum():
    size = ts.distributed.get_group_size()
    _check_collective_count(models.gpt2, _causal_step, 2, "gpt2")
    _check_collective_count(models.llama, _causal_step, 2, "llama")
    _check_collective_count(lambda: models.llama(kv_heads=2, heads=8), _causal_step, 2,
                            "llama kv=2", kv_replicated=size > 2)
    _check_collective_count(models.bert, _masked_step, 2, "bert")
    _check_collective_count(models.vit, _image_step, 2, "vit", vocab_embedding=False, vocab_head=False)
    _check_collective_count(models.mingpt, _plain_lm_step, 2, "mingpt")


def case_auto_plan_places_every_block_and_sets_local_heads():
    size, rank = ts.distributed.get_group_size(), ts.distributed.get_group_rank()
    model = models.gpt2()
    plan = ts.nn.auto_plan(model)
    assert plan == {"transformer.wte": "vocab", "transformer.h.0.attn": "attention", "transformer.h.0.mlp": "mlp",
                    "transformer.h.1.attn": "attention", "transformer.h.1.mlp": "mlp", "lm_head": "vocab"}, plan
    ts.nn.parallelize(model)
    heads = [len(range(h, 10, size)) for h in range(size)]  # 10 heads, the first 10 % size ranks one more
    attn = model.transformer.h[0].attn
    assert attn.num_heads == heads[rank] and attn.split_size == 6 * heads[rank], (attn.num_heads, heads)
    assert tuple(attn.c_attn.weight.shape) == (60, 3 * 6 * heads[rank]), attn.c_attn.weight.shape
    assert tuple(attn.c_proj.weight.shape) == (6 * heads[rank], 60), attn.c_proj.weight.shape
    assert model.lm_head.weight is model.transformer.wte.weight, "the tied LM head lost its tie"

    llama = models.llama()
    ts.nn.parallelize(llama)
    kv = [len(range(h, 4, size)) for h in range(size)]  # 4 key/value heads; query heads follow in threes
    inner = llama.model.layers[0].self_attn
    assert inner.q_proj.weight.shape[0] == 3 * 4 * kv[rank] and inner.k_proj.weight.shape[0] == 4 * kv[rank]
    assert inner.num_key_value_groups == 3

    bert = models.bert()
    ts.nn.parallelize(bert)
    self_attention = bert.bert.encoder.layer[0].attention.self
    heads = [len(range(h, 5, size)) for h in range(size)]
    assert self_attention.num_attention_heads == heads[rank] and self_attention.all_head_size == 12 * heads[rank]
    assert bert.cls.predictions.bias is bert.cls.predictions.decoder.bias, "BERT's tied decoder bias lost its tie"
    assert bert.cls.predictions.decoder.weight is bert.bert.embeddings.word_embeddings.weight

    vit = models.vit()
    ts.nn.parallelize(vit)
    heads = [len(range(h, 12, size)) for h in range(size)]
    assert vit.blocks[0].attn.num_heads == heads[rank] and vit.blocks[0].attn.attn_dim == 4 * heads[rank]
    assert type(vit.head) is torch.nn.Linear, "the 10-class ViT head should stay whole"


def case_bad_plans_raise_on_every_rank_before_any_collective():
    size = ts.distributed.get_group_size()
    model = models.mingpt()
    expect_error(lambda: ts.nn.parallelize(model, plan={"blocks.9.attn": "attention"}), "'blocks.9.attn'",
                 "names no module", exception=ValueError)
    expect_error(lambda: ts.nn.parallelize(model, plan={"blocks.0.attn": "heads"}), "style must be one of",
                 "'heads'", exception=ValueError)
    expect_error(lambda: ts.nn.parallelize(model, plan={"blocks.0.ln1": "attention"}), "'blocks.0.ln1'",
                 "not a known attention layout", exception=ValueError)
    expect_error(lambda: ts.nn.parallelize(model, plan="everything"), "'auto'", exception=ValueError)
    expect_error(lambda: ts.nn.parallelize(model, plan={"blocks.0.mlp": "mlp"}, sequence_parallel=True),
                 "sequence_parallel=True needs attention modules inside blocks", exception=ValueError)
    # Fewer heads than ranks cannot split: refused, naming the module and the count.
    one_head = models.MinGPT(heads=1)
    expect_error(lambda: ts.nn.parallelize(one_head), "'blocks.0.attn'", f"1 attention heads cannot be split "
                 f"over {size} ranks", exception=ValueError)
    # torch.nn.MultiheadAttention: refused when named, left whole (and listed) by the auto plan.
    layer = torch.nn.TransformerEncoderLayer(24, 4, dim_feedforward=32, batch_first=True)
    expect_error(lambda: ts.nn.parallelize(layer, plan={"self_attn": "attention"}), "'self_attn'",
                 "MultiheadAttention", exception=ValueError)
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ts.nn.parallelize(layer)
    assert any("self_attn (MultiheadAttention)" in str(w.message) for w in caught), [str(w.message) for w in caught]
    assert "self_attn (MultiheadAttention)" in str(unplaced(layer))
    # Nothing was changed by a refused plan, and every rank is still in step.
    assert type(model.blocks[0].attn.key) is torch.nn.Linear
    torch.distributed.barrier()


def case_masked_lm_labels_give_the_unsharded_masked_loss():
    # BertForMaskedLM declares loss_type ForMaskedLM: labels= gives the masked LM loss (no shift) from the
    # shards, where its own forward would have run a whole-vocabulary torch loss on them.
    ref, par = _pair(models.bert)
    ids, labels = _tokens()
    labels[:, ::2] = -100
    expected = ref(input_ids=ids, labels=labels)
    out = par(input_ids=ids, labels=labels)
    assert_close(out.loss.detach(), expected.loss.detach(), F64, "BERT masked LM loss")
    assert list(out.keys())[0] == "loss", list(out.keys())
    as_tuple = par(input_ids=ids, labels=labels, return_dict=False)
    assert_close(as_tuple[0].detach(), expected.loss.detach(), F64, "BERT masked LM loss, return_dict=False")
    # A plain module with a vocabulary head (no Hugging Face output embeddings) gets no hook: its loss is
    # the caller's.
    plain = ts.nn.parallelize(models.mingpt())
    hooks = [hook.__qualname__ for hook in plain._forward_pre_hooks.values()]
    assert all(name.startswith("check_inputs_at_first_training_forward") for name in hooks), hooks


def case_fused_causal_lm_loss_matches_unsharded():
    for build in (models.gpt2, models.llama):
        ref, par = _pair(build)
        ids, labels = _tokens()
        expected = _causal_reference_loss(ref(input_ids=ids).logits, labels)
        expected.backward()
        for fused in (True, False):
            par.zero_grad()
            loss = ts.nn.causal_lm_loss(par, ids, labels, fused=fused)
            assert_close(loss.detach(), expected.detach(), F64, f"{build.__name__} fused={fused} loss")
            loss.backward()
            grads = collected_grads(par)
            for key, param in ref.named_parameters(remove_duplicate=False):
                assert_close(grads[key], param.grad, F64, f"{build.__name__} fused={fused} gradient of {key}")


def case_checkpoints_are_the_unsharded_models_own():
    from transformers import GPT2LMHeadModel
    par = check_against_unsharded(models.gpt2, _causal_step, "gpt2")
    ids, _ = _tokens(5)
    collected = ts.collect_state_dict(par, par.state_dict())
    plain = models.gpt2().to(F64)
    plain.load_state_dict(collected, strict=True)
    logits = _whole(par(input_ids=ids).logits, True)
    assert_close(plain(input_ids=ids).logits.detach(), logits, F64, "plain model loaded from the collected dict")
    # save_pretrained / from_pretrained of the collected model gives the same logits.
    directory = [tempfile.mkdtemp(prefix="parallelize_") if ts.distributed.get_rank() == 0 else None]
    torch.distributed.broadcast_object_list(directory, src=0)
    if ts.distributed.get_rank() == 0:
        plain.save_pretrained(directory[0])
    torch.distributed.barrier()
    reloaded = GPT2LMHeadModel.from_pretrained(directory[0], torch_dtype=F64)
    assert_close(reloaded(input_ids=ids).logits.detach(), logits, F64, "save_pretrained / from_pretrained")
    # An unsharded state dict relocated into a freshly parallelized model (other weights) at this group size.
    for build, step in ((models.gpt2, _causal_step), (models.llama, _causal_step), (models.vit, _image_step),
                        (lambda: models.llama(kv_heads=2, heads=8), _causal_step)):
        check_relocated(build, step, "relocated logits")
    torch.distributed.barrier()
    if ts.distributed.get_rank() == 0:
        import shutil
        shutil.rmtree(directory[0])


def case_verbose_prints_plan_shards_and_memory():
    import contextlib
    import io
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        torch.manual_seed(0)
        model = ts.nn.parallelize(models.gpt2(), verbose=True)
    text = out.getvalue()
    if ts.distributed.get_group_rank() == 0:
        heads = len(range(0, 10, ts.distributed.get_group_size()))
        assert "transformer.h.0.attn: attention (fused c_attn by part)" in text, text
        assert f"transformer.h.0.attn.c_attn.weight: shard (60, {18 * heads}) of (60, 180)" in text, text
        assert "parameters per rank:" in text and "left whole:" in text, text
        assert "labels=: vocabulary-parallel causal LM loss" in text, text
    else:
        assert text == "", text
    assert model is not None


def case_sequence_parallel_matches_unsharded():
    check_against_unsharded(models.gpt2, _causal_step, "gpt2 sp", "gpt2", sequence_parallel=True)
    check_against_unsharded(models.llama, _causal_step, "llama sp", "llama kv=4", sequence_parallel=True)
    check_against_unsharded(lambda: models.llama(kv_heads=2, heads=8), _causal_step, "llama kv=2 sp", "llama kv=2",
                            sequence_parallel=True)
    check_against_unsharded(models.bert, _masked_step, "bert sp", "bert", sequence_parallel=True)
    check_against_unsharded(models.vit, _image_step, "vit sp", "vit", sequence_parallel=True)
    check_against_unsharded(models.mingpt, _plain_lm_step, "mingpt sp", "mingpt", sequence_parallel=True)


def case_sequence_parallel_collectives_per_block():
    _check_collective_count(models.gpt2, _causal_step, 2, "gpt2 sp", sequence_parallel=True)
    _check_collective_count(models.llama, _causal_step, 2, "llama sp", sequence_parallel=True)
    _check_collective_count(models.vit, _image_step, 2, "vit sp", vocab_embedding=False, vocab_head=False,
                            sequence_parallel=True)


def case_optimizer_state_collects_as_the_unsharded_optimizers():
    for build, name in ((models.gpt2, "gpt2"), (lambda: models.llama(kv_heads=2, heads=8), "llama kv=2")):
        ref, par = _pair(build)
        optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, par)]
        for index in range(2):
            for model, optimizer, parallel in ((ref, optimizers[0], False), (par, optimizers[1], True)):
                optimizer.zero_grad()
                _causal_step(model, parallel, 20 + index)[0].backward()
                optimizer.step()
        collected = ts.collect_optimizer_state_dict(par, optimizers[1])
        expected = optimizers[0].state_dict()
        names = [n for n, _ in ref.named_parameters()]
        assert collected["param_groups"][0]["param_names"] == names, collected["param_groups"][0]["param_names"]
        for index, state in expected["state"].items():
            for key in ("exp_avg", "exp_avg_sq"):
                assert_close(collected["state"][index][key], state[key], F64, f"{name} {names[index]} {key}")


def case_attention_dropout_draws_from_the_model_parallel_stream():
    from transformers import GPT2Config, GPT2LMHeadModel
    config = GPT2Config(vocab_size=models.VOCAB, n_positions=16, n_embd=60, n_layer=2, n_head=10, n_inner=88,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.5, attn_implementation="eager")
    ts.random.model_parallel_seed(1234)
    model = ts.nn.parallelize(GPT2LMHeadModel(config).to(F64))
    ids, labels = _tokens()
    model.eval()
    without_dropout = model(input_ids=ids, labels=labels).loss.detach()
    model.train()
    tracker = ts.random.get_rng_tracker()
    stream_before = [s.clone() for s in tracker.get_states()[ts.random.MODEL_PARALLEL]]
    default_before = torch.get_rng_state()
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    stream_after = tracker.get_states()[ts.random.MODEL_PARALLEL]
    # The heads' dropout drew from the model-parallel stream (seeded per rank: masks differ across the
    # group's heads), and nothing drew from the default stream, whose masks the replicated activations share.
    assert not torch.equal(stream_before[0], stream_after[0]), "the model-parallel stream did not advance"
    assert torch.equal(default_before, torch.get_rng_state()), "the default stream advanced inside the heads"
    assert not torch.isclose(loss.detach(), without_dropout), "dropout did not drop anything"
    losses = [torch.zeros((), dtype=F64) for _ in range(ts.distributed.get_group_size())]
    torch.distributed.all_gather(losses, loss.detach(), group=ts.distributed.get_group())
    assert all(torch.equal(value, losses[0]) for value in losses), f"ranks disagree on the loss: {losses}"


class _BiasedExperts(torch.nn.Module):
    """3-D experts with biases (GPT-OSS's kind): a bias on the down projection would be added once per
    rank, so no layout takes them."""

    def __init__(self):
        super().__init__()
        self.gate_up_proj = torch.nn.Parameter(torch.randn(4, 2 * 8, 12))
        self.gate_up_proj_bias = torch.nn.Parameter(torch.randn(4, 2 * 8))
        self.down_proj = torch.nn.Parameter(torch.randn(4, 12, 8))
        self.down_proj_bias = torch.nn.Parameter(torch.randn(4, 12))


class _Zoo(torch.nn.Module):
    def __init__(self):
        super().__init__()
        from timm.layers import Mlp
        self.gpt2_named = torch.nn.Module()  # GPT-2's names, made of nn.Linear: an MLP of known layout
        self.gpt2_named.c_fc, self.gpt2_named.c_proj = torch.nn.Linear(12, 20), torch.nn.Linear(20, 12)
        self.normed = Mlp(12, 20, norm_layer=torch.nn.LayerNorm)  # a norm over the shard between fc1 and fc2
        self.experts = _BiasedExperts()


def case_what_is_left_whole_is_warned_about_and_listed():
    import warnings
    torch.manual_seed(0)  # every model below the same on every rank (parallelize refuses ranks that differ)
    model = _Zoo()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ts.nn.parallelize(model)
    message = " ".join(str(w.message) for w in caught if "parallelize" in str(w.message))
    assert type(model.gpt2_named.c_fc).__name__ == "ColumnProjection", model.gpt2_named
    for expected in ("normed (Mlp): MLP of unknown layout", "experts (_BiasedExperts): experts left whole"):
        assert expected in message, message
        assert expected in unplaced(model), unplaced(model)
    assert "gpt2_named" not in message, message
    # A Hugging Face model parallelized with an empty plan: its attention, MLPs and vocabulary are named.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.manual_seed(0)
        ts.nn.parallelize(models.llama(), plan={})
    message = " ".join(str(w.message) for w in caught)
    # StableLM's per-head layer norms, one per head in a list: its forward would pair this rank's heads
    # with the list's first norms, so its attention stays whole.
    from transformers import StableLmConfig, StableLmForCausalLM
    torch.manual_seed(0)
    stablelm = StableLmForCausalLM(StableLmConfig(vocab_size=97, hidden_size=48, intermediate_size=80,
                                                  num_hidden_layers=1, num_attention_heads=4, qk_layernorm=True))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ts.nn.parallelize(stablelm)
    assert "model.layers.0.self_attn (StableLmAttention): attention of unknown layout" in " ".join(
        str(w.message) for w in caught), [str(w.message) for w in caught]
    for expected in ("model.layers.0.self_attn (LlamaAttention): attention of unknown layout",
                     "model.layers.1.mlp (LlamaMLP): MLP of unknown layout",
                     "model.embed_tokens (Embedding): vocabulary left whole", "lm_head (Linear): vocabulary left whole"):
        assert expected in message, message


class _ReadsItsTable(torch.nn.Embedding):
    def forward(self, input):
        return F.embedding(input, self.weight) * 2.0


class _AddsItsTableMean(torch.nn.Embedding):
    def forward(self, input):
        return super().forward(input) + self.weight.mean(0)


class _RenormalisesRows(torch.nn.Embedding):
    def forward(self, input):
        return super().forward(input) * 2.0


def case_a_vocabulary_read_as_whole_is_refused_or_follows():
    import warnings
    from shardtorch.nn.whole_model.proof import ParallelizeProofError
    from tests.distributed.zoo_models import ZOO
    # An nn.Embedding subclass whose forward reads its table itself reads its shard as the whole table. It
    # is split like any subclass (its lookup beneath it vocabulary-parallel) and the proof refuses it on
    # every rank, naming the embedding and the plan that keeps it whole (indexing past its shard raises;
    # reading all of it computes another output); that plan then gives the unsharded model's numbers.
    ids = torch.arange(96, 96 - 21, -1).reshape(3, 7)  # ids beyond every rank's own rows
    for table, where in ((_ReadsItsTable, "raises on the probe batch that the whole model runs (in '0' (vocab): "
                                          "IndexError"),
                         (_AddsItsTableMean, "the split of '0' (vocab) gives another output")):
        def build():
            torch.manual_seed(0)
            return torch.nn.Sequential(table(97, 8), torch.nn.Linear(8, 97)).to(F64)
        expect_error(lambda: ts.nn.parallelize(build(), plan={"0": "vocab", "1": "vocab"}), where,
                     "pass plan= with '0': 'replicate' (", exception=ParallelizeProofError)
        model = ts.nn.parallelize(build(), plan={"0": "replicate", "1": "vocab"})
        assert type(model[1]).__name__ == "ParallelLinear", model
        assert_close(model(ids).detach(), build()(ids).detach(), F64, f"{table.__name__} whole, head split")
    # max_norm renormalises the rows a lookup reads, which the lookup beneath a subclass does not do.
    model = torch.nn.Sequential(_RenormalisesRows(97, 8, max_norm=1.0), torch.nn.Linear(8, 97))
    expect_error(lambda: ts.nn.parallelize(model, plan={"0": "vocab", "1": "vocab"}), "'0' (_RenormalisesRows)",
                 "has max_norm=1.0", exception=ValueError)
    # T5's encoder and decoder embed_tokens share the 'shared' table: named in the auto plan, and following
    # a plan that names only 'shared' (before, they held its shard as a whole table: silently wrong).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        build = ZOO["t5"][0]
        torch.manual_seed(0)
        ref = build().to(F64)
        torch.manual_seed(0)
        par = build().to(F64)
    plan = ts.nn.auto_plan(par)
    assert {name for name, style in plan.items() if style == "vocab"} == {
        "shared", "encoder.embed_tokens", "decoder.embed_tokens", "lm_head"}, plan
    ts.nn.parallelize(par, plan={"shared": "vocab", "lm_head": "vocab"})
    assert par.encoder.embed_tokens.weight is par.shared.weight is par.lm_head.weight
    ids = torch.arange(96, 96 - 21, -1).reshape(3, 7)  # ids beyond every rank's own rows
    expected = ref(input_ids=ids, decoder_input_ids=ids).logits.detach()
    assert_close(_whole(par(input_ids=ids, decoder_input_ids=ids).logits, True), expected, F64, "T5 logits")


def case_options_that_differ_between_ranks_are_refused_on_every_rank():
    # verbose=True on one rank alone used to abort in its report's all-gather (a Gloo size mismatch).
    rank, size = ts.distributed.get_group_rank(), ts.distributed.get_group_size()
    model = models.mingpt()
    verbose = ", ".join(f"{r == 0} on group rank {r}" for r in range(size))
    expect_error(lambda: ts.nn.parallelize(model, verbose=rank == 0), "parallelize: every rank of group 'tp' must "
                 "pass the same verbose; got verbose: " + verbose, exception=ValueError)
    message = expect_error(lambda: ts.nn.parallelize(model, plan={"blocks.0.attn": "attention"} if rank else "auto",
                                                     logits="sharded" if rank else "whole"),
                           "the same plan, logits;", "logits: 'whole' on group rank 0, 'sharded' on group rank 1",
                           exception=ValueError)
    assert "plan: 'auto' on group rank 0, {'blocks.0.attn': 'attention'} on group rank 1" in message, message
    assert type(model.blocks[0].attn.key) is torch.nn.Linear, "a refused call changed the model"
    ts.nn.parallelize(model, plan=dict(reversed(list(ts.nn.auto_plan(model).items()))))  # same plan, any order
    assert type(model.blocks[0].attn.key) is not torch.nn.Linear
    # from_config (and from_pretrained) check theirs before building, dtype included.
    from transformers import GPT2LMHeadModel
    config = models.gpt2().config
    dtypes = ", ".join(f"{torch.float64 if r else None} on group rank {r}" for r in range(size))
    expect_error(lambda: ts.nn.from_config(GPT2LMHeadModel, config, dtype=torch.float64 if rank else None),
                 "from_config: every rank of group 'tp' must pass the same dtype; got dtype: " + dtypes,
                 exception=ValueError)
