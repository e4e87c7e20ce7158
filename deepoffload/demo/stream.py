"""``deepoffload demo --stream-layers``: train a language model much larger than the memory it keeps resident.

The model's parameters, gradients and Adam state are many times the memory it keeps resident: its transformer
blocks are streamed from storage (``offload_parameters``, fused mode), next to the same model trained in memory, and
the losses and resident bytes are compared. The streamed model is built on the ``meta`` device and loaded block by
block straight to storage from a safetensors checkpoint of the in-memory model's starting weights (written first,
removed afterwards), so it never exists whole in memory.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..formats import save_sharded
from ..swap.config import SwapConfig
from ..swap.params import offload_parameters
from ..swap.params.options import LoadOptions, StreamOptions, TrainOptions
from .model import ModelSize, SyntheticText, TinyLM, build_model

# Blocks dominate (a small vocabulary keeps the embedding and head, which stay in memory, small): 16 blocks of 0.8M
# parameters; the in-memory run's model state is 16 bytes per parameter (weights, gradients, Adam's two moments).
# The streamed run's resident bytes do not grow with the depth (about 3 blocks of weights, 6 blocks' worth of
# optimizer-state staging, one block's gradients): 16 blocks keep the model state above 4x of them.
STREAM_SIZE = ModelSize(vocab=256, width=256, layers=16, heads=4, context=64, batch=8)


@dataclass
class StreamResult:
    """Figures of one streamed-training demo run. Bytes, seconds.

    Attributes:
        parameters: The model's parameter count.
        losses_memory: The in-memory run's loss per step.
        losses_streamed: The streamed run's loss per step.
        seconds_memory: The in-memory run's training time.
        seconds_streamed: The streamed run's training time.
        memory_state_bytes: The in-memory run's weights, gradients and optimizer state.
        streamed_resident_bytes: The streamed run at its peak: block parameters, gradients, staging, and the rest of
            the model with its state.
        stored_bytes: The streamed run's weights and optimizer state on storage.
        bytes_moved: Bytes the streamed run read and wrote.
        params_match: Whether the two runs' final parameters are equal (``torch.equal``).
    """

    parameters: int
    losses_memory: list[float] = field(default_factory=list)
    losses_streamed: list[float] = field(default_factory=list)
    seconds_memory: float = 0.0
    seconds_streamed: float = 0.0
    memory_state_bytes: int = 0  # in-memory run: weights + gradients + optimizer state
    streamed_resident_bytes: int = 0  # streamed run at its peak: block params, gradients, staging, rest with state
    stored_bytes: int = 0  # streamed run: weights and optimizer state on storage
    bytes_moved: int = 0
    params_match: bool = False

    @property
    def losses_match(self) -> bool:
        """True when the two runs' losses are equal, step by step."""
        return self.losses_memory == self.losses_streamed

    @property
    def ratio(self) -> float:
        """In-memory model state over the streamed run's peak resident bytes."""
        return self.memory_state_bytes / self.streamed_resident_bytes if self.streamed_resident_bytes else 0.0


