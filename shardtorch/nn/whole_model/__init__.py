"""``ts.nn.parallelize`` (this package: ``shardtorch.nn.whole_model``): a whole transformer sharded in one call.

Files: plan.py (the plan: discovery and checks), blocks.py (the attention and
MLP layouts it knows and their head bookkeeping), layers.py (the head-aware
column/row projections), vocabulary.py (vocabulary-parallel embedding, LM
head and loss), apply.py (``parallelize``), report.py (``verbose``);
pretrained.py (``from_pretrained``, ``from_config``: models no rank holds
whole) with model_source.py, meta_build.py, materialize.py, init_replay.py.
See docs/parallelize.md.
"""
from .apply import parallelize
from .plan import STYLES, auto_plan, unplaced
from .pretrained import from_config, from_pretrained
from .vocabulary import VocabParallelCausalLMLoss, causal_lm_loss

__all__ = ["parallelize", "from_pretrained", "from_config", "auto_plan", "unplaced", "STYLES", "causal_lm_loss", "VocabParallelCausalLMLoss"]
