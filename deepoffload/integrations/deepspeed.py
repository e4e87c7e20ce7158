"""Run DeepSpeed's own NVMe code on deepoffload's async-IO op.

``enable()``, after ``import deepspeed``, replaces DeepSpeed's ``AsyncIOBuilder`` everywhere DeepSpeed binds it (its
op-builder package, ``deepspeed.ops.aio``, the ZeRO-Infinity swappers in ``deepspeed.runtime.swap_tensor``, the
fast checkpoint writer factory, the ``deepspeed.nvme`` benchmarks, and the accelerator's ``get_op_builder`` /
``create_op_builder``) with one whose ``load()`` returns deepoffload's DeepSpeed-compatible module, so DeepSpeed
never builds its own async_io op. The fast checkpoint writer's one use of DeepSpeed's compiled ``utils`` op (a
byte view of each tensor) is given in Python, so it too runs without compiling anything. GPUDirect Storage is not
covered: ``GDSBuilder().load()`` raises. ``DeepSpeedEngine.load_checkpoint`` is wrapped to warn where DeepSpeed
resumes without the optimizer state (see ``warn_on_nvme_optimizer_resume``). DeepSpeed's ``PinMemoryBuilder`` is
served by deepoffload too, so buffers locked by its ``pin_handle`` and by the async-IO handles share one registry and
each is pinned for the other. ``enable()`` also sets ``DEEPOFFLOAD_DEEPSPEED=1`` so that child processes (the
``ds_nvme_tune`` sweeps, spawned workers) enable themselves when they import DeepSpeed (see
``deepspeed_children``). ``disable()`` puts DeepSpeed's classes, methods and that variable back.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
import threading
import types
import warnings
from types import ModuleType
from typing import Any, Callable, Mapping, NoReturn

import torch

from ..errors import UnsupportedError
from . import deepspeed_env as children

__all__ = [
    "enable",
    "disable",
    "enabled",
    "AsyncIOBuilder",
    "GDSBuilder",
    "PinMemoryBuilder",
    "cast_to_byte_tensor",
    "warn_on_nvme_optimizer_resume",
]

# Modules that bind AsyncIOBuilder / GDSBuilder at import time; imported by enable() so they are patched.
DEEPSPEED_MODULES = (
    "deepspeed.ops.op_builder",
    "deepspeed.ops.aio",
    "deepspeed.ops.gds",
    "deepspeed.ops.pin_memory",
    "deepspeed.runtime.swap_tensor.partitioned_optimizer_swapper",
    "deepspeed.runtime.swap_tensor.partitioned_param_swapper",
    "deepspeed.runtime.swap_tensor.pipelined_optimizer_swapper",
    "deepspeed.runtime.model_checkpointing.writer_factory",
    "deepspeed.io.fast_file_writer",
    "deepspeed.nvme",
)
BUILDER_NAMES = ("AsyncIOBuilder", "GDSBuilder", "PinMemoryBuilder")

_lock = threading.Lock()
_saved: list[tuple[Any, str, Any, Any]] = []  # (object or dict, attribute or key, previous value, own or a marker)
_ABSENT = object()
_CHILDREN = object()  # marks the saved environment variable that reaches child processes


class AsyncIOBuilder:
    """DeepSpeed's ``AsyncIOBuilder`` interface over deepoffload's op.

    ``load()`` and ``jit_load()`` return the DeepSpeed-compatible module (built in seconds on first use, cached
    after). ``enable()`` puts this class wherever DeepSpeed binds its own.

    Args:
        name: The builder's name (default: ``NAME``, ``async_io``).

    Examples:
        >>> import torch
        >>> from deepoffload.integrations.deepspeed import AsyncIOBuilder
        >>> handle = AsyncIOBuilder().load().aio_handle()
        >>> handle.sync_pwrite(torch.arange(4.0), "tensor.bin")
        1
        >>> back = torch.zeros(4)
        >>> handle.sync_pread(back, "tensor.bin")
        1
        >>> back
        tensor([0., 1., 2., 3.])
    """

    BUILD_VAR = "DS_BUILD_AIO"
    NAME = "async_io"
    deepoffload = True

    def __init__(self, name: str | None = None):
        self.name = name or self.NAME

    def absolute_name(self) -> str:
        """The op's module name as DeepSpeed's builder gives it (``deepspeed.ops.aio.async_io_op``)."""
        return f"deepspeed.ops.aio.{self.NAME}_op"

    def is_compatible(self, verbose: bool = False) -> bool:
        """Always True: the op builds wherever a C++ compiler works (``verbose`` is DeepSpeed's, unused)."""
        return True

    def load(self, verbose: bool = True) -> Any:
        """deepoffload's DeepSpeed-compatible async-IO module, built on first use and cached.

        Args:
            verbose: Accepted for DeepSpeed's signature; unused.

        Returns:
            The module with DeepSpeed's ``aio_handle``, ``aio_read``, ``aio_write`` and ``deepspeed_memcpy``.
        """
        from ..op_builder import AsyncIOBuilder as Builder

        return Builder().load()

    def jit_load(self, verbose: bool = True) -> Any:
        """As ``load()`` (DeepSpeed's name for a just-in-time build).

        Args:
            verbose: Accepted for DeepSpeed's signature; unused.

        Returns:
            What ``load()`` returns.
        """
        return self.load(verbose)


class GDSBuilder(AsyncIOBuilder):
    """GPUDirect Storage is not provided by deepoffload: every use raises, naming what to do.

    ``is_compatible()`` is False and ``load()`` raises ``UnsupportedError``.

    Args:
        name: The builder's name (default: ``NAME``, ``gds``).

    Examples:
        >>> from deepoffload.integrations.deepspeed import GDSBuilder
        >>> GDSBuilder().is_compatible()
        False
        >>> GDSBuilder().load()
        Traceback (most recent call last):
        ...
        deepoffload.errors.UnsupportedError: deepoffload does not provide DeepSpeed's GPUDirect Storage (GDS) op: ...
    """

    BUILD_VAR = "DS_BUILD_GDS"
    NAME = "gds"

    def is_compatible(self, verbose: bool = False) -> bool:
        """Always False: deepoffload has no GDS op (``verbose`` is DeepSpeed's, unused)."""
        return False

    def load(self, verbose: bool = True) -> NoReturn:
        """Raises: deepoffload does not provide GPUDirect Storage.

        Args:
            verbose: Accepted for DeepSpeed's signature; unused.

        Raises:
            UnsupportedError: Always; the message says to set ``"use_gds": false`` or call ``disable()``.
        """
        raise UnsupportedError(
            "deepoffload does not provide DeepSpeed's GPUDirect Storage (GDS) op: set "
            '"use_gds": false in the aio config, or call '
            "deepoffload.integrations.deepspeed.disable() to use DeepSpeed's own GDS op"
        )


class PinMemoryBuilder(AsyncIOBuilder):
    """DeepSpeed's ``PinMemoryBuilder``, served by deepoffload (nothing is built).

    ``load()`` returns a module whose ``pin_handle`` locks memory in the same process-wide registry as the async-IO
    handles, so each recognises the other's buffers as pinned.

    Args:
        name: The builder's name (default: ``NAME``, ``pin_memory``).

    Examples:
        >>> import torch
        >>> from deepoffload.integrations.deepspeed import PinMemoryBuilder
        >>> pins = PinMemoryBuilder().load().pin_handle()
        >>> buffer = pins.new_cpu_locked_tensor(1024, torch.empty(0))
        >>> pins.is_pinned(buffer)
        True
        >>> pins.free_cpu_locked_tensor(buffer)
        True
    """

    BUILD_VAR = "DS_BUILD_PIN_MEMORY"
    NAME = "pin_memory"

    def absolute_name(self) -> str:
        """The op's module name as DeepSpeed's builder gives it (``deepspeed.ops.pin_memory.pin_memory_op``)."""
        return f"deepspeed.ops.pin_memory.{self.NAME}_op"

    def load(self, verbose: bool = True) -> types.SimpleNamespace:
        """A module with DeepSpeed's ``pin_handle`` class, on deepoffload's registry of locked buffers.

        Args:
            verbose: Accepted for DeepSpeed's signature; unused.

        Returns:
            A namespace whose ``pin_handle`` is ``deepoffload.io.pin_memory.pin_handle``.
        """
        from ..io.pin_memory import pin_handle

        return types.SimpleNamespace(pin_handle=pin_handle)


def cast_to_byte_tensor(
    tensors: torch.Tensor | list[torch.Tensor] | tuple[torch.Tensor, ...],
) -> torch.Tensor | list[torch.Tensor]:
    """DeepSpeed's ``utils`` op function used by its fast checkpoint writer, in Python.

    A tensor of at most one byte is returned as it is, like DeepSpeed's.

    Args:
        tensors: A tensor, or a list or tuple of tensors.

    Returns:
        Each tensor's bytes as a flat ``uint8`` view (of a contiguous copy when it is not contiguous); a list for a
        list or tuple.

    Examples:
        >>> import torch
        >>> from deepoffload.integrations.deepspeed import cast_to_byte_tensor
        >>> cast_to_byte_tensor(torch.ones(2, dtype=torch.float16))
        tensor([ 0, 60,  0, 60], dtype=torch.uint8)
    """
    if isinstance(tensors, (list, tuple)):
        return [cast_to_byte_tensor(t) for t in tensors]  # type: ignore[misc]  # a tensor gives a tensor
    if tensors.numel() * tensors.element_size() <= 1:
        return tensors
    return tensors.detach().contiguous().reshape(-1).view(torch.uint8)


class _FastWriterUtils:
    """What DeepSpeed's fast checkpoint writer takes from its compiled ``utils`` op, in Python (nothing to build)."""

    NAME = "utils"
    deepoffload = True

    def load(self, verbose: bool = True):
        """A namespace with ``cast_to_byte_tensor`` (``verbose`` is DeepSpeed's, unused)."""
        return types.SimpleNamespace(cast_to_byte_tensor=cast_to_byte_tensor)


NVME_RESUME_WARNING = (
    "DeepSpeed resumed {load_path!r} with offload_optimizer on NVMe: DeepSpeed 0.19.8 then skips its optimizer-state "
    "load and only copies the checkpoint's swap files back, so the parameters are restored (where this engine's "
    "parameter ids are the saving engine's, as in a fresh process building the same model; otherwise it keeps its "
    "initial parameters) but the optimizer's moments and step count are not: Adam restarts from zero. Where the "
    'optimizer state must survive a resume, keep it off NVMe (offload_optimizer device "cpu" or none); otherwise '
    "accept the restart."
)


def warn_on_nvme_optimizer_resume(load_checkpoint: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps DeepSpeed's ``DeepSpeedEngine.load_checkpoint`` to warn where a resume loses the optimizer state.

    The wrapper calls ``load_checkpoint`` as it is and returns its result unchanged; afterwards it issues one
    ``UserWarning`` when a checkpoint was loaded, optimizer states were asked for (not ``load_module_only``) and the
    engine swaps its optimizer state to NVMe, since DeepSpeed then restores no optimizer state.

    Args:
        load_checkpoint: The unbound ``load_checkpoint`` method to wrap.

    Returns:
        The wrapper (marked ``deepoffload = True``), to set as the engine class's ``load_checkpoint``.

    Examples:
        >>> import warnings
        >>> from deepoffload.integrations.deepspeed import warn_on_nvme_optimizer_resume
        >>> class Engine:  # stands in for DeepSpeedEngine, with the optimizer state swapped to NVMe
        ...     def load_checkpoint(self, load_dir, tag=None, load_optimizer_states=True, load_module_only=False):
        ...         return f"{load_dir}/global_step1", {}
        ...     def zero_nvme_offload_optimizer(self):
        ...         return True
        >>> Engine.load_checkpoint = warn_on_nvme_optimizer_resume(Engine.load_checkpoint)
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     path, _ = Engine().load_checkpoint("checkpoints")
        >>> path, [str(w.message)[:40] for w in caught]
        ('checkpoints/global_step1', ["DeepSpeed resumed 'checkpoints/global_st"])
    """
    signature = inspect.signature(load_checkpoint)

    @functools.wraps(load_checkpoint)
    def load_checkpoint_warning(self, *args, **kwargs):
        result = load_checkpoint(self, *args, **kwargs)
        arguments = signature.bind(self, *args, **kwargs)
        arguments.apply_defaults()
        asked = arguments.arguments.get("load_optimizer_states", True) and not arguments.arguments.get(
            "load_module_only", False
        )
        load_path = result[0] if isinstance(result, tuple) and result else None
        if load_path is not None and asked and self.zero_nvme_offload_optimizer():
            warnings.warn(NVME_RESUME_WARNING.format(load_path=load_path), UserWarning, stacklevel=2)
        return result

    load_checkpoint_warning.deepoffload = True  # type: ignore[attr-defined]  # marks the wrapper as ours
    return load_checkpoint_warning


def enabled() -> bool:
    """True while ``enable()``'s replacements are in place (until ``disable()``).

    Returns:
        Whether DeepSpeed currently runs on deepoffload's op.

    Examples:
        ```python
        import os

        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # a machine without a GPU
        from deepoffload.integrations import deepspeed as ds

        ds.enable()
        print(ds.enabled())  # True
        ds.disable()
        print(ds.enabled())  # False
        ```
    """
    return bool(_saved)


def _patch(obj: Any, attribute: str, value: Any) -> None:
    own = attribute in getattr(obj, "__dict__", {})
    _saved.append((obj, attribute, getattr(obj, attribute, None), own))
    setattr(obj, attribute, value)


def _patch_item(mapping: dict, key: str, value: Any) -> None:
    _saved.append((mapping, key, mapping.get(key, _ABSENT), True))
    mapping[key] = value


def _deepspeed_modules() -> list[ModuleType]:
    return [
        m
        for name, m in list(sys.modules.items())
        if m is not None and (name == "deepspeed" or name.startswith("deepspeed."))
    ]


def enable() -> None:
    """Route every DeepSpeed use of ``AsyncIOBuilder`` to deepoffload's op (idempotent).

    It also serves ``GDSBuilder`` (which raises) and ``PinMemoryBuilder``, the fast checkpoint writer's ``utils``
    op, the accelerator's ``get_op_builder``/``create_op_builder``, wraps ``DeepSpeedEngine.load_checkpoint`` with
    ``warn_on_nvme_optimizer_resume``, and sets ``DEEPOFFLOAD_DEEPSPEED=1`` for child processes (see the module's
    docstring). A second call while enabled does nothing.

    Raises:
        ImportError: When DeepSpeed is not installed (``pip install deepoffload[deepspeed]``).

    Examples:
        ```python
        import os

        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # a machine without a GPU
        from deepoffload.integrations import deepspeed as ds

        ds.enable()  # imports DeepSpeed
        from deepspeed.ops.op_builder import AsyncIOBuilder  # now deepoffload's

        handle = AsyncIOBuilder().load().aio_handle()  # no DeepSpeed op is compiled
        ds.disable()
        ```
    """
    try:
        import deepspeed  # noqa: F401
    except ImportError as e:
        raise ImportError(
            "deepoffload.integrations.deepspeed needs DeepSpeed: pip install deepoffload[deepspeed]"
        ) from e
    with _lock:
        if _saved:
            return
        for name in DEEPSPEED_MODULES:
            try:
                importlib.import_module(name)
            except Exception:  # an optional part of DeepSpeed that cannot import here has nothing to patch
                pass
        replacements = {
            "AsyncIOBuilder": AsyncIOBuilder,
            "GDSBuilder": GDSBuilder,
            "PinMemoryBuilder": PinMemoryBuilder,
        }
        for module in _deepspeed_modules():
            for attribute, ours in replacements.items():
                current = module.__dict__.get(attribute)
                if getattr(current, "__module__", "").startswith("deepspeed."):  # DeepSpeed's class, not ours
                    _patch(module, attribute, ours)
        _patch_accelerator(replacements)
        compatible = getattr(sys.modules["deepspeed.ops"], "__compatible_ops__", None)
        if isinstance(compatible, dict):  # DeepSpeed's own probe (libaio headers) no longer decides: ours run
            for name in (AsyncIOBuilder.NAME, PinMemoryBuilder.NAME):
                _patch_item(compatible, name, True)
        writer = sys.modules.get("deepspeed.io.fast_file_writer")
        if writer is not None and hasattr(writer, "UtilsBuilder"):  # else it would compile DeepSpeed's utils op
            _patch(writer, "UtilsBuilder", _FastWriterUtils)
        from deepspeed.runtime.engine import DeepSpeedEngine

        _patch(DeepSpeedEngine, "load_checkpoint", warn_on_nvme_optimizer_resume(DeepSpeedEngine.load_checkpoint))
        _saved.insert(0, (None, children.ENV, children.mark_children(), _CHILDREN))


def _patch_accelerator(replacements: Mapping[str, type]) -> None:
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    get_op_builder = accelerator.get_op_builder

    def get_op_builder_patched(class_name):
        return replacements.get(class_name) or get_op_builder(class_name)

    def create_op_builder_patched(op_name):
        builder = get_op_builder_patched(op_name)
        return builder() if builder is not None else None

    _patch(accelerator, "get_op_builder", get_op_builder_patched)
    _patch(accelerator, "create_op_builder", create_op_builder_patched)


def disable() -> None:
    """Put DeepSpeed's own builders and ``load_checkpoint`` back everywhere ``enable()`` replaced them (idempotent).

    ``DEEPOFFLOAD_DEEPSPEED`` gets its earlier value back (or is unset). Without ``enable()`` before, it does nothing.

    Examples:
        ```python
        import os

        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # a machine without a GPU
        from deepoffload.integrations import deepspeed as ds

        ds.enable()
        ds.disable()
        from deepspeed.ops.op_builder import AsyncIOBuilder  # DeepSpeed's own again

        print(getattr(AsyncIOBuilder, "deepoffload", False))  # False: DeepSpeed's class, not ours
        ```
    """
    with _lock:
        while _saved:
            obj, attribute, previous, own = _saved.pop()
            if own is _CHILDREN:
                children.unmark_children(previous)
            elif isinstance(obj, dict):
                if previous is _ABSENT:
                    obj.pop(attribute, None)
                else:
                    obj[attribute] = previous
            elif own:
                setattr(obj, attribute, previous)
            else:
                delattr(obj, attribute)
