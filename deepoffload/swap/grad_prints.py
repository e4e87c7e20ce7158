"""What a gradient holds, recorded when an optimizer step uses it, to see any change made to it afterwards.

A version counter does not see every change: ``grad.data.mul_()``, ``torch._amp_foreach_non_finite_check_and_unscale_``
(GradScaler's unscale) and ``p.grad = other`` leave ``p.grad._version`` as it was. A ``GradPrint`` records the
gradient's identity (a weak reference), its data pointer and its storage's, its version and a digest of its bytes;
``GradPrint.changed`` compares them all with the parameter's gradient now.

The digest of a CPU gradient is the xxh3-64 of its bytes (several GB/s: two passes over the gradients per step, one
when backward uses them and one at ``step()``). On another device (no copy to the host) it reads the bytes as 32-bit
words ``w[i]`` (bytes when the size is not a multiple of 4) and keeps ``sum(w[i])`` and
``sum(w[i] * (2654435761 * i + 1))``, both modulo 2**64, computed there in slices of ``_SLICE`` words (temporaries of
at most 16 MiB): any change of one word changes the first sum; several changes would have to cancel in both.

A ``GroupPrint`` records the param groups' settings (``lr``, ``betas``, ...; tensors cloned) the same way: backward
steps with them, so one changed before ``step()`` would apply a step late.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from .records import hash_bytes

_SLICE = 1 << 20  # words digested at a time (int64 temporaries of 8 MiB each)
_MULTIPLIER = 2654435761


def _dense(tensor: torch.Tensor) -> bool:
    """Whether the tensor's elements fill its memory span exactly, in some order (``channels_last``, transposed)."""
    expected = 1
    for stride, size in sorted((t, s) for s, t in zip(tensor.shape, tensor.stride()) if s != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _words(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, as 32-bit words when they divide evenly, else as bytes (a flat view, or a copy)."""
    # A view of its memory when its elements fill it exactly (channels_last, transposed): the same bytes in the order
    # they are stored, without a copy; else a contiguous copy.
    flat = tensor.detach()
    if flat.is_conj():
        flat = flat.resolve_conj()
    if flat.is_neg():
        flat = flat.resolve_neg()
    if not flat.is_contiguous() and _dense(flat):
        flat = flat.as_strided((flat.numel(),), (1,), flat.storage_offset())
    raw = flat.contiguous().reshape(-1).view(torch.uint8)
    return raw.view(torch.int32) if raw.numel() % 4 == 0 else raw


@torch.no_grad()
def digest(tensor: torch.Tensor) -> tuple[int, ...]:
    """A digest of a strided tensor's bytes (see the module docstring).

    Args:
        tensor: A strided tensor, on any device.

    Returns:
        On the CPU, the xxh3-64 of its bytes; elsewhere the plain and the position-weighted sum of its words.
    """
    words = _words(tensor)
    if words.device.type == "cpu":
        return (hash_bytes(words.view(torch.uint8)),)
    return _sums(words)


def _sums(words: torch.Tensor) -> tuple[int, int]:
    """The plain and the position-weighted sum of ``words`` modulo 2**64, on their device, in slices."""
    plain = torch.zeros((), dtype=torch.int64, device=words.device)
    weighted = torch.zeros((), dtype=torch.int64, device=words.device)
    for start in range(0, words.numel(), _SLICE):
        part = words[start : start + _SLICE].to(torch.int64)
        index = torch.arange(start, start + part.numel(), dtype=torch.int64, device=words.device)
        plain += part.sum()
        weighted += (part * (index * _MULTIPLIER + 1)).sum()
    return int(plain), int(weighted)


class GradPrint:
    """A parameter's gradient as a step used it: identity, data pointers, version and digest.

    Args:
        grad: The gradient (strided).
    """

    __slots__ = ("data_ptr", "digest", "ref", "storage_ptr", "version")

    def __init__(self, grad: torch.Tensor):
        self.ref = weakref.ref(grad)
        self.data_ptr = grad.data_ptr()
        self.storage_ptr = grad.untyped_storage().data_ptr()
        self.version = grad._version
        self.digest = digest(grad)

    def changed(self, grad: torch.Tensor | None) -> str | None:
        """How ``grad`` (the parameter's gradient now) differs from the one recorded.

        Args:
            grad: The parameter's ``.grad`` now.

        Returns:
            What changed ("set to None", "replaced", "moved", "changed in place", "values changed"), or None when
            it is the same tensor holding the same bytes.
        """
        if grad is None:
            return "set to None"
        if self.ref() is not grad:
            return "replaced"
        if grad.data_ptr() != self.data_ptr or grad.untyped_storage().data_ptr() != self.storage_ptr:
            return "moved"
        if grad._version != self.version:
            return "changed in place"
        if digest(grad) != self.digest:
            return "values changed"
        return None


def _frozen(value: Any) -> Any:
    """A copy of a param group's value that later changes cannot reach (tensors cloned, sequences copied)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (tuple, list)):
        return type(value)(_frozen(v) for v in value)
    return value


def _same(recorded: Any, value: Any) -> bool:
    """Whether ``value`` still equals ``recorded`` (a ``_frozen`` copy): same types, tensors equal."""
    if isinstance(recorded, torch.Tensor):
        return isinstance(value, torch.Tensor) and recorded.dtype == value.dtype and torch.equal(recorded, value)
    if isinstance(recorded, (tuple, list)):
        return (
            type(recorded) is type(value)
            and len(recorded) == len(value)
            and all(_same(r, v) for r, v in zip(recorded, value))
        )
    try:
        return type(recorded) is type(value) and bool(recorded == value)
    except (TypeError, ValueError, RuntimeError):  # (a value whose == is not a plain bool)
        return recorded is value


class GroupPrint:
    """An optimizer's param groups' settings (``lr``, ``betas``, ``weight_decay``, ...) as a step used them.

    Args:
        groups: The optimizer's ``param_groups``.
        defaults: The optimizer's ``defaults``: a setting added later is compared when it is one of them.
    """

    def __init__(self, groups: list[dict[str, Any]], defaults: dict[str, Any]):
        self.defaults = set(defaults)
        self.groups = [(group, {k: _frozen(v) for k, v in group.items() if k != "params"}) for group in groups]

    def changed(self, groups: list[dict[str, Any]]) -> str | None:
        """The first setting of a recorded group that differs in ``groups`` now (a group no longer there: none).

        Args:
            groups: The optimizer's ``param_groups`` now.

        Returns:
            ``"'lr' of param group 0"`` or the like, or None when every setting is as recorded.
        """
        present = {id(group): index for index, group in enumerate(groups)}
        for group, recorded in self.groups:
            index = present.get(id(group))
            if index is None:
                continue
            for key in set(recorded) | (set(group) & self.defaults):
                if key != "params" and (
                    key not in recorded or key not in group or not _same(recorded[key], group[key])
                ):
                    return f"{key!r} of param group {index}"
        return None
