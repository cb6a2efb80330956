"""Shared by the real-process manual-parallel test and its worker: data, network and loss."""

from __future__ import annotations

import torch
from torch import nn

import shardwise as sw
from shardwise.communication import get_group_size

GLOBAL_BATCH = 32
SAMPLES = 160  # 5 global batches per epoch


def make_samples() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    images = torch.randn(SAMPLES, 1, 28, 28, generator=g)
    labels = torch.randint(0, 10, (SAMPLES,), generator=g)
    return [(images[i], labels[i]) for i in range(SAMPLES)]


def make_network() -> nn.Module:
    return nn.Sequential(
        nn.Flatten(), nn.Linear(784, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)
    )


class ReduceLoss(nn.Module):
    """Cross entropy of this rank's rows, all-reduced and averaged over the ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.loss = nn.CrossEntropyLoss()

    def forward(self, logits: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        return sw.ops.AllReduce()(self.loss(logits, label)) / get_group_size()
