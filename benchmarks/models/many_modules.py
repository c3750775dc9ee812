"""A model of many small modules (issue 9.21): ``n`` cells of two Linears each, 3 modules a cell.

    fsdp-plan benchmarks/models/many_modules.py --model-arg n=3333 --mem 1GB --seq-len 8
plans 10,006 modules; planning time must grow near-linearly with ``n``.
"""

import torch
from torch import nn


class Cell(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.a = nn.Linear(d, d)
        self.b = nn.Linear(d, d)

    def forward(self, x):
        return x + self.b(torch.relu(self.a(x)))


class Net(nn.Module):
    def __init__(self, n, d):
        super().__init__()
        self.emb = nn.Embedding(100, d)
        self.cells = nn.ModuleList(Cell(d) for _ in range(n))
        self.head = nn.Linear(d, 100)

    def forward(self, x):
        h = self.emb(x)
        for c in self.cells:
            h = c(h)
        return self.head(h)


def build_model(n=3333, d=16):
    return Net(n, d)
