"""Clipping by a global gradient norm when the gradients are never all in memory at once.

The arithmetic of ``torch.nn.utils.clip_grad_norm_`` is split into steps that can run tensor by tensor, so the
results are bit-identical
(``tests/swap/params/test_params_clipping.py::test_clipped_training_bit_identical_to_in_memory``).

torch (2.13) computes one norm per gradient (``torch._foreach_norm`` for each (device, dtype) group where foreach is
supported, else ``torch.linalg.vector_norm`` per tensor; either way a tensor's norm does not depend on the other
tensors of its list), stacks the norms in the order of its (device, dtype) grouping, takes their norm, and multiplies
every gradient by ``min(max_norm / (total + 1e-6), 1)`` (``torch._foreach_mul_`` per group, elementwise). Here:
``tensor_norms`` for any subset of the gradients, ``total_norm`` of all those norms given in the parameters' order
(it regroups them with torch's own grouping function, so the stacking order is torch's), ``clip_coefficient``, and
``scale_`` for any subset. The grouping helpers come from ``torch.utils._foreach_utils``, as in torch's clipping.
"""

from __future__ import annotations

import math
from typing import Sequence, cast

import torch
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype, _has_foreach_support


def check_clip_args(max_norm: object, norm_type: object) -> None:
    """Raise ValueError for a ``max_norm`` that is not a number >= 0 or a ``norm_type`` that is not a number."""
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm >= 0:
        raise ValueError(
            f"clip_grad_norm={max_norm!r}: expected the largest allowed gradient norm, a number >= 0 "
            f"(None: no clipping)"
        )
    if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)) or math.isnan(norm_type):
        raise ValueError(f"norm_type={norm_type!r}: expected the order of the norm, a number (2.0, math.inf, ...)")


def _groups(tensors: Sequence[torch.Tensor]) -> list[tuple[torch.device, list[torch.Tensor], list[int]]]:
    """torch's (device, dtype) groups of ``tensors``, in torch's order: (device, tensors, their indices)."""
    if not tensors:
        return []
    grouped = _group_tensors_by_device_and_dtype([list(tensors)], with_indices=True)
    # (torch types the groups' items as optional tensors: None only where the input had None, which it has not)
    return [(device, cast("list[torch.Tensor]", group), indices) for (device, _), ([group], indices) in grouped.items()]


@torch.no_grad()
def tensor_norms(tensors: Sequence[torch.Tensor], norm_type: float) -> list[torch.Tensor]:
    """The ``norm_type``-norm of each tensor (0-dim, its dtype and device), in the order given."""
    norms: list[torch.Tensor | None] = [None] * len(tensors)
    for device, group, indices in _groups(tensors):
        if _has_foreach_support(group, device):
            values: Sequence[torch.Tensor] = torch._foreach_norm(group, float(norm_type))
        else:
            values = [torch.linalg.vector_norm(t, float(norm_type)) for t in group]
        for index, value in zip(indices, values):
            norms[index] = value
    return norms  # type: ignore[return-value]


@torch.no_grad()
def total_norm(norms: Sequence[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The norm of all gradients from their ``tensor_norms``.

    Args:
        norms: The gradients' norms, given in the order torch would see the gradients (``module.parameters()``,
            those with a gradient).
        norm_type: The order of the norm.

    Returns:
        The total norm (0-dim, on the first norm's device); 0.0 when there are none.
    """
    if not norms:
        return torch.tensor(0.0)
    first_device = norms[0].device
    stacked = [norm.to(first_device) for _, group, _ in _groups(norms) for norm in group]
    return torch.linalg.vector_norm(torch.stack(stacked), float(norm_type))


def clip_coefficient(max_norm: float, total: torch.Tensor) -> torch.Tensor:
    """What every gradient is multiplied by: ``min(max_norm / (total + 1e-6), 1)`` (0-dim, ``total``'s device)."""
    return torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)


@torch.no_grad()
def scale_(tensors: Sequence[torch.Tensor], coefficient: torch.Tensor) -> None:
    """Multiply each tensor in place by ``coefficient``, as torch's clipping does."""
    for device, group, _ in _groups(tensors):
        if _has_foreach_support(group, device):
            torch._foreach_mul_(group, coefficient.to(device))
        else:
            on_device = coefficient.to(device)
            for tensor in group:
                tensor.mul_(on_device)
