"""``ts.nn.parallelize`` (this package: ``shardtorch.nn.whole_model``): a whole transformer sharded in one call.

Files: plan.py (the plan: discovery and checks), blocks.py (the attention and
MLP layouts it knows and their head bookkeeping), layers.py (the head-aware
column/row projections), vocabulary.py (vocabulary-parallel embedding, LM
head and loss), apply.py (``parallelize``), report.py (``verbose``).
See docs/parallelize.md.
"""
from .apply import parallelize
from .plan import STYLES, auto_plan, unplaced
from .vocabulary import VocabParallelCausalLMLoss, causal_lm_loss

__all__ = ["parallelize", "auto_plan", "unplaced", "STYLES", "causal_lm_loss", "VocabParallelCausalLMLoss"]
