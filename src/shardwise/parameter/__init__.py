"""Parameters, initializers and delayed initialization (MindSpore's ``Parameter``,
``initializer`` and ``no_init_parameters`` on PyTorch).

- `_parameter`: `Parameter` (``nn.Parameter`` + ``name``, ``parallel_optimizer``,
  ``comm_fusion``), `set_comm_fusion`, `assign_tensor`, `tied_names`.
- `_initializer`: `initializer` and the initializer classes (`Normal`, `Uniform`, ...).
- `_deferred`: `no_init_parameters`, `materialize`, `materialized_values`, `is_deferred`;
  `_replace`: a deferred parameter replaced by a new object (per-rank values), optimizers
  re-pointed to it.
- `_recorder` / `_tape` / `_replay` / `_rng`: how deferred construction is recorded on meta
  tensors and replayed bit-identically (see docs/checkpoint.md, "Delayed initialization").
- `_blocks` / `_lower` / `_chunked` / `_box`: replaying a sliced tensor as its block only, its
  random fills drawn in chunks (see docs/parallel.md, "Delayed init").
"""

from shardwise.parameter._blocks import Slicer
from shardwise.parameter._deferred import (
    is_deferred,
    materialize,
    materialized_values,
    no_init_parameters,
)
from shardwise.parameter._errors import DeferredInitError, InitializerError
from shardwise.parameter._initializer import (
    VALID_NAMES,
    Constant,
    HeNormal,
    HeUniform,
    Initializer,
    Normal,
    One,
    TruncatedNormal,
    Uniform,
    XavierNormal,
    XavierUniform,
    Zero,
    fan_in_and_fan_out,
    initializer,
)
from shardwise.parameter._parameter import (
    DEFAULT_COMM_FUSION,
    Parameter,
    assign_tensor,
    comm_fusion_of,
    parallel_optimizer_of,
    set_comm_fusion,
    tied_names,
)

__all__ = [
    "DEFAULT_COMM_FUSION",
    "VALID_NAMES",
    "Constant",
    "DeferredInitError",
    "HeNormal",
    "HeUniform",
    "Initializer",
    "InitializerError",
    "Normal",
    "One",
    "Parameter",
    "Slicer",
    "TruncatedNormal",
    "Uniform",
    "XavierNormal",
    "XavierUniform",
    "Zero",
    "assign_tensor",
    "comm_fusion_of",
    "fan_in_and_fan_out",
    "initializer",
    "is_deferred",
    "materialize",
    "materialized_values",
    "no_init_parameters",
    "parallel_optimizer_of",
    "set_comm_fusion",
    "tied_names",
]
