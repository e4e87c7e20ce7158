"""What a block's parameter is while it is streamed: a ``StreamedParameter``.

While a block's values are not in memory (on storage, being read or written) each of its parameters holds a
0-element placeholder and its class is ``StreamedParameter`` (an ``nn.Parameter`` subclass: identity, name,
``requires_grad`` and hooks are kept); while the block is in memory it is a plain ``nn.Parameter`` again, so the
block computes exactly as in memory (no ``__torch_function__`` in its kernels' way;
``tests/swap/params/test_params_training.py::test_training_bit_identical_to_in_memory``). Code that handles parameters
one by one would silently see no weights in the placeholders, so a ``StreamedParameter``:

- answers metadata truthfully: ``dtype``, ``device``, ``requires_grad``, and ``shape``, ``size()``, ``numel()``,
  ``dim()`` as stored (so ``sum(p.numel() for p in model.parameters())`` counts the real parameters);
- refuses at once, naming the pattern and what to use instead: reads of its values (``{n: p.detach().clone() for
  n, p in model.named_parameters()}``, ``torch.save`` of parameters, EMA copies, ``parameters_to_vector``, ...):
  ``model.state_dict()`` holds the real weights, read one block at a time; writes (``p.data``, in-place ops such
  as ``copy_``, ``nn.init``), which would never reach storage (``model.load_state_dict`` writes to storage: see
  ``loading``); ``copy.deepcopy`` (the copy
  would still stream through this model's offload); an optimizer built over it (``torch.optim`` checks
  ``is_leaf``), which would never see its gradients: pass ``optimizer=`` to ``offload_parameters`` instead;
- refuses ``p.grad`` while the block's gradients are elsewhere until ``step()`` (applied inside backward in fused
  mode, on storage in grads mode), where ``clip_grad_norm_(model.parameters())`` or gradient logging would read
  None (``trainer_arguments``' callback lets it read None during a ``Trainer`` run, whose logged norm then covers
  the parameters in memory only); outside that window ``p.grad`` is what it says (None).

A block held in memory (pinned by ``max_resident_bytes``, or kept after a failed write) has plain parameters, whose
``p.grad`` would read None while its gradients are away: between its backward and ``step()`` they are
``GradsAwayParameter`` instead, refusing only that read.

deepoffload's own code runs inside ``internal()``, where nothing is checked.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import math
import threading
from collections import OrderedDict
from typing import Any, Callable, Iterator, Protocol, cast

import torch
from torch import nn

from ....errors import StreamedParameterError
from ...interrupts import deferred
from ..guards.wrappers import wrapper_in_stack, wrapper_message


class Block(Protocol):
    """What a placeholder asks of the block it stands in for (``residency.Block``, which imports this module)."""

    names: list[str]
    shapes: list[tuple[int, ...]]
    discarded: bool
    grads_read_as_none: bool
    exporting: int

    @property
    def state(self) -> enum.Enum:
        """Its residency."""
        ...

    @property
    def served(self) -> str | None:
        """The checkpoint file it is served from read-only, or None."""
        ...

    def qualified(self, name: str) -> str:
        """The qualified name of the block's parameter ``name``."""
        ...

    def grads_away(self) -> str | None:
        """Where the block's gradients are while not on its parameters, or None."""
        ...


_local = threading.local()

# attributes and methods that tell nothing about the values and change none of them
_METADATA = frozenset(
    {
        "dtype",
        "device",
        "layout",
        "requires_grad",
        "requires_grad_",
        "grad_fn",
        "retains_grad",
        "is_cuda",
        "is_cpu",
        "is_meta",
        "is_sparse",
        "is_quantized",
        "is_mkldnn",
        "is_nested",
        "is_xpu",
        "is_mps",
        "is_floating_point",
        "is_complex",
        "is_signed",
        "element_size",
        "itemsize",
        "get_device",
        "names",
        "name",
        "register_hook",
        "register_post_accumulate_grad_hook",
        "_backward_hooks",
        "_post_accumulate_grad_hooks",
        "_is_view",
    }
)
_SHAPE = frozenset({"shape", "size", "numel", "nelement", "dim", "ndim", "ndimension"})


@contextlib.contextmanager
def internal() -> Iterator[None]:
    """deepoffload's own handling of streamed parameters: nothing is checked inside.

    Ctrl-C waits for its end (see ``interrupts``). Outside inference mode: staging buffers, parameter views and
    compute copies made while a forward runs under ``torch.inference_mode()`` are reused by training later, which
    may not write inference tensors.

    Yields:
        Nothing: the body runs as deepoffload's own handling.
    """
    depth = getattr(_local, "depth", 0)
    _local.depth = depth + 1
    try:
        if depth:
            yield
        else:
            with deferred(), torch.inference_mode(False):
                yield
    finally:
        _local.depth = depth


