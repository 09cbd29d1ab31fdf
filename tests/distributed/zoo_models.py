"""Tiny float64-ready configs of the transformers zoo for ts.nn.parallelize's
tests (built from configs, nothing downloads): 2 layers, widths 48-64, a
vocabulary of 97 (split unevenly by 2 and 3 ranks), head counts chosen so that
3 ranks split them unevenly (4 heads: 2, 1, 1) and key/value heads fewer than
ranks somewhere (grouped-query attention with kv 2 or 1 at 3 ranks).

ZOO maps a name to (build, step kind); the step kinds are in
cases_parallelize_zoo.py."""
import torch
from torch import nn

from tests.distributed.parallelize_models import VOCAB, MinGPTAttention

_EAGER = dict(attn_implementation="eager")
_TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _hf(model_class, config_class, **config):
    import transformers
    return lambda: getattr(transformers, model_class)(getattr(transformers, config_class)(**config, **_EAGER))


def _decoder(**extra):
    return dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                max_position_embeddings=32, **extra)


def swin():
    from timm.models.swin_transformer import SwinTransformer
    # Window attention with a relative position bias table by head; 4 then 5 heads; drop_path off for exactness.
    return SwinTransformer(img_size=16, patch_size=2, in_chans=3, num_classes=10, embed_dim=24, depths=(1, 1),
                           num_heads=(4, 5), window_size=4, mlp_ratio=2.0, drop_path_rate=0.0)


class GatedExpert(nn.Module):
    def __init__(self, width, hidden):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(width, hidden, bias=False), nn.Linear(width, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, width, bias=False)

    def forward(self, x):
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class ListOfExperts(nn.Module):
    """A mixture of experts kept as a list of expert modules (top-2 of 4), router whole."""

    def __init__(self, width, hidden, experts=4):
        super().__init__()
        self.router = nn.Linear(width, experts, bias=False)
        self.experts = nn.ModuleList(GatedExpert(width, hidden) for _ in range(experts))

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        weights, chosen = torch.topk(self.router(flat).softmax(-1), 2, dim=-1)
        out = torch.zeros_like(flat)
        for index, expert in enumerate(self.experts):
            rows, slot = torch.where(chosen == index)
            if rows.numel():
                out.index_add_(0, rows, expert(flat[rows]) * weights[rows, slot, None])
        return out.reshape(x.shape)


class MoEBlock(nn.Module):
    def __init__(self, width, heads, block):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = MinGPTAttention(width, heads, block)
        self.moe = ListOfExperts(width, 40)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.moe(self.ln2(x))


class ListMoE(nn.Module):
    def __init__(self, width=48, heads=4, block=16):
        super().__init__()
        self.tok_emb = nn.Embedding(VOCAB, width)
        self.blocks = nn.Sequential(MoEBlock(width, heads, block), MoEBlock(width, heads, block))
        self.head = nn.Linear(width, VOCAB, bias=False)

    def forward(self, idx):
        return self.head(self.blocks(self.tok_emb(idx)))


