"""How much state an optimizer keeps on the device, from its dotted name, its kwargs and the
trainable parameters' shapes (the memory planner's optimizer terms).

Two kinds of state, which add up:

- dense: ``dense_states`` tensors the size of each trainable parameter (AdamW: the first and
  second moments, 2; SGD with momentum: the momentum buffer, 1; plain SGD: none);
- factored (Adafactor's second moment): for a parameter of two or more dims, a row statistic
  and a column statistic over its last two dims, ``prod(shape[:-2]) * (rows + cols)`` values;
  for a vector (or a scalar) a full-size variance. ``factored_state_elements`` counts them.

Shape legend: ``shape`` is a parameter's dims; its rows and columns are ``shape[-2:]``.

An optimizer this table does not know counts as ``DEFAULT_DENSE_STATES`` (AdamW's 2): over the
mark for lighter optimizers (8-bit AdamW keeps about a quarter of that), never under it for the
Adam family most unknown names belong to.

All functions are pure.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

from attrs import frozen

__all__ = [
    "DEFAULT_DENSE_STATES",
    "OptimizerMemory",
    "factored_state_elements",
    "optimizer_memory",
]

DEFAULT_DENSE_STATES = 2
# Parameter-sized state tensors per optimizer class (the dotted name's last part), before the
# kwargs that add one (amsgrad, momentum, centered).
_DENSE_STATES = {
    "Adam": 2,
    "AdamW": 2,
    "Adamax": 2,  # exp_avg, exp_inf
    "NAdam": 2,
    "RAdam": 2,
    "Adadelta": 2,  # square_avg, acc_delta
    "Rprop": 2,  # prev, step_size
    "Adagrad": 1,  # sum
    "ASGD": 1,  # ax
    "RMSprop": 1,  # square_avg (+ momentum_buffer, + grad_avg when centered)
    "SGD": 0,  # (+ momentum_buffer)
}


@frozen(kw_only=True)
class OptimizerMemory:
    """An optimizer's state in the planner's terms.

    ``dense_states``: tensors the size of each trainable parameter; ``factored``: plus
    Adafactor's factored second moment (`factored_state_elements`); ``per_tensor_update``: the
    step updates one parameter at a time, so its temporary is the largest parameter's size
    rather than all of them at once (torch's Adafactor unless ``foreach=True``).
    """

    dense_states: int
    factored: bool = False
    per_tensor_update: bool = False


def optimizer_memory(name: str, kwargs: Mapping[str, object]) -> OptimizerMemory:
    """The state `name` (a dotted class path; only its last part is read) keeps with `kwargs`.

    Adafactor (``torch.optim.Adafactor``, or ``transformers.optimization.Adafactor``, whose
    ``beta1`` adds a first moment and ``factored=False`` keeps a dense second moment instead);
    the torch optimizers of `_DENSE_STATES`; anything else ``DEFAULT_DENSE_STATES``.
    """
    cls = name.rpartition(".")[2]
    if cls == "Adafactor":
        factored = bool(kwargs.get("factored", True))
        first_moment = kwargs.get("beta1") is not None
        return OptimizerMemory(
            dense_states=int(first_moment) + int(not factored),
            factored=factored,
            per_tensor_update=not kwargs.get("foreach"),
        )
    if cls not in _DENSE_STATES:
        return OptimizerMemory(dense_states=DEFAULT_DENSE_STATES)
    states = _DENSE_STATES[cls]
    if cls in ("Adam", "AdamW") and kwargs.get("amsgrad"):
        states += 1  # max_exp_avg_sq
    if cls in ("SGD", "RMSprop") and kwargs.get("momentum"):
        states += 1  # momentum_buffer
    if cls == "RMSprop" and kwargs.get("centered"):
        states += 1  # grad_avg
    return OptimizerMemory(dense_states=states)


def factored_state_elements(shapes: Iterable[Sequence[int]]) -> int:
    """Values of Adafactor's factored second moment over parameters of these `shapes`: per
    parameter of two or more dims ``prod(shape[:-2]) * (shape[-2] + shape[-1])``, per vector
    or scalar its size."""
    total = 0
    for shape in shapes:
        if len(shape) >= 2:
            total += math.prod(shape[:-2]) * (shape[-2] + shape[-1])
        else:
            total += math.prod(shape)
    return total
