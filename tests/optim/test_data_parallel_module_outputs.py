"""What ``AutoParallel(net, parallel_mode="data_parallel")`` (the module form) returns.

A network that computes its own loss (Hugging Face's ``out.loss``, a dict's, a tuple's, a bare
0-d loss) returned each rank's own loss on its rows, while the train-step form and semi_auto's
module form return the global batch's: now the loss's value is the ranks' mean (DDP's rule),
the same on every rank, and its gradient stays this rank's, so ``out.loss.backward()`` and the
optimizer step's average give one device's gradients (nothing divided twice). Under
``"full_batch"`` a dict's or a dataclass's other tensors were left as this rank's rows (only a
bare tensor, tuple or list was gathered): now every output is whole on every rank, also a
dataclass field set after construction (``field(init=False)``, which rebuilding the output
once dropped).
Two simulated ranks against one device, two SGD + momentum steps, float32 at 1e-5.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.testing import assert_matches_single_device, simulated_world

KINDS = ("dict", "dataclass", "tuple", "bare")
g = torch.Generator().manual_seed(1)
DATA = [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in "ab"]


@dataclasses.dataclass
class Output:  # (Hugging Face's ModelOutput is a dataclass with these fields)
    loss: torch.Tensor
    logits: torch.Tensor
    rows: torch.Tensor  # (an integer 0-d value: no loss, this rank's own)
    probs: torch.Tensor = dataclasses.field(init=False)  # (set after construction)


class Classifier(nn.Module):
    """Computes its loss in forward and returns it as `kind` says."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
        self.kind = kind

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> Any:
        logits = self.body(x)
        loss = F.cross_entropy(logits, labels)
        if self.kind == "dict":
            return {"loss": loss, "logits": logits}
        if self.kind == "dataclass":
            out = Output(loss, logits, torch.tensor(x.shape[0]))
            out.probs = logits.softmax(-1)
            return out
        if self.kind == "tuple":
            return loss, logits
        return loss


def loss_of(out: Any) -> torch.Tensor:
    if isinstance(out, dict):
        return out["loss"]
    if isinstance(out, Output):
        return out.loss
    return out[0] if isinstance(out, tuple) else out


def logits_of(out: Any) -> torch.Tensor | None:
    if isinstance(out, dict):
        return out["logits"]
    if isinstance(out, Output):
        return out.logits
    return out[1] if isinstance(out, tuple) else None


def train(net: nn.Module, call: Any) -> list[tuple[Any, dict[str, torch.Tensor]]]:
    """Each step's output and the gradients its optimizer step used (``out.loss.backward()``
    in the user's loop; the optimizer built after the wrapper, as the module form documents)."""
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    seen = []
    for x, y in DATA:
        out = call(x, y)
        loss_of(out).backward()
        opt.step()  # (data_parallel mode averages the gradients in the step's pre-hook)
        seen.append((out, {n: p.grad.clone() for n, p in net.named_parameters()}))
        opt.zero_grad()
    return seen


@pytest.mark.parametrize("strategy", ["data_parallel", "full_batch"])
@pytest.mark.parametrize("kind", KINDS)
def test_module_form_returns_the_global_loss_and_trains_as_one_device(
    kind: str, strategy: str
) -> None:
    ref = Classifier(kind)
    want = train(ref, ref)
    net = Classifier(kind)
    with simulated_world(2) as world:
        world.replicate(net)
        parallel = sw.AutoParallel(net, parallel_mode="data_parallel").dataset_strategy(strategy)
        give = world.rows if strategy == "data_parallel" else world.same
        got = train(net, lambda x, y: parallel(give(x), labels=give(y)))
        for i, ((out, grads), (one, one_grads)) in enumerate(zip(got, want, strict=True)):
            assert_matches_single_device(loss_of(out), loss_of(one).detach(), what=f"loss {i}")
            assert_matches_single_device(grads, one_grads, what=f"gradients {i}")
            logits, whole = logits_of(out), logits_of(one)
            if logits is not None and whole is not None:  # (rows, or whole under full_batch)
                expected = give(whole.detach())
                assert_matches_single_device(logits, expected, what=f"logits {i}")
            if isinstance(out, Output):  # (an integer 0-d value stays this rank's: its rows)
                assert out.rows.item() == 4
                probs = give(one.probs.detach())  # (a field set after construction: kept)
                assert_matches_single_device(out.probs, probs, what=f"probs {i}")
        params = {n: p.detach() for n, p in net.named_parameters()}
        assert_matches_single_device(params, dict(ref.named_parameters()), what="parameters")
