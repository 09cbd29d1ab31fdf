"""ts.nn.parallelize with AMP and torch.compile, on 3 ranks (GPT-2's 10 heads split 4,3,3; vocabulary 97
split unevenly): the parallelized model under torch.autocast("cpu", bfloat16) against the unsharded model in
float32, the parallelized model compiled against itself eager in float64, and gradient checkpointing (exact, and
redrawing no dropout mask in its recompute)."""
import torch

import shardtorch as ts
from tests.distributed import parallelize_models as models
from tests.distributed.cases_parallelize import _causal_reference_loss, _tokens, collected_grads

F64 = torch.float64
#: bfloat16 keeps 8 significant bits (a relative step of 2**-8 = 3.9e-3 per rounding). Measured on this 2-layer
#: model: loss 4e-6, gradients at most 1.0e-2 relative to their largest value; 3e-2 leaves 3x for other seeds.
BF16_RELATIVE = 3e-2
COMPILED_RELATIVE = 1e-10


def _pair(dtype):
    torch.manual_seed(0)
    ref = models.gpt2().to(dtype)
    torch.manual_seed(0)
    par = ts.nn.parallelize(models.gpt2().to(dtype))
    return ref, par


def _relative(actual, expected):
    return ((actual.double() - expected.double()).abs().max() / expected.double().abs().max().clamp_min(1e-30)).item()


def case_autocast_bfloat16_within_bfloat16_of_float32():
    ref, par = _pair(torch.float32)
    ids, labels = _tokens(5)
    logits = ref(input_ids=ids).logits
    loss_ref = _causal_reference_loss(logits, labels)
    loss_ref.backward()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = par(input_ids=ids, labels=labels)
    assert out.logits.dtype == torch.bfloat16, f"autocast did not reach the LM head: logits {out.logits.dtype}"
    out.loss.backward()
    worst = {"loss": _relative(out.loss.detach(), loss_ref.detach())}
    grads = collected_grads(par)
    for key, param in ref.named_parameters(remove_duplicate=False):
        assert grads[key].dtype == torch.float32, f"gradient of {key} is {grads[key].dtype}, not the parameter's"
        worst[key] = _relative(grads[key], param.grad)
    bad = {key: value for key, value in worst.items() if not value <= BF16_RELATIVE}
    assert not bad, f"autocast bfloat16 beyond {BF16_RELATIVE} relative of float32: {bad}"
    assert max(worst.values()) > 0, "autocast changed nothing: bfloat16 did not run"


def case_compiled_matches_eager_in_float64():
    torch.manual_seed(0)
    eager = ts.nn.parallelize(models.gpt2().to(F64))
    torch.manual_seed(0)
    model = ts.nn.parallelize(models.gpt2().to(F64))
    torch._dynamo.reset()
    # aot_eager: dynamo's graphs and AOTAutograd's joint forward/backward, without inductor's slow C++ codegen.
    compiled = torch.compile(model, backend="aot_eager")
    for seed in (7, 8):  # the second call runs the compiled graphs again
        ids, labels = _tokens(seed)
        results = []
        for m in (eager, compiled):
            for p in model.parameters():
                p.grad = None
            for p in eager.parameters():
                p.grad = None
            out = m(input_ids=ids, labels=labels)
            out.loss.backward()
            results.append((out.loss.detach(), out.logits.detach(), collected_grads(eager if m is eager else model)))
        (loss_e, logits_e, grads_e), (loss_c, logits_c, grads_c) = results
        assert _relative(loss_c, loss_e) <= COMPILED_RELATIVE, f"compiled loss {loss_c} vs eager {loss_e}"
        assert _relative(logits_c, logits_e) <= COMPILED_RELATIVE, "compiled logits differ from eager"
        for key in grads_e:
            assert _relative(grads_c[key], grads_e[key]) <= COMPILED_RELATIVE, f"compiled gradient of {key} differs"
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert graphs > 0, "torch.compile captured no graph: the compiled model ran eagerly"


