"""Models for the one-process tests' faults: each behaves differently on one rank (its worker's RANK)."""
import os

import torch
from torch import nn


class _Faulty(nn.Module):
    """A small MLP whose forward does ``fault`` on ``rank`` once ``armed`` (an input flag), so that the
    build's proof and a first forward run normally."""

    def __init__(self, rank: int):
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)
        self.rank = rank

    def forward(self, x, armed: bool = False):
        hidden = torch.relu(self.up(x))
        if armed and int(os.environ.get("RANK", "-1")) == self.rank:
            self.fault()
        return self.down(hidden)


class RaisesOnOneRank(_Faulty):
    def fault(self):
        raise ValueError("raised on purpose on one rank")


class ExitsOnOneRank(_Faulty):
    def fault(self):
        os._exit(7)
