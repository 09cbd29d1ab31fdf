"""Models that look like known ones (module names, head counts, sizes) but compute otherwise, for the
proof that parallelize runs before it returns (cases_parallelize_proof.py): split by the layouts'
rules each would be silently wrong. Each builder returns a float64-ready model drawn under the
caller's seed."""
import math

import torch
import torch.nn.functional as F
from torch import nn

from tests.distributed.parallelize_models import VOCAB, gpt2, llama


def _head_minor_llama_class():
    """LlamaForCausalLM whose attention views q/k/v head-minor ([batch, seq, head_dim, heads]: column c
    belongs to head c % heads), with Llama's names, head counts and sizes: built so from its config
    (as from_config and from_pretrained build it)."""
    from transformers import LlamaForCausalLM
    from transformers.models.llama import modeling_llama as m

    class HeadMinorLlamaAttention(m.LlamaAttention):
        def forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
            batch, seq, _ = hidden_states.shape

            def heads(x):  # [B, S, D * H] read as [B, S, D, H] -> [B, H, S, D]
                return x.view(batch, seq, self.head_dim, -1).permute(0, 3, 1, 2)
            q, k, v = heads(self.q_proj(hidden_states)), heads(self.k_proj(hidden_states)), heads(self.v_proj(hidden_states))
            cos, sin = position_embeddings
            q, k = m.apply_rotary_pos_emb(q, k, cos, sin)
            out, weights = m.eager_attention_forward(self, q, k, v, attention_mask, scaling=self.scaling)
            return self.o_proj(out.reshape(batch, seq, -1).contiguous()), weights

    class HeadMinorLlamaForCausalLM(LlamaForCausalLM):
        def __init__(self, config):
            super().__init__(config)
            for layer in self.model.layers:
                layer.self_attn = HeadMinorLlamaAttention(config, layer.self_attn.layer_idx)
            self.post_init()

    return HeadMinorLlamaForCausalLM


def _log_softmax_gpt2_class():
    """GPT2LMHeadModel whose forward returns log-probabilities (a helper normalises the logits over the
    vocabulary)."""
    from transformers import GPT2LMHeadModel

    def normalised(logits):
        return torch.log_softmax(logits, -1)

    class LogProbGPT2(GPT2LMHeadModel):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = normalised(out.logits)
            return out

    return LogProbGPT2


_CLASSES = {}


def lookalike_class(name: str) -> type:
    """The look-alike transformers class ``name`` ("head_minor_llama", "log_softmax_gpt2"), made once
    (its config is the model's it looks like)."""
    if name not in _CLASSES:
        _CLASSES[name] = {"head_minor_llama": _head_minor_llama_class,
                          "log_softmax_gpt2": _log_softmax_gpt2_class}[name]()
    return _CLASSES[name]


def head_minor_llama():
    return lookalike_class("head_minor_llama")(llama().config)


def log_softmax_gpt2():
    return lookalike_class("log_softmax_gpt2")(gpt2().config)


class _Attention(nn.Module):
    """minGPT-style attention (key, query, value, proj; n_head) with a hook for what happens to the heads
    between attention and proj."""

    def __init__(self, width, heads, mix_heads=False, rotate_whole=False):
        super().__init__()
        self.key, self.query, self.value = (nn.Linear(width, width) for _ in range(3))
        self.proj = nn.Linear(width, width)
        self.n_head = heads
        self.mix_heads, self.rotate_whole = mix_heads, rotate_whole

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.query(x), self.key(x), self.value(x)
        if self.rotate_whole:  # rotary pairs (i, i + C/2) over the whole projection, before the heads
            half = q.shape[-1] // 2
            angle = torch.arange(T, dtype=x.dtype)[:, None] * 0.3
            cos, sin = torch.cos(angle), torch.sin(angle)

            def rotate(t):
                a, b = t[..., :half], t[..., half:]
                return torch.cat([a * cos - b * sin, a * sin + b * cos], -1)
            q, k = rotate(q), rotate(k)
        q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        mask = torch.tril(torch.ones(T, T, dtype=torch.bool))
        y = att.masked_fill(~mask, float("-inf")).softmax(-1) @ v
        if self.mix_heads:  # a parameter-free operation across heads
            y = y - y.mean(dim=1, keepdim=True)
        return self.proj(y.transpose(1, 2).contiguous().view(B, T, -1))


class _MLP(nn.Module):
    def __init__(self, width, hidden, flip=False):
        super().__init__()
        self.c_fc, self.c_proj = nn.Linear(width, hidden), nn.Linear(hidden, width)
        self.flip = flip

    def forward(self, x):
        h = F.gelu(self.c_fc(x))
        if self.flip:  # an element-wise operation across the hidden features between the two halves
            h = h * h.flip(-1)
        return self.c_proj(h)


class _Block(nn.Module):
    def __init__(self, width, heads, **changes):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = _Attention(width, heads, changes.get("mix_heads", False), changes.get("rotate_whole", False))
        self.mlp = _MLP(width, 2 * width, changes.get("flip", False))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    """minGPT-shaped: tok_emb, blocks of attention (key/query/value/proj) and MLP (c_fc/c_proj), head."""

    def __init__(self, width=24, heads=4, layers=2, **changes):
        super().__init__()
        self.tok_emb = nn.Embedding(VOCAB, width)
        self.blocks = nn.ModuleList(_Block(width, heads, **changes) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB, bias=False)

    def forward(self, idx):
        x = self.tok_emb(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


LOOKALIKES = {
    "head_minor_llama": head_minor_llama,
    "log_softmax_gpt2": log_softmax_gpt2,
    "heads_mixed_after_attention": lambda: TinyGPT(mix_heads=True),
    "mlp_features_flipped": lambda: TinyGPT(flip=True),
    "rotary_over_the_whole_projection": lambda: TinyGPT(rotate_whole=True),
}