def internal_call(method: Callable) -> Callable:
    """``method`` run inside ``internal()``."""

    @functools.wraps(method)
    def run(*args, **kwargs):
        with internal():
            return method(*args, **kwargs)

    return run


def _checking() -> bool:
    return getattr(_local, "depth", 0) == 0


class StreamedParameter(nn.Parameter):
    """A block parameter while ``offload_parameters`` streams it (see the module docstring).

    ``_streamed`` is its (block, name within the block).
    """

    _streamed: tuple[Block, str]

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _checking():
            answered, value = _check(func, args, kwargs)
            if answered:
                return value
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    def __deepcopy__(self, memo):
        if _checking():
            raise StreamedParameterError(_message(self, "copy.deepcopy", "copy"))
        with internal():
            return nn.Parameter(self.data.clone(memory_format=torch.preserve_format), self.requires_grad)

    def __reduce_ex__(self, proto):
        if _checking():
            raise StreamedParameterError(_message(self, "pickling it (torch.save)", "read"))
        with internal():  # a plain Parameter of its values, as nn.Parameter pickles
            return torch._utils._rebuild_parameter, (self.data, self.requires_grad, OrderedDict())

    # narrower than Tensor.__repr__(self, *, tensor_contents=None), as nn.Parameter's own is: repr() passes nothing
    def __repr__(self) -> str:  # type: ignore[override]
        block, name = self._streamed
        return (
            f"StreamedParameter(shape={tuple(block.shapes[block.names.index(name)])}, dtype={self.dtype}, "
            f"{block.qualified(name)} {block.state.value})"
        )


class GradsAwayParameter(nn.Parameter):
    """A parameter of a block held in memory while the block's gradients are away until ``step()``.

    The block is pinned by ``max_resident_bytes`` or kept after a failed write, its gradients away
    (``Block.grads_away``): the parameter's values are real and every use passes through, but ``p.grad`` is refused as
    for a ``StreamedParameter``, where it would silently read None (so ``clip_grad_norm_(model.parameters())`` cannot
    clip by a wrong norm when every block is held in memory). The block computes with plain parameters: it is plain
    again while it runs and once ``step()`` is done.
    """

    _streamed: tuple[Block, str]

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if _checking() and args and isinstance(args[0], GradsAwayParameter) and _attribute(func) == "grad":
            block = args[0]._streamed[0]
            where = block.grads_away()
            if where is not None and not block.grads_read_as_none:
                raise StreamedParameterError(_grad_message(args[0], where))
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))

    def __deepcopy__(self, memo):
        return nn.Parameter(self.data.clone(memory_format=torch.preserve_format), self.requires_grad)


def refuse_grad(param: nn.Parameter, block: Block, name: str) -> None:
    """Make the plain ``param`` (of ``block``, in memory, called ``name`` there) a ``GradsAwayParameter``."""
    if type(param) is nn.Parameter:
        param.__class__ = GradsAwayParameter
        cast(GradsAwayParameter, param)._streamed = (block, name)  # (its class, just set)


def streamed(param: nn.Parameter, block: Block, name: str) -> None:
    """Make ``param`` (of ``block``, called ``name`` there), now holding a placeholder, a ``StreamedParameter``."""
    param.__class__ = StreamedParameter
    cast(StreamedParameter, param)._streamed = (block, name)  # (its class, just set)


def plain(param: nn.Parameter) -> None:
    """Make a ``StreamedParameter`` or ``GradsAwayParameter`` an ``nn.Parameter`` again.

    Its block is in memory and computing or done with its gradients, or offloading ended.
    """
    if type(param) in (StreamedParameter, GradsAwayParameter):
        was = cast("StreamedParameter | GradsAwayParameter", param)  # (its class, just checked)
        param.__class__ = nn.Parameter
        del was._streamed


def _attribute(func: Callable) -> str:
    """The attribute or method ``func`` is (``Tensor.grad.__get__`` -> "grad", ``Tensor.detach`` -> "detach")."""
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__", "__delete__"):
        return getattr(getattr(func, "__self__", None), "__name__", name)
    return name


def _streamed_in(values: Any) -> list[StreamedParameter]:
    found = []
    for value in values:
        if isinstance(value, StreamedParameter):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found.extend(v for v in value if isinstance(v, StreamedParameter))
    return found


