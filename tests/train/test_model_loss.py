"""What `Model.train` takes as a step's loss (a tensor, a tuple whose first item is the
loss, a mapping's or Hugging Face ModelOutput's "loss") and its errors for a loss or a batch it
cannot use: a `loss_fn` that is not callable, a loss of several values, more columns than the
network's ``forward`` takes."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers.modeling_outputs import SequenceClassifierOutput

import shardwise as sw


def _data(steps: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g))
        for _ in range(steps)
    ]


class WithLoss(nn.Module):
    """Returns the loss (`aux`: ``(loss, logits)``), computed from the label it is given."""

    def __init__(self, aux: bool | str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.aux = nn.Linear(6, 3), aux

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> object:
        logits = self.lin(x)
        loss = nn.functional.cross_entropy(logits, y)
        if self.aux == "ModelOutput":  # (as a Hugging Face model given its labels returns)
            return SequenceClassifierOutput(loss=loss, logits=logits)
        return (loss, logits) if self.aux else loss


class Losses(sw.train.Callback):
    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_step_end(self, ctx: sw.train.RunContext) -> None:
        self.values.append(sw.train.callbacks.loss_value(ctx.net_outputs))


def _trained(net: nn.Module, loss_fn: object = None) -> tuple[list[float], nn.Module]:
    model = sw.Model(net, loss_fn, torch.optim.SGD(net.parameters(), 0.1))  # type: ignore[arg-type]
    losses = Losses()
    model.train(2, _data(), callbacks=[losses, sw.train.LossMonitor(0)])
    return losses.values, net


def test_a_network_returning_loss_and_logits_trains_on_the_loss() -> None:
    """``loss_fn=None`` and a network returning ``(loss, logits)``: LossMonitor read the tuple's
    first item, but the step called ``.backward()`` on the tuple (AttributeError)."""
    plain, plain_net = _trained(WithLoss(aux=False))
    aux, aux_net = _trained(WithLoss(aux=True))
    assert aux == plain and len(aux) == 6
    torch.testing.assert_close(aux_net.state_dict(), plain_net.state_dict(), rtol=0, atol=0)


def test_a_network_returning_a_model_output_trains_on_its_loss() -> None:
    plain, plain_net = _trained(WithLoss(aux=False))
    hf, hf_net = _trained(WithLoss(aux="ModelOutput"))
    assert hf == plain and len(hf) == 6
    torch.testing.assert_close(hf_net.state_dict(), plain_net.state_dict(), rtol=0, atol=0)


def test_a_loss_fn_returning_a_tuple_trains_on_its_first_item() -> None:
    torch.manual_seed(0)
    plain, plain_net = _trained(nn.Linear(6, 3), nn.CrossEntropyLoss())
    torch.manual_seed(0)
    aux, aux_net = _trained(
        nn.Linear(6, 3), lambda out, y: (nn.functional.cross_entropy(out, y), out.sum())
    )
    assert aux == plain
    torch.testing.assert_close(aux_net.state_dict(), plain_net.state_dict(), rtol=0, atol=0)


def _sgd(net: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(net.parameters(), 0.1)


def _three_columns() -> list[tuple[torch.Tensor, ...]]:
    x, y = _data(1)[0]
    return [(x, x, y)]


@pytest.mark.parametrize(
    ("call", "exc", "message"),
    [
        (
            lambda: sw.Model(nn.Linear(6, 3), "cross_entropy", None),  # type: ignore[arg-type]
            TypeError,
            r"loss_fn='cross_entropy' must be callable .* pass torch.nn.CrossEntropyLoss\(\)",
        ),
        (
            lambda: sw.Model(nn.Linear(6, 3), nn.CrossEntropyLoss, None),  # type: ignore[arg-type]
            TypeError,
            r"loss_fn=<class .*CrossEntropyLoss'> .* an instance, CrossEntropyLoss\(\)",
        ),
        (
            lambda: sw.Model(
                net := nn.Linear(6, 3), nn.CrossEntropyLoss(reduction="none"), _sgd(net)
            ).train(1, _data(1)),
            ValueError,
            r"loss_fn returned a loss of shape \[4\], not one value; .* reduction='mean'",
        ),
        (
            lambda: sw.Model(net := nn.Linear(6, 3), lambda o, y: {"logits": o}, _sgd(net)).train(
                1, _data(1)
            ),
            TypeError,
            r"loss_fn returned dict; .* a tuple whose first item is the loss, .* or a mapping "
            r"\(a Hugging Face ModelOutput: pass labels\) whose 'loss' is it",
        ),
        (
            lambda: sw.Model(net := nn.Linear(6, 3), nn.CrossEntropyLoss(), _sgd(net)).train(
                1, _three_columns()
            ),
            TypeError,
            r"Model.train: each batch has 3 column\(s\), passed as 2 input\(s\) and the label "
            r".* but Linear.forward\(input.*\) does not take 2 positional input\(s\)",
        ),
        (
            lambda: sw.Model(net := WithLoss(False), None, _sgd(net)).train(1, _three_columns()),
            TypeError,
            r"3 column\(s\), passed as 3 input\(s\) \(loss_fn=None: all columns go to the "
            r"network\), but WithLoss.forward\(x: 'torch.Tensor', y: 'torch.Tensor'\)",
        ),
        (
            lambda: sw.Model(nn.Linear(6, 3), metrics={"accuracy"}).eval(_three_columns()),
            TypeError,
            r"Model.eval: each batch has 3 column\(s\)",
        ),
    ],
)
def test_loss_and_column_errors(call, exc: type[Exception], message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(exc, match=message):
        call()


def test_a_type_error_inside_forward_is_torchs_own() -> None:
    """Only a batch ``forward`` cannot take is named as such: an error inside it stands."""

    class Broken(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x, x)  # type: ignore[call-arg]

    net = Broken(6, 3)
    with pytest.raises(TypeError, match="positional argument") as caught:
        sw.Model(net, nn.CrossEntropyLoss(), _sgd(net)).train(1, _data(1))
    assert "column" not in str(caught.value)


def test_a_type_error_inside_forward_given_inputs_by_a_hook_is_torchs_own() -> None:
    """A forward pre-hook passing ``forward`` another input than the batch's: the batch alone
    does not fit ``forward``'s signature, but the TypeError came from inside it (a review found
    it named as a column mismatch, torch's traceback dropped)."""

    class Scaled(nn.Linear):
        def forward(self, x: torch.Tensor, scale: float) -> torch.Tensor:  # type: ignore[override]
            return super().forward(x) * scale + None  # type: ignore[operator]

    net = Scaled(6, 3)
    net.register_forward_pre_hook(lambda module, args: (args[0], 2.0))
    with pytest.raises(TypeError, match="unsupported operand") as caught:
        sw.Model(net, nn.CrossEntropyLoss(), _sgd(net)).train(1, _data(1))
    assert "column" not in str(caught.value)


def test_a_decorated_forward_missing_a_column_is_named() -> None:
    """``forward`` under a ``functools.wraps`` decorator (``torch.autocast`` as one): the
    decorator's frame runs when the binding fails, so the column message was lost (a review
    found it); the decorated function's own code tells the two apart."""
    import functools

    def traced(fn):  # type: ignore[no-untyped-def]
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):  # type: ignore[no-untyped-def]
            return fn(*args, **kwargs)

        return wrapper

    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(6, 3)

        @traced
        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return self.fc(x) + y

    net = Two()
    with pytest.raises(TypeError, match=r"Model\.train: each batch has 2 column"):
        sw.Model(net, nn.CrossEntropyLoss(), _sgd(net)).train(1, _data(1))
