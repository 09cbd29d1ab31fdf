"""The layouts parallelize knows: attention with separate projections
(attention.py), fused q/k/v (fused_attention.py), MLPs (mlp.py),
mixture-of-experts banks (experts.py); heads.py splits by whole heads and
keeps each module's head bookkeeping right; base.py holds the Layout
interface. families.py is the table of model families they read (names,
head bookkeeping, class tests, flags): adding an architecture is one entry
there and one row in tests/distributed/zoo_models.py.

What the zoos' forwards read (transformers 5.x, timm 1.0): GPT-2 splits
``c_attn``'s output by ``split_size`` then views by ``head_dim``; Llama
views by ``head_dim`` and repeats key/value by ``num_key_value_groups``;
OPT, StableLM and Bloom reshape by ``num_heads``, T5 and DistilBERT by
``n_heads``/-1, Falcon by ``num_heads`` and ``num_kv_heads``; Phi-3 slices
its fused projection at ``config.num_attention_heads x head_dim``; BERT
views by ``attention_head_size``; timm reshapes by ``num_heads``,
``head_dim`` and ``attn_dim``; minGPT-style models by ``n_head``.
"""
from typing import Optional, Tuple

from torch import nn

from .attention import BertAttention, SeparateAttention
from .base import Fit, Layout
from .experts import FusedExperts
from .families import WHOLE_ATTENTION_CLASSES
from .fused_attention import FusedByHead, FusedByPart
from .mlp import BertMLP, FusedGatedMLP, GatedMLP, PairMLP, SequentialMLP

ATTENTION_LAYOUTS = (SeparateAttention(), FusedByPart(), FusedByHead(), BertAttention())
MLP_LAYOUTS = (PairMLP(), GatedMLP(), FusedGatedMLP(), BertMLP(), SequentialMLP())
EXPERT_LAYOUTS = (FusedExperts(),)
KINDS = ("attention", "mlp", "experts")


def find_layout(module: nn.Module, kind: Optional[str] = None) -> Optional[Tuple[Layout, Fit]]:
    """(layout, fit) of the known layout ``module`` has (of ``kind`` if given), or None."""
    if isinstance(module, WHOLE_ATTENTION_CLASSES):
        return None
    for layout in ATTENTION_LAYOUTS + MLP_LAYOUTS + EXPERT_LAYOUTS:
        if kind is None or layout.kind == kind:
            fit = layout.fit(module)
            if fit is not None:
                return layout, fit
    return None