def _causal_mask(module: torch.nn.Module) -> None:
    """The one value no checkpoint holds (a non-persistent buffer): the causal mask, as ``TinyLM`` builds it."""
    if isinstance(module, TinyLM):
        module.mask.copy_(torch.nn.Transformer.generate_square_subsequent_mask(module.size.context))


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def run_stream_demo(
    steps: int, config: SwapConfig, prefetch: int = 1, progress: Callable[[int, StreamResult], None] | None = None
) -> StreamResult:
    """Train ``STREAM_SIZE`` for ``steps`` Adam steps in memory and streamed (alternating which goes first).

    Args:
        steps: Training steps.
        config: Where and how the streamed run swaps (its folder also holds the temporary checkpoint).
        prefetch: Blocks the streamed run reads ahead.
        progress: Called after each step with the step's index and the figures so far.

    Returns:
        The figures of both runs.
    """
    make = lambda params: torch.optim.Adam(params, lr=1e-3)  # noqa: E731
    reference = build_model(STREAM_SIZE)
    data = SyntheticText(STREAM_SIZE)
    optimizer = make(reference.parameters())
    result = StreamResult(parameters=sum(p.numel() for p in reference.parameters()))
    checkpoint = os.path.join(config.folders[0] or tempfile.gettempdir(), f"demo-checkpoint-{uuid.uuid4().hex[:8]}")
    try:
        save_sharded(reference.state_dict(), checkpoint, max_shard_bytes=16 << 20)
        with torch.device("meta"):
            model = TinyLM(STREAM_SIZE)
        offload = offload_parameters(
            model,
            config=config,
            train=TrainOptions(optimizer=make),
            load=LoadOptions(checkpoint=checkpoint, init=_causal_mask),
            stream=StreamOptions(prefetch=prefetch),
        )
    finally:
        shutil.rmtree(checkpoint, ignore_errors=True)
    try:
        for step in range(steps):
            batch = data.batch()

            def in_memory() -> None:
                start = time.perf_counter()
                loss = reference.loss(batch)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                result.seconds_memory += time.perf_counter() - start
                result.losses_memory.append(loss.item())

            def streamed() -> None:
                start = time.perf_counter()
                loss = model.loss(batch)
                loss.backward()
                offload.step()
                offload.zero_grad()
                result.seconds_streamed += time.perf_counter() - start
                result.losses_streamed.append(loss.item())

            for run in (in_memory, streamed) if step % 2 == 0 else (streamed, in_memory):
                run()
            if step == 0:
                offload.reset_peak()  # from here on the pools are warm
            if progress is not None:
                progress(step, result)
        stats = offload.stats
        result.memory_state_bytes = 2 * _tensor_bytes(reference.parameters()) + sum(
            _tensor_bytes(v for v in s.values() if isinstance(v, torch.Tensor)) for s in optimizer.state.values()
        )
        result.streamed_resident_bytes = (
            stats.peak_bytes + stats.peak_grad_bytes + stats.staging_bytes + 2 * _tensor_bytes(offload.rest)
        )  # rest: weights and gradients
        result.stored_bytes = offload.store.stored_bytes() + sum(o.stored_bytes() for o in offload.optimizers)
        result.bytes_moved = stats.bytes_read + stats.bytes_written + stats.state_bytes_read + stats.state_bytes_written
        state = offload.state_dict()
        result.params_match = all(torch.equal(state[k], v) for k, v in reference.state_dict().items())
    finally:
        offload.close(restore=False)  # the weights were compared above; not needed after
    return result


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:.1f} MB"


def report_stream(steps: int, config: SwapConfig) -> int:
    """Run the demo with a progress bar and print its figures.

    Args:
        steps: Training steps.
        config: Where and how the streamed run swaps.

    Returns:
        The exit status: 0 when losses and parameters match, 1 when not or when storage fails.
    """
    from tqdm import tqdm

    print(
        f"deepoffload demo --stream-layers: {STREAM_SIZE.layers}-block transformer built on the meta device and "
        f"loaded block by block from a safetensors checkpoint, Adam, {steps} steps; block "
        f"weights and all optimizer state on storage under {config.folder}, streamed one block ahead (fused "
        f"optimizer step in backward); the same model trains in memory alongside for comparison"
    )
    bar = tqdm(total=steps, unit="step", dynamic_ncols=True)

    def progress(step: int, result: StreamResult) -> None:
        bar.update(1)
        bar.set_postfix(loss=f"{result.losses_streamed[-1]:.4f}")

    try:
        result = run_stream_demo(steps, config, progress=progress)
    except OSError as e:
        bar.close()
        print(f"deepoffload demo: {e}; choose another folder with --path")
        return 1
    bar.close()
    match = result.losses_match and result.params_match
    print(f"parameters:              {result.parameters:,}")
    print(f"in memory:               {_mb(result.memory_state_bytes)} of weights, gradients and Adam state")
    print(
        f"streamed, peak resident: {_mb(result.streamed_resident_bytes)} (block weights and gradients at their "
        f"peak, staging buffers, the rest of the model): {result.ratio:.1f}x less"
    )
    print(f"on storage:              {_mb(result.stored_bytes)}; {_mb(result.bytes_moved)} moved")
    print(f"time:                    {result.seconds_streamed:.1f} s streamed, {result.seconds_memory:.1f} s in memory")
    print(
        f"losses matched exactly:  {'yes' if match else 'NO'} ({len(result.losses_streamed)} steps compared bit "
        f"for bit, final loss {result.losses_streamed[-1]:.6f}; final parameters "
        f"{'identical' if result.params_match else 'DIFFERENT'})"
    )
    return 0 if match else 1
