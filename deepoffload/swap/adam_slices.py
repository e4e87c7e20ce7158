"""torch's Adam and AdamW stepped over slices of each large parameter, without temporaries of the parameter's size.

torch's single-tensor Adam (its path for tensors in main memory) allocates two temporaries of each parameter's size
for ``denom`` (``exp_avg_sq.sqrt() / bias_correction2_sqrt``): 512 MiB more at the peak of a step over a 64M-element
embedding, eight gigabytes for a billion elements. Stepping the same optimizer over consecutive slices of the
parameter, its gradient and state sliced alike and each slice given the parameter's step count, holds two
temporaries of a slice's size instead (``SLICE_ELEMENTS``: 4 MiB of float32). Parameters of at most that many
elements step whole, as before, so that torch's threads keep their work per operation (many small slices cost
more than they save where the cores are shared: every operation is a parallel region, whose threads wait for each
other).

Elementwise, each element sees the same operations with the same scalars either way, but not always the same code:
torch runs an operation over at least ``GRAIN`` elements on several threads, each over its own range, and each range
through a vector loop whose last few elements (fewer than two vectors) take a scalar loop, which may round
differently (bf16 ``add`` with ``alpha`` does). So the slices are cut where every element keeps the code it takes in
the whole step (``pieces``): within each thread range of the whole tensor, at multiples of ``UNIT`` elements from
the range's start (a multiple of every vector loop's step), each slice either run serially (shorter than ``GRAIN``)
or split by torch into thread ranges that are multiples of ``UNIT`` themselves, and the range's last slice ending
where the range ends (the same scalar tail). Before a dtype and thread count is first sliced, a calibration steps
parameters both ways and compares the bits (``calibrated``); where they differ (a torch that splits its work
otherwise) every parameter steps whole, with a warning. ``tests/swap/optimizer/test_adam_slices.py`` compares real
steps at odd sizes, three dtypes and 1-3 threads, shows that slices cut elsewhere differ, and measures the peak.

Only where that holds: torch's own ``Adam`` and ``AdamW`` (not subclasses), on the single-tensor path (not
``fused``, ``foreach``, ``capturable`` or ``differentiable``), for dense contiguous real floating-point parameters on
the CPU whose gradient and state tensors are contiguous and of the parameter's shape and dtype, once their state
exists (the first step makes it, whole). Anything else steps whole.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Iterator, Mapping, cast

import torch

from ..errors import UnsupportedError

SLICE_ELEMENTS = 1 << 20  # elements a slice holds (4 MiB of float32); a parameter of at most this many steps whole
GRAIN = 32768  # torch's at::internal::GRAIN_SIZE: an elementwise operation on fewer elements runs on one thread
UNIT = 256  # slice starts are this many elements apart within a thread range: a multiple of two vectors of any dtype
_STATE_KEYS = frozenset({"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"})
_calibration: dict[tuple, bool] = {}  # (class, dtype, threads, amsgrad/maximize/weight decay) -> the same bits


def thread_ranges(numel: int, threads: int) -> list[tuple[int, int]]:
    """The ranges torch's threads take of an elementwise operation over ``numel`` elements (``at::parallel_for``).

    Args:
        numel: Elements.
        threads: torch's intra-op threads.

    Returns:
        (start, end) of each thread's range, in order.
    """
    if threads == 1 or numel < GRAIN:
        return [(0, numel)]
    used = min(threads, -(-numel // GRAIN))
    size = -(-numel // used)
    return [(start, min(start + size, numel)) for start in range(0, numel, size)]


def pieces(numel: int, elements: int, threads: int) -> list[tuple[int, int]]:
    """The slices a parameter of ``numel`` elements steps in, each element on the code the whole step runs it on.

    Within each of the whole tensor's thread ranges, from its start, and the last slice ending at its end:

    - one thread, or ``elements`` under ``GRAIN``: serial slices of ``elements`` rounded down to ``UNIT`` (at least
      ``UNIT``; under ``GRAIN`` where several threads would split a longer one);
    - else slices of ``elements`` rounded down to ``threads * UNIT`` (at least ``threads * GRAIN``, so that torch
      gives each of its threads a multiple of ``UNIT``), then one such slice of what is left, then serial slices
      shorter than ``GRAIN``; a tensor whose ranges are shorter than one such slice is one slice (whole: serial
      slices would leave threads idle).

    Args:
        numel: The parameter's elements.
        elements: The wanted slice length.
        threads: torch's intra-op threads.

    Returns:
        (start, end) of each slice, in order, covering ``0..numel``.
    """
    serial = max(elements // UNIT * UNIT, UNIT)
    parallel = threads > 1 and elements >= GRAIN
    if threads > 1:
        serial = min(serial, GRAIN - UNIT)
    step = threads * UNIT
    full = max(elements // step * step, threads * GRAIN)
    ranges = thread_ranges(numel, threads)
    if parallel and min(end - start for start, end in ranges) < full:
        return [(0, numel)]  # serial slices would leave threads idle: whole
    cuts: list[tuple[int, int]] = []
    for start, end in ranges:
        at = start
        if parallel:
            while end - at >= full:
                cuts.append((at, at + full))
                at += full
            rest = (end - at) // step * step
            if rest >= threads * GRAIN:  # torch splits it into multiples of UNIT
                cuts.append((at, at + rest))
                at += rest
        while end - at > serial:
            cuts.append((at, at + serial))
            at += serial
        if at < end:
            cuts.append((at, end))  # to the range's end: the whole step's scalar tail there
    return cuts


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors hold the same bytes (NaNs included, which ``torch.equal`` calls unequal)."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(ints), b.view(ints))


def _plain(tensor: Any) -> bool:
    return type(tensor) in (torch.Tensor, torch.nn.Parameter)


def _group_sliceable(group: Mapping[str, Any]) -> bool:
    return not any(group.get(flag) for flag in ("fused", "foreach", "capturable", "differentiable"))


def _param_sliceable(param: torch.Tensor, values: Any, elements: int) -> bool:
    grad = param.grad
    if not (
        _plain(param)
        and param.device.type == "cpu"
        and param.is_floating_point()
        and param.layout == torch.strided
        and param.is_contiguous()
        and param.numel() > elements
        and grad is not None
        and _plain(grad)
        and grad.layout == torch.strided
        and grad.dtype == param.dtype
        and grad.shape == param.shape
        and grad.is_contiguous()
        and isinstance(values, Mapping)
        and "step" in values
        and set(values) <= _STATE_KEYS
    ):
        return False
    step = values["step"]
    if not (_plain(step) and step.dim() == 0 and step.device.type == "cpu"):
        return False
    return all(
        _plain(value)
        and value.shape == param.shape
        and value.dtype == param.dtype
        and value.is_contiguous()
        and value.device == param.device
        for key, value in values.items()
        if key != "step"
    )


def sliceable(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` is one whose steps ``adam_slices`` can split (torch's own Adam or AdamW).

    Args:
        optimizer: The wrapped optimizer.

    Returns:
        True for an instance of exactly ``torch.optim.Adam`` or ``torch.optim.AdamW``.
    """
    return type(optimizer) in (torch.optim.Adam, torch.optim.AdamW)


