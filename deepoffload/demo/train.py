"""Train the same model twice in lockstep, optimizer state in memory and on storage, and measure the difference.

The reference keeps its optimizer state in memory, the other run on storage (``OffloadedOptimizer``); the demo
measures what offloading costs and saves.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..swap.config import SwapConfig
from ..swap.optimizer import OffloadedOptimizer
from .model import SyntheticText, build_model

OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "adam": lambda params: torch.optim.Adam(params, lr=1e-3),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01),
    "sgd": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    "adagrad": lambda params: torch.optim.Adagrad(params, lr=0.01),
    "rmsprop": lambda params: torch.optim.RMSprop(params, lr=1e-3),
    "adafactor": lambda params: torch.optim.Adafactor(params, lr=1e-2),
}


@dataclass
class DemoResult:
    """Figures of one demo run. Times in seconds, sizes in bytes.

    Attributes:
        parameters: The model's parameter count.
        steps: Training steps.
        losses_memory: The in-memory run's loss per step.
        losses_offloaded: The offloaded run's loss per step.
        step_seconds_memory: The in-memory run's time per step.
        step_seconds_offloaded: The offloaded run's time per step.
        optimizer_seconds_offloaded: The offloaded run's ``optimizer.step()`` time per step.
        bytes_moved_per_step: Bytes the offloaded optimizer read and wrote, per step.
        state_bytes_memory: The in-memory optimizer's state.
        state_bytes_on_storage: The offloaded optimizer's state on storage.
        staging_bytes: The offloaded optimizer's staging buffers.
        params_match: Whether the two runs' final parameters are equal (``torch.equal``).
        folder: The folder of the swap files.
    """

    parameters: int
    steps: int
    losses_memory: list[float] = field(default_factory=list)
    losses_offloaded: list[float] = field(default_factory=list)
    step_seconds_memory: list[float] = field(default_factory=list)
    step_seconds_offloaded: list[float] = field(default_factory=list)
    optimizer_seconds_offloaded: list[float] = field(default_factory=list)
    bytes_moved_per_step: list[int] = field(default_factory=list)
    state_bytes_memory: int = 0
    state_bytes_on_storage: int = 0
    staging_bytes: int = 0
    params_match: bool = False
    folder: str = ""

    @property
    def losses_match(self) -> bool:
        """True when the two runs' losses are equal, step by step."""
        return self.losses_memory == self.losses_offloaded

    @property
    def bytes_moved(self) -> int:
        """Bytes read plus written by the offloaded optimizer over the whole run."""
        return sum(self.bytes_moved_per_step)

    @property
    def io_gb_per_s(self) -> float:
        """Bytes read plus written per second of offloaded optimizer step, in GB/s (1e9 bytes/s).

        The first step (which makes the state and only writes) is excluded when there are more.
        """
        skip = 1 if len(self.optimizer_seconds_offloaded) > 1 else 0
        seconds = sum(self.optimizer_seconds_offloaded[skip:])
        return sum(self.bytes_moved_per_step[skip:]) / seconds / 1e9 if seconds else 0.0

    @property
    def step_overheads(self) -> list[float]:
        """Per step after the first (which creates the state): offloaded step time over the in-memory step's, minus 1.

        The two runs alternate which goes first each step, so each ratio compares steps taken side by side.
        """
        return [
            off / mem - 1 for off, mem in zip(self.step_seconds_offloaded[1:], self.step_seconds_memory[1:]) if mem > 0
        ]

    @property
    def overhead(self) -> float | None:
        """Median of ``step_overheads`` (None with a single step: there is nothing to compare)."""
        ratios = self.step_overheads
        return statistics.median(ratios) if ratios else None

    @property
    def overhead_spread(self) -> tuple[float, float] | None:
        """(low, high) of ``step_overheads``: the middle half (quartiles) from 4 steps on, else the full range."""
        ratios = sorted(self.step_overheads)
        if len(ratios) < 2:
            return None
        if len(ratios) < 4:
            return ratios[0], ratios[-1]
        q = statistics.quantiles(ratios, n=4)
        return q[0], q[2]


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(
        v.numel() * v.element_size()
        for s in optimizer.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor)
    )


def run_demo(
    model_size: str,
    steps: int,
    optimizer: str,
    config: SwapConfig,
    progress: Callable[[int, DemoResult], None] | None = None,
) -> DemoResult:
    """Train ``model_size`` for ``steps`` steps both ways, alternating which goes first each step.

    Args:
        model_size: A name of ``deepoffload.demo.model.SIZES``.
        steps: Training steps.
        optimizer: A name of ``OPTIMIZERS``.
        config: Where and how the offloaded optimizer swaps.
        progress: Called after each step with the step's index and the figures so far.

    Returns:
        The figures of both runs.

    Raises:
        ValueError: When ``optimizer`` names no optimizer.
    """
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer {optimizer!r}: expected one of {', '.join(OPTIMIZERS)}")
    make = OPTIMIZERS[optimizer]
    reference, offloaded_model = build_model(model_size), build_model(model_size)
    data = SyntheticText(reference.size)
    in_memory = make(reference.parameters())
    offloaded = OffloadedOptimizer(make, offloaded_model.parameters(), config)
    result = DemoResult(
        parameters=sum(p.numel() for p in reference.parameters()), steps=steps, folder=offloaded.swapper.folder
    )
    try:
        for step in range(steps):
            tokens = data.batch()
            runs = [
                (reference, in_memory, result.losses_memory, result.step_seconds_memory),
                (offloaded_model, offloaded, result.losses_offloaded, result.step_seconds_offloaded),
            ]
            for model, opt, losses, seconds in runs[:: 1 if step % 2 == 0 else -1]:
                start = time.perf_counter()
                loss = model.loss(tokens)
                opt.zero_grad()
                loss.backward()
                before_step = time.perf_counter()
                opt.step()
                end = time.perf_counter()
                if opt is offloaded:
                    result.optimizer_seconds_offloaded.append(end - before_step)
                losses.append(loss.item())
                seconds.append(end - start)
            result.bytes_moved_per_step.append(
                offloaded.swapper.bytes_read + offloaded.swapper.bytes_written - result.bytes_moved
            )
            if progress is not None:
                progress(step, result)
        result.state_bytes_memory = _state_bytes(in_memory)
        result.state_bytes_on_storage = offloaded.stored_bytes()
        result.staging_bytes = offloaded.swapper.pool.held_bytes()
        result.params_match = all(
            torch.equal(a, b) for a, b in zip(reference.parameters(), offloaded_model.parameters())
        )
    finally:
        offloaded.close()
    return result
