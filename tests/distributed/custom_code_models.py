"""A transformers model of its own code (as ``trust_remote_code`` loads one): module names no layout
of shardtorch knows (wq/wk/wv/wo, w_in/w_out), and a tensor-parallel plan declared the way
transformers reads it (``base_model_tp_plan`` on the config, ``_tp_plan`` on the model). With
``heads_from_attribute`` its attention reshapes by a head count kept in an attribute, so the declared
column split runs with the whole model's head count: the proof must refuse it."""
import torch
import torch.nn.functional as F
from torch import nn

_CLASSES = {}


def custom_code_classes():
    """(TinyCustomConfig, TinyCustomForCausalLM), made once."""
    if not _CLASSES:
        _CLASSES["classes"] = _make()
    return _CLASSES["classes"]


def _make():
    from transformers import PretrainedConfig, PreTrainedModel
    from transformers.modeling_outputs import CausalLMOutput

    class TinyCustomConfig(PretrainedConfig):
        model_type = "shardtorch_tiny_custom"
        base_model_tp_plan = {"blocks.*.attn.wq": "colwise", "blocks.*.attn.wk": "colwise",
                              "blocks.*.attn.wv": "colwise", "blocks.*.attn.wo": "rowwise",
                              "blocks.*.ffn.w_in": "colwise", "blocks.*.ffn.w_out": "rowwise"}

        def __init__(self, vocab_size=96, width=48, heads=4, layers=2, hidden=80, heads_from_attribute=False,
                     **kwargs):
            self.vocab_size, self.width, self.heads, self.layers = vocab_size, width, heads, layers
            self.hidden, self.heads_from_attribute = hidden, heads_from_attribute
            super().__init__(**kwargs)

    class Attention(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.wq, self.wk, self.wv, self.wo = (nn.Linear(config.width, config.width) for _ in range(4))
            self.head_dim, self.heads = config.width // config.heads, config.heads
            self.heads_from_attribute = config.heads_from_attribute

        def forward(self, x):
            batch, seq, _ = x.shape
            heads = self.heads if self.heads_from_attribute else -1

            def split(t):
                return t.view(batch, seq, heads, self.head_dim).transpose(1, 2)
            q, k, v = split(self.wq(x)), split(self.wk(x)), split(self.wv(x))
            scores = q @ k.transpose(-1, -2) / self.head_dim ** 0.5
            mask = torch.ones(seq, seq, dtype=torch.bool, device=x.device).triu(1)
            out = scores.masked_fill(mask, float("-inf")).softmax(-1) @ v
            return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))

    class FeedForward(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.w_in, self.w_out = nn.Linear(config.width, config.hidden), nn.Linear(config.hidden, config.width)

        def forward(self, x):
            return self.w_out(F.gelu(self.w_in(x)))

    class Block(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.norm1, self.norm2 = nn.LayerNorm(config.width), nn.LayerNorm(config.width)
            self.attn, self.ffn = Attention(config), FeedForward(config)

        def forward(self, x):
            x = x + self.attn(self.norm1(x))
            return x + self.ffn(self.norm2(x))

    class Body(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.embed = nn.Embedding(config.vocab_size, config.width)
            self.blocks = nn.ModuleList(Block(config) for _ in range(config.layers))
            self.norm = nn.LayerNorm(config.width)

        def forward(self, input_ids):
            x = self.embed(input_ids)
            for block in self.blocks:
                x = block(x)
            return self.norm(x)

    class TinyCustomForCausalLM(PreTrainedModel):
        config_class = TinyCustomConfig
        base_model_prefix = "body"
        _tp_plan = {"lm_head": "colwise_gather_output"}

        def __init__(self, config):
            super().__init__(config)
            self.body = Body(config)
            self.lm_head = nn.Linear(config.width, config.vocab_size, bias=False)
            self.post_init()

        def _init_weights(self, module):
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.05)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.normal_(module.bias, std=0.05)

        def forward(self, input_ids, labels=None, **kwargs):
            logits = self.lm_head(self.body(input_ids))
            loss = None
            if labels is not None:
                loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
            return CausalLMOutput(loss=loss, logits=logits)

    return TinyCustomConfig, TinyCustomForCausalLM