def calibrated(optimizer: torch.optim.Optimizer, group: Mapping[str, Any], dtype: torch.dtype) -> bool:
    """Whether slices give the whole step's bits for ``dtype`` at torch's thread count now (tried once, remembered).

    Parameters of ``11 * GRAIN + 77`` and ``7 * GRAIN + 77`` elements with gradients from 1e-30 to 1e2 (odd thread
    ranges, scalar tails, denormal squares) are stepped three times by an optimizer of ``optimizer``'s class and
    ``group``'s settings: whole, and in slices of ``4 * GRAIN`` (every kind of slice ``pieces`` cuts). Where they
    differ, a warning says so and every parameter of that dtype steps whole at that thread count.

    Args:
        optimizer: The wrapped optimizer.
        group: Its param group whose settings the trial uses.
        dtype: The parameters' dtype.

    Returns:
        True when the bits were the same.
    """
    threads = torch.get_num_threads()
    settings = {k: v for k, v in group.items() if k not in ("params", "initial_lr")}
    flags = tuple(bool(settings.get(k)) for k in ("amsgrad", "maximize", "weight_decay"))
    key = (type(optimizer), dtype, threads, flags)
    if key not in _calibration:
        finals = []
        for whole in (True, False):
            g = torch.Generator().manual_seed(1)
            params: list[torch.Tensor] = [
                torch.nn.Parameter(torch.randn(n * GRAIN + 77, generator=g).to(dtype)) for n in (11, 7)
            ]
            maker: Any = type(optimizer)
            trial = maker(params)
            trial.param_groups[0].update(settings)
            for k in range(3):
                for param in params:
                    scale = 10.0 ** torch.randint(-30, 3, param.shape, generator=g).float()
                    param.grad = (torch.randn(param.shape, generator=g) * scale).to(dtype)
                if whole or k == 0:
                    trial.step()
                    continue
                with _sliced(trial, [params], 4 * GRAIN) as groups:
                    trial.param_groups[0]["params"] = groups[0]
                    trial.step()
                trial.param_groups[0]["params"] = params
            finals.append([t for p in params for t in (p.detach(), *trial.state[p].values())])
        same = all(_same_bits(a, b) for a, b in zip(*finals))
        _calibration[key] = same
        if not same:
            warnings.warn(
                f"OffloadedOptimizer: torch's {type(optimizer).__name__} over slices of a {dtype} parameter gives "
                f"other bits than over the whole parameter at {threads} threads with this torch: each parameter "
                f"steps whole (more memory, the same results)",
                RuntimeWarning,
                stacklevel=3,
            )
    return _calibration[key]


