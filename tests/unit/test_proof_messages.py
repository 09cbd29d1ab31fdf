"""The proof's refusal messages (shardtorch/nn/whole_model/proof.py's explain), written out for the cases
a rank meets: its own mismatch, and none of its own while another rank's numbers differ (every rank
raises; none may fail to build its message)."""
import torch

from shardtorch.nn.whole_model.plan import Placement
from shardtorch.nn.whole_model.proof import explain


def _placements():
    return [Placement("blocks.0.attn", "attention", torch.nn.Linear(2, 2)),
            Placement("blocks.1.attn", "attention", torch.nn.Linear(2, 2))]


def test_a_rank_whose_own_numbers_agree_points_to_the_other_rank():
    message = explain([], _placements(), torch.float64, 1e-6, False)
    assert "on another rank of the group" in message and "1e-06" in message


def test_a_module_mismatch_names_it_and_every_module_of_its_kind():
    message = explain([("module", "blocks.0.attn", 0.5)], _placements(), torch.float64, 1e-6, False)
    assert "'blocks.0.attn'" in message and "'blocks.1.attn': 'replicate'" in message
    assert "partly split" in message
    unsplit = explain([("module", "blocks.0.attn", 0.5)], _placements(), torch.float64, 1e-6, False, split=False)
    assert "Nothing is split" in unsplit and "partly split" not in unsplit
