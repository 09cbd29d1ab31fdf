"""The Python twin of examples/cpp/train_classifier.cpp: the same model, seed,
data and optimiser through shardtorch's Python API, printing the same losses.

    torchrun --nproc-per-node 2 examples/python/train_classifier_twin.py [steps]
"""
import os
import sys

import torch
from torch import nn

import shardtorch as ts

SEED = 2024
SAMPLES, FEATURES, HIDDEN, CLASSES = 64, 20, 48, 11
LEARNING_RATE, MOMENTUM = 0.1, 0.9


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        # Constructed in the C++ order (register_module order = draw order).
        self.hidden = ts.nn.ParallelLinear(FEATURES, HIDDEN, dim=1)
        self.project = ts.nn.ParallelLinear(HIDDEN, HIDDEN, dim=0)
        self.head = ts.nn.ParallelLinear(HIDDEN, CLASSES, dim=1)

    def forward(self, features):
        x = torch.relu(self.hidden(features))
        x = torch.relu(self.project(x))
        return self.head(x)


def main():
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    ts.distributed.init_process_group(group_size=int(os.environ.get("WORLD_SIZE", "1")))
    torch.manual_seed(SEED)
    model = Classifier()
    features = torch.randn(SAMPLES, FEATURES)
    teacher = torch.randn(FEATURES, CLASSES)
    targets = features.matmul(teacher).argmax(1)
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE, momentum=MOMENTUM)
    # parallel=True as in C++, where tensors carry no marks to choose the mode by.
    loss_fn = ts.nn.ParallelCrossEntropyLoss(parallel=True, num_classes=CLASSES)
    for step in range(steps):
        optimizer.zero_grad()
        loss = loss_fn(model(features), targets)
        loss.backward()
        optimizer.step()
        if ts.distributed.get_rank() == 0:
            print(f"step {step} loss {loss.item():.9g}", flush=True)
    ts.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