@contextlib.contextmanager
def adam_slices(
    optimizer: torch.optim.Optimizer, groups: list[list[torch.Tensor]], elements: int = SLICE_ELEMENTS
) -> Iterator[list[list[torch.Tensor]]]:
    """The parameters to step, each large parameter that can be split replaced by its slices (see the module).

    Inside the block each slice is a view of its parameter with a view of the gradient as its ``grad`` and views of
    the state (and a copy of the step count) as its entry in ``optimizer.state``. When the block ends without an
    error the parameter's step count becomes the slices' (they stepped alike); whether it ends so or not, the
    slices' entries are removed.

    Args:
        optimizer: The wrapped optimizer (one that is not ``sliceable`` steps every parameter whole).
        groups: Per param group, the parameters to step.
        elements: Elements per slice; a parameter of at most this many steps whole (0: every one).

    Yields:
        Per param group, the tensors to put in its ``params`` for the step.

    Raises:
        UnsupportedError: When the step replaced a slice's state tensor instead of updating it in place (a torch whose
            Adam differs from the one this was written for): the parameter's state would not hold the result.
    """
    if not sliceable(optimizer) or elements <= 0:
        yield groups
        return
    for group, params in zip(optimizer.param_groups, groups):
        if _group_sliceable(group):
            dtypes = {p.dtype for p in params if _param_sliceable(p, optimizer.state.get(p), elements)}
            if not all(calibrated(optimizer, group, dtype) for dtype in dtypes):
                groups = [list(params) for params in groups]  # (the calibration's verdict is per dtype: all whole)
                yield groups
                return
    with _sliced(optimizer, groups, elements) as chosen:
        yield chosen


@contextlib.contextmanager
def _sliced(
    optimizer: torch.optim.Optimizer, groups: list[list[torch.Tensor]], elements: int
) -> Iterator[list[list[torch.Tensor]]]:
    state = optimizer.state
    threads = torch.get_num_threads()
    added: list[torch.Tensor] = []
    split: list[tuple[dict[str, Any], list[tuple[dict[str, Any], dict[str, Any]]]]] = []
    chosen: list[list[torch.Tensor]] = []
    try:
        for group, params in zip(optimizer.param_groups, groups):
            if not _group_sliceable(group):
                chosen.append(params)
                continue
            tensors: list[torch.Tensor] = []
            for param in params:
                values: Any = state.get(param)
                if not _param_sliceable(param, values, elements):
                    tensors.append(param)
                    continue
                flat = param.detach().view(-1)  # (detach shares the version counter: slices' changes count)
                grad = cast(torch.Tensor, param.grad).view(-1)
                flats = {key: value.view(-1) for key, value in values.items() if key != "step"}
                entries = []
                for start, end in pieces(flat.numel(), elements, threads):
                    piece = flat[start:end]
                    piece.grad = grad[start:end]
                    entry: dict[str, Any] = {key: value[start:end] for key, value in flats.items()}
                    entry["step"] = values["step"].clone()
                    state[piece] = entry
                    added.append(piece)
                    tensors.append(piece)
                    entries.append((entry, dict(entry)))
                split.append((values, entries))
            chosen.append(tensors)
        yield chosen
        for values, entries in split:
            for entry, given in entries:
                if any(entry.get(key) is not value for key, value in given.items() if key != "step"):
                    raise UnsupportedError(
                        "OffloadedOptimizer: torch's Adam replaced a state tensor of a parameter slice instead of "
                        "updating it in place, so the parameter's state would not hold the step; set "
                        "opt.pipeline.slice_elements = None (each parameter stepped whole)"
                    )
            values["step"].copy_(entries[-1][0]["step"])  # in place: the stored state may be this tensor's memory
    finally:
        for piece in added:
            state.pop(piece, None)
            piece.grad = None
