"""``ts.nn.parallelize`` (this package: ``shardtorch.nn.whole_model``): a whole transformer sharded in one call.

Files: plan.py (the plan: discovery, and each entry resolved once to its
layout), layouts/ (the attention, MLP and experts layouts it knows, the table of
model families they read, and their head bookkeeping), layers.py (the head-aware column/row
projections), norms.py (norms beside split heads), vocabulary.py
(vocabulary-parallel embeddings and LM head, tied modules included), loss.py
(the LM loss from the shards), logits.py (the logits a user reads, whole),
hf_methods.py (save_pretrained, push_to_hub and generate of a parallelized
Hugging Face model), apply.py (``parallelize``), left_whole.py (what stays
whole), report.py (``verbose``), lora.py, lora_layers.py and adapter_save.py
(peft's LoRA on the split projections); pretrained.py (``from_pretrained``,
``from_config``: models no rank holds whole; here because they call
``parallelize``, their steps in shardtorch/pretrained/ beside
``save_pretrained``). See docs/parallelize.md and docs/pretrained.md.
"""
from .apply import parallelize
from .left_whole import unplaced
from .adapter_save import save_adapter
from .lora import lora_config
from .loss import VocabParallelCausalLMLoss, VocabParallelLMLoss, causal_lm_loss
from .plan import STYLES, auto_plan
from .pretrained import from_config, from_pretrained

__all__ = ["parallelize", "from_pretrained", "from_config", "auto_plan", "unplaced", "STYLES", "causal_lm_loss", "VocabParallelLMLoss",
           "VocabParallelCausalLMLoss", "lora_config", "save_adapter"]
