"""What a block's forward depends on besides its inputs, parameters and buffers, put back for its recompute.

It is captured at the forward and put back for the block's recompute in backward, so the recompute runs the same
kernels on the same values as the forward did.

``torch.utils.checkpoint`` restores autocast (``_get_autocast_kwargs``) and the RNG; a streamed block's recompute
is the same problem, and backward runs wherever the user calls it (outside ``torch.autocast``, under other flags).
``ForwardState.capture(tensors)`` records, at the forward:
- autocast of every device type (enabled, dtype) and whether its cast cache is on;
- the CPU RNG state and that of the devices the inputs live on (dropout draws the same masks);
- the global settings that choose kernels or their precision: ``torch.backends`` flags (TF32 and reduced-precision
  reductions, cuDNN enabled/benchmark/deterministic, mkldnn, fused scaled-dot-product kernels, opt_einsum),
  ``torch.set_float32_matmul_precision``, deterministic algorithms, and the default dtype and device.
``state.restored()`` is a context manager that puts all of them back (only those that differ now), with grad mode
enabled, and restores the caller's on exit.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.utils.checkpoint import get_device_states, set_device_states

# autocast device types torch knows; those this torch cannot query are dropped on first use
_AUTOCAST_TYPES = ("cpu", "cuda", "xpu", "mps", "hpu", "xla", "mtia", "maia", "ipu", "privateuseone")
_autocast_types: tuple[str, ...] | None = None


def autocast_types() -> tuple[str, ...]:
    """The autocast device types this torch can query (found once, then cached)."""
    global _autocast_types
    if _autocast_types is None:
        known = []
        for device_type in _AUTOCAST_TYPES:
            try:
                if torch.amp.is_autocast_available(device_type):
                    torch.is_autocast_enabled(device_type)
                    torch.get_autocast_dtype(device_type)
                    known.append(device_type)
            except (RuntimeError, ValueError):
                pass  # this torch build has no autocast for that device type: not one to record
        _autocast_types = tuple(known)
    return _autocast_types


def _attribute(owner: Callable[[], Any], name: str) -> tuple[Callable[[], Any], Callable[[Any], None]]:
    return (lambda: getattr(owner(), name)), (lambda value: setattr(owner(), name, value))


def _flags() -> list[tuple[str, Callable[[], Any], Callable[[Any], None]]]:
    """(name, getter, setter) of the global settings that choose kernels or their precision.

    Returns:
        Those that exist in this torch, the fp32_precision settings first (setting one of the allow_tf32 flags
        rewrites them).
    """
    b = torch.backends
    candidates: list[tuple[str, Callable[[], Any], Callable[[Any], None]]] = []
    # cudnn.conv and mkldnn's matmul, conv and rnn: attributes of the module objects recent torch puts in place of
    # torch.backends.cudnn and .mkldnn (unseen by type checkers), absent from older torch; getattr gives None there,
    # whose fp32_precision raises AttributeError below, so the flag is skipped as before
    owners: tuple[tuple[Callable[[], Any], str], ...] = (
        (lambda: b, "backends"),
        (lambda: b.cuda.matmul, "cuda.matmul"),
        (lambda: b.cudnn, "cudnn"),
        (lambda: getattr(b.cudnn, "conv", None), "cudnn.conv"),
        (lambda: b.cudnn.rnn, "cudnn.rnn"),
        (lambda: b.mkldnn, "mkldnn"),
        (lambda: getattr(b.mkldnn, "matmul", None), "mkldnn.matmul"),
        (lambda: getattr(b.mkldnn, "conv", None), "mkldnn.conv"),
        (lambda: getattr(b.mkldnn, "rnn", None), "mkldnn.rnn"),
    )
    for owner, path in owners:
        candidates.append((f"{path}.fp32_precision", *_attribute(owner, "fp32_precision")))
    for owner, path, names in (
        (
            lambda: b.cuda.matmul,
            "cuda.matmul",
            ("allow_tf32", "allow_fp16_reduced_precision_reduction", "allow_bf16_reduced_precision_reduction"),
        ),
        (lambda: b.cudnn, "cudnn", ("enabled", "benchmark", "deterministic", "allow_tf32")),
        (lambda: b.mkldnn, "mkldnn", ("enabled",)),
        (lambda: b.opt_einsum, "opt_einsum", ("enabled",)),
    ):
        for name in names:
            candidates.append((f"{path}.{name}", *_attribute(owner, name)))
    for kind in ("flash", "mem_efficient", "math", "cudnn"):
        getter = getattr(b.cuda, f"{kind}_sdp_enabled", None)
        setter = getattr(b.cuda, f"enable_{kind}_sdp", None)
        if getter is not None and setter is not None:
            candidates.append((f"cuda.{kind}_sdp", getter, setter))
    candidates += [
        ("float32_matmul_precision", torch.get_float32_matmul_precision, torch.set_float32_matmul_precision),
        (
            "deterministic_algorithms",
            lambda: (
                torch.are_deterministic_algorithms_enabled(),
                torch.is_deterministic_algorithms_warn_only_enabled(),
            ),
            lambda value: torch.use_deterministic_algorithms(value[0], warn_only=value[1]),
        ),
        ("default_dtype", torch.get_default_dtype, torch.set_default_dtype),
        ("default_device", torch.get_default_device, torch.set_default_device),
    ]
    flags: list[tuple[str, Callable[[], Any], Callable[[Any], None]]] = []
    for name, getter, setter in candidates:
        try:
            getter()
        except (AttributeError, RuntimeError):
            continue  # a flag this torch build lacks or cannot read: nothing to record or restore
        flags.append((name, getter, setter))
    return flags


_FLAGS: list | None = None


def flags() -> list[tuple[str, Callable[[], Any], Callable[[Any], None]]]:
    """(name, getter, setter) of the kernel settings that exist in this torch (found once, then cached)."""
    global _FLAGS
    if _FLAGS is None:
        _FLAGS = _flags()
    return _FLAGS


def _device_type(tensors: Sequence[torch.Tensor]) -> str | None:
    """The inputs' accelerator type; None (torch then uses the current accelerator's) when all are on the CPU."""
    return next((t.device.type for t in tensors if t.device.type != "cpu"), None)


@dataclass(frozen=True)
class ForwardState:
    """What a block's forward ran under, captured by ``capture`` and put back by ``restored`` (see the module).

    Attributes:
        autocast: (device type, enabled, dtype) of autocast for every device type this torch knows.
        autocast_cache: Whether autocast's cast cache was on.
        cpu_rng: The CPU RNG state.
        devices: The devices the inputs live on.
        device_rng: Their RNG states.
        device_type: The inputs' accelerator type (None: all on the CPU).
        settings: The values of the kernel settings, in ``flags()`` order.
    """

    autocast: tuple[tuple[str, bool, torch.dtype], ...]
    autocast_cache: bool
    cpu_rng: torch.Tensor
    devices: list
    device_rng: list
    device_type: str | None
    settings: tuple[Any, ...]

    @classmethod
    def capture(cls, tensors: Sequence[torch.Tensor]) -> "ForwardState":
        """The state now, at a forward given ``tensors``.

        Args:
            tensors: The forward's tensor inputs (their devices' RNG states are captured).

        Returns:
            The captured state.
        """
        device_type = _device_type(tensors)
        devices, device_rng = get_device_states(*tensors)
        return cls(
            autocast=_autocast_now(),
            autocast_cache=torch.is_autocast_cache_enabled(),
            cpu_rng=torch.get_rng_state(),
            devices=devices,
            device_rng=device_rng,
            device_type=device_type,
            settings=tuple(getter() for _, getter, _ in flags()),
        )

    @property
    def autocast_enabled(self) -> dict[str, torch.dtype]:
        """The device types autocast was on for at the forward, with their dtype."""
        return {device_type: dtype for device_type, enabled, dtype in self.autocast if enabled}

    @contextlib.contextmanager
    def restored(self) -> Iterator[None]:
        """Put the captured state back (only what differs now), with grad mode enabled; the caller's on exit.

        Yields:
            Nothing: the body runs under the captured state.
        """
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.random.fork_rng(devices=self.devices, device_type=self.device_type))
            torch.set_rng_state(self.cpu_rng)
            set_device_states(self.devices, self.device_rng, device_type=self.device_type)
            stack.enter_context(_settings_restored(self.settings))
            now = dict((d, (e, t)) for d, e, t in _autocast_now())
            for device_type, enabled, dtype in self.autocast:
                if enabled or now[device_type][0]:  # (not entered when off both then and now)
                    stack.enter_context(
                        torch.amp.autocast(device_type, dtype=dtype, enabled=enabled, cache_enabled=self.autocast_cache)
                    )
            stack.enter_context(torch.enable_grad())
            yield


def _autocast_now() -> tuple[tuple[str, bool, torch.dtype], ...]:
    return tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in autocast_types())


@contextlib.contextmanager
def _settings_restored(settings: tuple[Any, ...]) -> Iterator[None]:
    """The settings as captured, the caller's put back on exit (each set only where it differs)."""
    table = flags()
    current = tuple(getter() for _, getter, _ in table)
    changed = [k for k, (then, now) in enumerate(zip(settings, current)) if then != now]
    try:
        for k in changed:
            if table[k][1]() != settings[k]:  # (an earlier fp32_precision setting may have set it already)
                table[k][2](settings[k])
        yield
    finally:
        for k in reversed(changed):
            if table[k][1]() != current[k]:
                table[k][2](current[k])