ZOO = {
    "gptj": (_hf("GPTJForCausalLM", "GPTJConfig", vocab_size=VOCAB, n_positions=32, n_embd=48, n_layer=2, n_head=4,
                 rotary_dim=4, n_inner=80, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                 tie_word_embeddings=False, **_TOKENS), "causal"),
    "gpt_neox": (_hf("GPTNeoXForCausalLM", "GPTNeoXConfig", **_decoder(num_attention_heads=4, rotary_pct=0.5,
                                                                       attention_dropout=0.0, hidden_dropout=0.0)),
                 "causal"),
    "opt": (_hf("OPTForCausalLM", "OPTConfig", vocab_size=VOCAB, hidden_size=48, ffn_dim=80, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=32, word_embed_proj_dim=48, dropout=0.0,
                attention_dropout=0.0, pad_token_id=1), "causal"),
    "bloom": (_hf("BloomForCausalLM", "BloomConfig", vocab_size=VOCAB, hidden_size=48, n_layer=2, n_head=4,
                  hidden_dropout=0.0, attention_dropout=0.0), "causal"),
    "falcon": (_hf("FalconForCausalLM", "FalconConfig", vocab_size=VOCAB, hidden_size=48, num_hidden_layers=2,
                   num_attention_heads=4, new_decoder_architecture=False, multi_query=False, alibi=False,
                   bias=True), "causal"),
    "falcon_multi_query": (_hf("FalconForCausalLM", "FalconConfig", vocab_size=VOCAB, hidden_size=48,
                               num_hidden_layers=2, num_attention_heads=4, new_decoder_architecture=False,
                               multi_query=True, alibi=False), "causal"),
    # Grouped: 4 key/value groups (whole groups per rank), and 2 (3 ranks: a share of every group's heads).
    "falcon_grouped": (_hf("FalconForCausalLM", "FalconConfig", vocab_size=VOCAB, hidden_size=64,
                           num_hidden_layers=2, num_attention_heads=8, num_kv_heads=4,
                           new_decoder_architecture=True, alibi=False), "causal"),
    "falcon_grouped_kv2": (_hf("FalconForCausalLM", "FalconConfig", vocab_size=VOCAB, hidden_size=64,
                               num_hidden_layers=2, num_attention_heads=8, num_kv_heads=2,
                               new_decoder_architecture=True, alibi=False), "causal"),
    "phi3": (_hf("Phi3ForCausalLM", "Phi3Config", **_decoder(num_attention_heads=12, num_key_value_heads=4,
                                                             resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0,
                                                             **_TOKENS)), "causal"),
    "phi3_kv2": (_hf("Phi3ForCausalLM", "Phi3Config", **_decoder(num_attention_heads=8, num_key_value_heads=2,
                                                                 resid_pdrop=0.0, embd_pdrop=0.0,
                                                                 attention_dropout=0.0, **_TOKENS)), "causal"),
    "qwen3": (_hf("Qwen3ForCausalLM", "Qwen3Config", **_decoder(num_attention_heads=8, num_key_value_heads=4,
                                                                head_dim=8)), "causal"),
    "gemma": (_hf("GemmaForCausalLM", "GemmaConfig", **_decoder(num_attention_heads=4, num_key_value_heads=1,
                                                                head_dim=12, **_TOKENS)), "causal"),
    "gemma2": (_hf("Gemma2ForCausalLM", "Gemma2Config", **_decoder(num_attention_heads=4, num_key_value_heads=2,
                                                                   head_dim=12, sliding_window=4, **_TOKENS)),
               "causal"),
    "gemma3_text": (_hf("Gemma3ForCausalLM", "Gemma3TextConfig", **_decoder(
        num_attention_heads=4, num_key_value_heads=2, head_dim=12, sliding_window=4, **_TOKENS)), "causal"),
    "olmo2": (_hf("Olmo2ForCausalLM", "Olmo2Config", **_decoder(num_attention_heads=4, num_key_value_heads=4,
                                                                **_TOKENS)), "causal"),
    "stablelm": (_hf("StableLmForCausalLM", "StableLmConfig", **_decoder(
        num_attention_heads=4, num_key_value_heads=2, partial_rotary_factor=0.5, use_qkv_bias=True,
        hidden_dropout=0.0, attention_dropout=0.0)), "causal"),
    "mistral": (_hf("MistralForCausalLM", "MistralConfig", **_decoder(num_attention_heads=8,
                                                                      num_key_value_heads=4)), "causal"),
    "qwen2": (_hf("Qwen2ForCausalLM", "Qwen2Config", **_decoder(num_attention_heads=8, num_key_value_heads=4)),
              "causal"),
    # The router's load-balancing loss is part of the loss (output_router_logits).
    "mixtral": (_hf("MixtralForCausalLM", "MixtralConfig", **dict(_decoder(
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
        output_router_logits=True, experts_implementation="eager"), intermediate_size=40)), "causal"),
    # c_attn laid out by head under GPT-2's name (without multi-query).
    "gpt_bigcode": (_hf("GPTBigCodeForCausalLM", "GPTBigCodeConfig", vocab_size=VOCAB, n_positions=32, n_embd=48,
                        n_layer=2, n_head=4, multi_query=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
                    "causal"),
    # Multi-query: c_attn by part, [query | one key/value head], split by embed_dim in its forward.
    "gpt_bigcode_multi_query": (_hf("GPTBigCodeForCausalLM", "GPTBigCodeConfig", vocab_size=VOCAB, n_positions=32,
                                    n_embd=48, n_layer=2, n_head=4, multi_query=True, resid_pdrop=0.0,
                                    embd_pdrop=0.0, attn_pdrop=0.0), "causal"),
    "distilbert": (_hf("DistilBertForMaskedLM", "DistilBertConfig", vocab_size=VOCAB, dim=48, n_layers=2, n_heads=4,
                       hidden_dim=80, dropout=0.0, attention_dropout=0.0, max_position_embeddings=32,
                       pad_token_id=0), "masked"),
    "roberta": (_hf("RobertaForMaskedLM", "RobertaConfig", vocab_size=VOCAB, hidden_size=48, num_hidden_layers=2,
                    num_attention_heads=4, intermediate_size=80, hidden_dropout_prob=0.0,
                    attention_probs_dropout_prob=0.0, max_position_embeddings=40, pad_token_id=1), "masked"),
    "t5": (_hf("T5ForConditionalGeneration", "T5Config", vocab_size=VOCAB, d_model=48, d_kv=12, d_ff=80,
               num_layers=2, num_decoder_layers=2, num_heads=4, relative_attention_num_buckets=8, dropout_rate=0.0,
               decoder_start_token_id=0, pad_token_id=0), "seq2seq"),
    "swin": (swin, "image"),
    "list_of_experts": (ListMoE, "plain"),
}
