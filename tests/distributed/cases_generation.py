"""Generation and whole logits of parallelized models on real ranks (Gloo, CPU), against the same
model unsharded: generate's tokens and scores (greedy, beam search, sampling, repetition penalty,
stopping), the KV cache by heads, and the logits any call returns."""
import torch
import torch.distributed as dist
import torch.nn.functional as F

import shardtorch as ts
from tests.distributed import parallelize_models as models
from tests.reference import expect_error

F64 = torch.float64


def _qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM
    config = Qwen2Config(vocab_size=models.VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                         num_attention_heads=6, num_key_value_heads=3, max_position_embeddings=64,
                         tie_word_embeddings=True, attn_implementation="eager")
    return Qwen2ForCausalLM(config)  # q/k/v biases, tied head, 3 key/value heads: split at 2 and 3 ranks


CAUSAL = {"gpt2": models.gpt2, "llama": models.llama, "llama_kv1": lambda: models.llama(kv_heads=1), "qwen2": _qwen2}


def _pair(build, dtype=F64, **options):
    torch.manual_seed(0)
    reference = build().to(dtype).eval()
    torch.manual_seed(0)
    model = ts.nn.parallelize(build().to(dtype), **options).eval()
    return reference, model


def _prompts(seed=3, batch=2, length=5):
    return torch.randint(1, models.VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def _relative(actual, expected):
    finite = torch.isfinite(expected)
    assert torch.equal(finite, torch.isfinite(actual)), "scores differ in which are finite"
    if not finite.any():
        return 0.0
    return ((actual[finite] - expected[finite]).abs().max() / expected[finite].abs().max().clamp_min(1e-300)).item()


def _generate_both(reference, model, seed=1, **options):
    results = []
    for m in (reference, model):
        torch.manual_seed(seed)
        results.append(m.generate(_prompts(), max_new_tokens=10, output_scores=True, return_dict_in_generate=True,
                                  pad_token_id=0, **options))
    return results


def _same_on_every_rank(tensor):
    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, tensor.contiguous())
    assert all(torch.equal(g, tensor) for g in gathered), "ranks generated different tokens"


def case_logits_without_labels_are_the_unsharded_models():
    """model(ids).logits, with labels or without, and for logits_to_keep=1, are the whole logits;
    logits="sharded" keeps the marked shards for callers that know."""
    ids = _prompts(length=7)
    for name in ("gpt2", "llama", "qwen2"):
        reference, model = _pair(CAUSAL[name])
        with torch.no_grad():
            expected = reference(input_ids=ids).logits
            for call in (dict(), dict(labels=ids)):
                logits = model(input_ids=ids, **call).logits
                assert logits.shape == expected.shape, (name, call, tuple(logits.shape))
                assert (logits - expected).abs().max() <= 1e-12 * expected.abs().max(), (name, call)
            last = model(input_ids=ids, logits_to_keep=1).logits
            assert last.shape == (ids.shape[0], 1, models.VOCAB), (name, tuple(last.shape))
            assert (last - expected[:, -1:]).abs().max() <= 1e-12 * expected.abs().max(), name
            as_tuple = model(input_ids=ids, return_dict=False)[0]
            assert as_tuple.shape == expected.shape, (name, "return_dict=False")
    _, sharded = _pair(CAUSAL["llama"], logits="sharded")
    with torch.no_grad():
        shard = sharded(input_ids=ids).logits
    assert ts.utils.get_parallel_dim(shard) == -1 and shard.shape[-1] < models.VOCAB


def case_encoder_predictions_are_whole():
    """BertForMaskedLM called for predictions gives the whole logits; a ViT's small classifier stays whole."""
    ids = _prompts(length=7)
    reference, model = _pair(models.bert)
    with torch.no_grad():
        expected, logits = reference(input_ids=ids).logits, model(input_ids=ids).logits
    assert logits.shape == expected.shape and (logits - expected).abs().max() <= 1e-12 * expected.abs().max()
    reference, model = _pair(models.vit)
    images = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(2), dtype=F64)
    with torch.no_grad():
        expected, logits = reference(images), model(images)
    assert logits.shape == expected.shape and (logits - expected).abs().max() <= 1e-12 * expected.abs().max()