def _shape_answer(param: StreamedParameter, attribute: str, args: tuple, kwargs: dict) -> Any:
    block, name = param._streamed
    shape = torch.Size(block.shapes[block.names.index(name)])
    if attribute == "shape":
        return shape
    if attribute == "size":
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        return shape if dim is None else shape[dim]
    if attribute in ("numel", "nelement"):
        return math.prod(shape)
    return len(shape)  # dim, ndim, ndimension


def _check(func: Callable, args: tuple, kwargs: dict) -> tuple[bool, Any]:
    """(True, value) to answer ``func`` without running it; (False, None) to run it; raises to refuse it."""
    attribute = _attribute(func)
    if attribute in _METADATA:
        return False, None
    target = args[0] if args else None
    if attribute in _SHAPE:
        if isinstance(target, StreamedParameter):
            return True, _shape_answer(target, attribute, args, kwargs)
        return False, None
    if attribute == "grad":
        if isinstance(target, StreamedParameter):
            block = target._streamed[0]
            where = block.grads_away()
            if where is not None and not block.grads_read_as_none:
                raise StreamedParameterError(_grad_message(target, where))
        return False, None
    if attribute == "is_leaf" and isinstance(target, StreamedParameter):
        raise StreamedParameterError(_message(target, "an optimizer over it", "optimizer"))
    written = (
        _streamed_in([target])
        if attribute == "data" or (attribute.endswith("_") and not attribute.startswith("__"))
        else []
    )
    if written:
        raise StreamedParameterError(_message(written[0], f"{attribute} on it", "write"))
    if attribute == "detach" and isinstance(target, StreamedParameter) and target._streamed[0].exporting:
        return False, None  # module.state_dict(): the block's hook puts the real weights in its place
    for param in _streamed_in(args) + _streamed_in(kwargs.values()):
        raise StreamedParameterError(_message(param, f"{attribute or func}", "read"))
    return False, None


def _message(param: StreamedParameter, what: str, kind: str) -> str:
    block, name = param._streamed
    where = f"parameter {block.qualified(name)} is streamed by offload_parameters()"
    wrapper = wrapper_in_stack()  # DDP or FSDP2 being built around the streamed model
    if wrapper is not None:
        return wrapper_message(wrapper, where)
    if block.discarded:
        return (
            f"{where} and its values were discarded by close(restore=False), so {what} would see no weights; "
            f"close(restore=True) (the default) keeps them"
        )
    if kind == "read":
        return (
            f"{where} and its values are on storage now (the parameter holds a 0-element placeholder), so "
            f"{what} would see no weights. Copying or saving parameters one by one ({{n: p.detach().clone() for "
            f"n, p in model.named_parameters()}}, torch.save of parameters, EMA copies, parameters_to_vector) "
            f"cannot work on a streamed model: use model.state_dict() (the real weights, read one block at a "
            f"time; save_pretrained uses it too), or off.close() to have them in memory again"
        )
    if kind == "write" and block.served:
        return (
            f"{where}: {what} would change values served read-only from the checkpoint {block.served} "
            f"(serve_from_checkpoint=True), which is never written. Merging "
            f"adapters into it (PEFT's merge_and_unload, merge_adapter) would: write the merged model to a new "
            f"folder with deepoffload.integrations.peft.save_merged(off, folder), or keep the adapters unmerged"
        )
    if kind == "write":
        return (
            f"{where}: {what} would change values that live on storage and are read again before each use, so "
            f"the change would be lost. Load weights with model.load_state_dict() (it writes to storage), or "
            f"change them (nn.init, p.data = ...) before offload_parameters() or after off.close(); merge adapters "
            f"with deepoffload.integrations.peft.save_merged(off, folder)"
        )
    if kind == "copy":
        return (
            f"{where}: {what} of a streamed model or parameter would keep streaming through this model's "
            f"offload. Copy the weights with model.state_dict() (e.g. into a fresh model with "
            f"load_state_dict) or copy the model before offload_parameters()"
        )
    return (
        f"{where}: {what} (a torch.optim optimizer built over model.parameters() after offloading) would never "
        f"see the streamed blocks' gradients, which offload_parameters steps itself. Pass train=TrainOptions("
        f"optimizer=<factory>) to offload_parameters(...) and call off.step(); an optimizer for other parameters "
        f"must leave out StreamedParameter instances"
    )


def _grad_message(param: StreamedParameter, where: str) -> str:
    block, name = param._streamed
    return (
        f"parameter {block.qualified(name)} is streamed by offload_parameters(): its gradient is {where} until "
        f"off.step(), so p.grad would say None. This is what torch.nn.utils.clip_grad_norm_(model.parameters()), "
        f"gradient logging, model.zero_grad() or an optimizer over model.parameters() read: clip with "
        f'off.step(clip_grad_norm=...) in mode="grads", and zero with off.zero_grad()'
    )
