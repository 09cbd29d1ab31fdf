"""original_format.py keeps the model's own names, with a warning, where transformers' reversion of its
conversion mapping needs several of the model's tensors at once (no process group: names and shapes
only; the distributed case_save_pretrained_writes_what_transformers_saves checks the written files)."""
import warnings

import pytest
import torch

from shardtorch.pretrained.original_format import saved_entries

transformers = pytest.importorskip("transformers")
loading = pytest.importorskip("transformers.core_model_loading")


def _llama():
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2)
    return transformers.LlamaForCausalLM(config)


def _entries(model):
    return [(k, v.dtype, tuple(v.shape)) for k, v in model.state_dict().items()]


def test_a_conversion_that_merges_several_tensors_keeps_the_models_names():
    model = _llama()
    # As if loaded from a checkpoint with a fused qkv_proj: saving concatenates q, k and v again.
    model._weight_conversions = [loading.WeightConverter(
        source_patterns="self_attn.qkv_proj.weight",
        target_patterns=["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"],
        operations=[loading.Chunk(dim=0)])]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        saved = saved_entries(model, _entries(model))
    assert saved == {name: [(name, dtype, shape)] for name, dtype, shape in _entries(model)}
    assert any("LlamaForCausalLM's checkpoint keeps the model's own tensor names" in str(w.message)
               for w in caught), [str(w.message) for w in caught]


def test_a_class_without_a_mapping_keeps_its_names_silently():
    model = _llama()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        saved = saved_entries(model, _entries(model))
    assert saved == {name: [(name, dtype, shape)] for name, dtype, shape in _entries(model)}


def test_mixtral_experts_are_planned_per_expert():
    config = transformers.MixtralConfig(vocab_size=32, hidden_size=16, intermediate_size=8, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=2, num_local_experts=3)
    model = transformers.MixtralForCausalLM(config)
    saved = saved_entries(model, _entries(model))
    gate_up = saved["model.layers.0.mlp.experts.gate_up_proj"]
    assert [key for key, _, _ in gate_up] == sorted(
        f"model.layers.0.block_sparse_moe.experts.{i}.{w}.weight" for i in range(3) for w in ("w1", "w3"))
    assert {shape for _, _, shape in gate_up} == {(8, 16)}
    assert saved["model.layers.0.mlp.gate.weight"][0][0] == "model.layers.0.block_sparse_moe.gate.weight"
