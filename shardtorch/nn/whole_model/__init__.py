"""``ts.nn.parallelize`` (this package: ``shardtorch.nn.whole_model``): a whole transformer sharded in one call.

Files: plan.py (the plan: discovery, and each entry resolved once to its
layout), layouts/ (the attention, MLP and experts layouts it knows, by family,
and their head bookkeeping), layers.py (the head-aware column/row
projections), norms.py (norms beside split heads), vocabulary.py
(vocabulary-parallel embeddings and LM head, tied modules included), loss.py
(the LM loss from the shards), apply.py (``parallelize``), left_whole.py (what
stays whole), report.py (``verbose``). See docs/parallelize.md.
"""
from .apply import parallelize
from .left_whole import unplaced
from .loss import VocabParallelCausalLMLoss, VocabParallelLMLoss, causal_lm_loss
from .plan import STYLES, auto_plan

__all__ = ["parallelize", "auto_plan", "unplaced", "STYLES", "causal_lm_loss", "VocabParallelLMLoss",
           "VocabParallelCausalLMLoss"]
