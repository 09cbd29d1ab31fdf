"""Tiny float64 models for the parallelize tests, built from configs (nothing
downloads), with head counts chosen so that 2, 3 and 4 ranks split them
unevenly somewhere, and a minGPT-style model written here in the layout of
TorchShard's minGPT project (separate key/query/value and proj)."""
import math

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 97  # not a multiple of 2, 3 or 4: the vocabulary splits unevenly too
SEQ = 7


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    config = GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=60, n_layer=2, n_head=10, n_inner=88,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager")
    return GPT2LMHeadModel(config)  # 10 heads of 6: 4,3,3 over 3 ranks; 3,3,2,2 over 4; tied LM head


def llama(kv_heads=4, heads=12):
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=32,
                         tie_word_embeddings=False, attn_implementation="eager")
    return LlamaForCausalLM(config)


def bert():
    from transformers import BertConfig, BertForMaskedLM
    config = BertConfig(vocab_size=VOCAB, hidden_size=60, num_hidden_layers=2, num_attention_heads=5,
                        intermediate_size=88, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                        max_position_embeddings=16, attn_implementation="eager")
    return BertForMaskedLM(config)  # 5 heads of 12: 3,2 over 2; 2,2,1 over 3; 2,1,1,1 over 4


def vit():
    from timm.models.vision_transformer import VisionTransformer
    return VisionTransformer(img_size=16, patch_size=8, in_chans=3, num_classes=10, embed_dim=48, depth=2,
                             num_heads=12, mlp_ratio=1.75)


class MinGPTAttention(nn.Module):
    """TorchShard's minGPT layout: key, query, value, proj; heads in n_head.
    Reshapes by n_head (the head size is -1), so a shard of heads runs it."""

    def __init__(self, width, heads, block):
        super().__init__()
        self.key, self.query, self.value = (nn.Linear(width, width) for _ in range(3))
        self.proj = nn.Linear(width, width)
        self.n_head = heads
        self.register_buffer("mask", torch.tril(torch.ones(block, block)).view(1, 1, block, block))

    def forward(self, x):
        B, T, _ = x.size()
        k = self.key(x).view(B, T, self.n_head, -1).transpose(1, 2)
        q = self.query(x).view(B, T, self.n_head, -1).transpose(1, 2)
        v = self.value(x).view(B, T, self.n_head, -1).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = F.softmax(att.masked_fill(self.mask[:, :, :T, :T] == 0, float("-inf")), dim=-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, -1)
        return self.proj(y)


class MinGPTBlock(nn.Module):
    def __init__(self, width, heads, block):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = MinGPTAttention(width, heads, block)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width),
                                 nn.Dropout(0.0))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class MinGPT(nn.Module):
    def __init__(self, vocab=VOCAB, width=48, heads=6, layers=2, block=16):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, width)
        self.pos_emb = nn.Parameter(torch.randn(1, block, width) * 0.02)
        self.blocks = nn.Sequential(*[MinGPTBlock(width, heads, block) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, idx):
        x = self.tok_emb(idx) + self.pos_emb[:, :idx.size(1), :]
        return self.head(self.ln_f(self.blocks(x)))


def mingpt():
    return MinGPT()