def case_compiled_llama_attention_has_no_graph_break():
    """Llama's attention reads its config (the attention implementation) through the view with its local head
    counts: that view's attribute lookup broke the graph in every attention (17 graphs for this 2-layer model,
    each attention run eagerly), and so did the fork of the model-parallel random stream around an attention
    that draws no random numbers (11); now the model is 3 graphs (the label hook, the body, the logits hook)
    and the compiled model gives the eager results."""
    torch.manual_seed(0)
    eager = ts.nn.parallelize(models.llama().to(F64))
    torch.manual_seed(0)
    model = ts.nn.parallelize(models.llama().to(F64))
    # Training, with the model-parallel random stream seeded: each attention's dropout region would fork it,
    # and the fork's torch.Generator.get_state breaks the graph; Llama's attention_dropout is 0, so it does not.
    tracker = ts.random.get_rng_tracker()
    if ts.random.MODEL_PARALLEL not in tracker.names():  # an earlier case of the launch may have seeded it
        tracker.add(ts.random.MODEL_PARALLEL, 1234)
        try:
            _compiled_llama_matches_eager(eager, model)
        finally:
            tracker.reset()
    else:
        _compiled_llama_matches_eager(eager, model)


def _compiled_llama_matches_eager(eager, model):
    ids, labels = _tokens(9)
    eager(input_ids=ids, labels=labels)  # the first training forward's check of the inputs (once, eager)
    model(input_ids=ids, labels=labels)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(input_ids=ids, labels=labels)
    assert explained.graph_count <= 3, (f"torch.compile splits the parallelized Llama into {explained.graph_count} "
                                        f"graphs: a graph break inside its attention? {explained.break_reasons}")
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager")
    out_e, out_c = eager(input_ids=ids, labels=labels), compiled(input_ids=ids, labels=labels)
    out_e.loss.backward()
    out_c.loss.backward()
    assert _relative(out_c.loss.detach(), out_e.loss.detach()) <= COMPILED_RELATIVE
    assert _relative(out_c.logits.detach(), out_e.logits.detach()) <= COMPILED_RELATIVE
    grads_e, grads_c = collected_grads(eager), collected_grads(model)
    for key in grads_e:
        assert _relative(grads_c[key], grads_e[key]) <= COMPILED_RELATIVE, f"compiled gradient of {key} differs"


def _llama(dropout: float):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=models.VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                         num_attention_heads=6, num_key_value_heads=3, max_position_embeddings=32,
                         attention_dropout=dropout, attn_implementation="eager")
    return LlamaForCausalLM(config).to(F64)


def case_gradient_checkpointing_is_exact():
    """transformers' gradient checkpointing (reentrant or not) on a parallelized model: without dropout the
    unsharded model's gradients within 1e-10 (GPT-2, float64); with attention dropout (Llama) drawn from the
    model-parallel stream, the recompute in backward draws the masks the forward drew, so the gradients
    are those of the same model without checkpointing, and the stream ends where it would have."""
    from shardtorch.random import MODEL_PARALLEL, get_rng_tracker
    ids = torch.randint(3, models.VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    # GPT-2 (no float32 norm inside a float64 model), the loss written out (transformers' upcasts to float32).
    reference = models.gpt2().to(F64).train()
    _causal_reference_loss(reference(input_ids=ids).logits, ids).backward()
    for reentrant in (False, True):
        torch.manual_seed(0)
        model = ts.nn.parallelize(models.gpt2().to(F64))
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        model.train()
        _causal_reference_loss(model(input_ids=ids).logits, ids).backward()  # through the whole logits
        grads = collected_grads(model)
        for name, p in reference.named_parameters():
            assert torch.allclose(grads[name], p.grad, rtol=1e-10, atol=1e-12), f"{name}, use_reentrant={reentrant}"
    runs = {}
    for checkpointing in (None, False, True):
        model = ts.nn.parallelize(_llama(0.3))
        if checkpointing is not None:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpointing})
        model.train()
        ts.random.model_parallel_seed(123)
        steps = []
        for _ in range(2):  # the second step reads the stream where the first left it
            model.zero_grad()
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            steps.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        runs[checkpointing] = steps, get_rng_tracker().stream_state(MODEL_PARALLEL)
    (plain, stream) = runs[None]
    for checkpointing in (False, True):
        steps, after = runs[checkpointing]
        for (loss, grads), (loss0, grads0) in zip(steps, plain):
            assert torch.equal(loss, loss0), f"use_reentrant={checkpointing}: loss {loss} != {loss0}"
            for name, grad in grads0.items():
                assert torch.equal(grads[name], grad), f"{name}: use_reentrant={checkpointing}, masks redrawn"
        assert all(torch.equal(a, b) for a, b in zip(after, stream)), "the recompute advanced the stream"