def case_greedy_and_beam_search_equal_the_unsharded_model():
    """Tokens equal to the unsharded model's, per-step scores within 1e-10 relative in float64, for
    GPT-2, Llama (key/value heads split, and replicated) and Qwen2; tokens equal in float32 (GPT-2 and
    Llama with replicated key/value heads)."""
    for dtype in (F64, torch.float32):
        for name, build in CAUSAL.items():
            if dtype == torch.float32 and name not in ("gpt2", "llama_kv1"):
                continue  # float32 once per layout family (fused q/k/v, replicated key/value heads)
            reference, model = _pair(build, dtype)
            for options in (dict(do_sample=False), dict(do_sample=False, num_beams=3),
                            dict(do_sample=False, repetition_penalty=1.3, eos_token_id=5)):
                expected, got = _generate_both(reference, model, **options)
                assert torch.equal(got.sequences, expected.sequences), (name, dtype, options)
                _same_on_every_rank(got.sequences)
                if dtype == F64:
                    worst = max(_relative(a, b) for a, b in zip(got.scores, expected.scores))
                    assert worst <= 1e-10, (name, options, worst)


def case_generate_reads_whole_logits_also_when_the_model_keeps_shards():
    """A model parallelized with logits="sharded" (training loops that read only the parallel loss)
    generates the unsharded model's tokens, greedy and sampled: generate gathers the logits it picks
    from; outside generate its logits stay this rank's shard."""
    from shardtorch.utils.shards import shard_range
    for name in ("gpt2", "llama"):
        reference, model = _pair(CAUSAL[name], logits="sharded")
        for options in (dict(do_sample=False), dict(do_sample=True, top_k=20)):
            expected, got = _generate_both(reference, model, seed=6, **options)
            assert torch.equal(got.sequences, expected.sequences), (name, options)
            _same_on_every_rank(got.sequences)
        lo, hi = shard_range(models.VOCAB, dist.get_world_size(), dist.get_rank())
        with torch.no_grad():
            logits = model(input_ids=_prompts()).logits
        assert logits.shape[-1] == hi - lo, (name, tuple(logits.shape))


def case_sampling_is_the_same_on_every_rank_and_the_unsharded_models():
    for name in ("gpt2", "llama_kv1"):
        reference, model = _pair(CAUSAL[name])
        options = dict(do_sample=True, temperature=0.8, top_k=30, top_p=0.9, repetition_penalty=1.1)
        expected, got = _generate_both(reference, model, seed=4, **options)
        _same_on_every_rank(got.sequences)
        assert torch.equal(got.sequences, expected.sequences), name


def case_the_kv_cache_holds_this_ranks_heads():
    """The DynamicCache holds only this rank's key/value heads (1/N of the unsharded cache where they
    split); a StaticCache generates the same tokens."""
    from shardtorch.utils.shards import shard_range
    reference, model = _pair(models.llama)  # 4 key/value heads
    expected, got = _generate_both(reference, model)
    heads = shard_range(4, dist.get_world_size(), dist.get_rank())
    keys = got.past_key_values.layers[0].keys
    assert keys.shape[1] == heads[1] - heads[0], (tuple(keys.shape), heads)
    assert expected.past_key_values.layers[0].keys.shape[1] == 4
    expected, got = _generate_both(reference, model, cache_implementation="static")
    assert torch.equal(got.sequences, expected.sequences), "static cache"


def case_different_inputs_on_the_ranks_of_a_group_raise_on_every_rank():
    """Different prompts, settings or (sampling) random states on the ranks of one group: a ValueError
    on every rank before the first step, not sequences that drift apart."""
    _, model = _pair(models.gpt2)
    rank = dist.get_rank()
    prompts = _prompts(seed=3 + (rank == 1))
    expect_error(lambda: model.generate(prompts, max_new_tokens=3, pad_token_id=0), "different prompts",
                 exception=ValueError)
    expect_error(lambda: model.generate(_prompts(), max_new_tokens=3 + (rank == 1), pad_token_id=0),
                 "different settings", exception=ValueError)
    torch.manual_seed(rank)
    expect_error(lambda: model.generate(_prompts(), max_new_tokens=3, do_sample=True, pad_token_id=0),
                 "random state", "torch.manual_seed", exception=ValueError)
    torch.manual_seed(0)
    tokens = model.generate(_prompts(), max_new_tokens=3, do_sample=True, pad_token_id=0)
    _same_on_every_rank(tokens)


def case_the_loss_with_labels_is_still_computed_from_the_shards():
    """With labels the model's loss is the vocabulary-parallel one (computed before the logits are
    gathered): equal to F.cross_entropy of the unsharded logits, gradients exact."""
    reference, model = _pair(models.llama)
    ids = _prompts(length=7)
    shifted = F.pad(ids, (0, 1), value=-100)[..., 1:]
    loss = model(input_ids=ids, labels=ids).loss
    expected = F.cross_entropy(reference(input_ids=ids).logits.reshape(-1, models.VOCAB), shifted.reshape(-1))
    assert abs(loss.item() - expected.item()) <= 1e-12 * abs(expected.item())
