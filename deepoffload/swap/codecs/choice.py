"""Whether ``codec="lossless"`` pays on a drive: its decode speed on this CPU against the drive's read speed.

A streamed block with the codec reads ``ratio`` of its bytes and is decoded on the decode pool while the next block
is read (``decoding.py``), so it arrives at ``min(read / ratio, decode)`` bytes per second instead of ``read``. The
codec pays when that is at least ``MARGIN`` times ``read``: on a drive that reads faster than the CPU decodes it
is a loss (every block waits for its decode), and a gain of a few percent is not worth the CPU it takes from the
model's own compute. ``deepoffload tune --codec`` measures both speeds and writes the choice into its JSON
(``SwapConfig.from_json`` reads it back).
"""

from __future__ import annotations

import dataclasses
import time

MARGIN = 1.10  # the codec must make streaming at least this much faster to be chosen
SAMPLE_BYTES = 16 << 20  # bf16 values measured (random normal: their exponent plane compresses as weights' do)


@dataclasses.dataclass(frozen=True)
class CodecChoice:
    """The codec ``tune`` chose and why.

    Attributes:
        codec: ``lossless`` or ``none``.
        speedup: Predicted streaming speed with the codec over without (``min(1 / ratio, decode / read)``).
        reason: One line saying why, with both speeds.
    """

    codec: str
    speedup: float
    reason: str


def choose(read_bytes_per_s: float, decode_bytes_per_s: float, ratio: float, margin: float = MARGIN) -> CodecChoice:
    """``lossless`` where it makes streaming at least ``margin`` times faster, else ``none``.

    Args:
        read_bytes_per_s: The drive's read speed (bytes per second).
        decode_bytes_per_s: The codec's decode speed on this CPU (decoded bytes per second).
        ratio: Stored bytes over raw bytes (about 0.68 for bf16 weights).
        margin: The least speedup that chooses the codec.

    Returns:
        The choice, its predicted speedup and the reason.

    Raises:
        ValueError: When a speed or the ratio is not a positive number.
    """
    if not (read_bytes_per_s > 0 and decode_bytes_per_s > 0 and 0 < ratio):
        raise ValueError(
            f"choose: speeds and ratio must be positive (read {read_bytes_per_s}, decode {decode_bytes_per_s}, "
            f"ratio {ratio})"
        )
    speedup = min(1 / ratio, decode_bytes_per_s / read_bytes_per_s)
    speeds = (
        f"reads {read_bytes_per_s / 1e9:.2f} GB/s, decodes {decode_bytes_per_s / 1e9:.2f} GB/s at {ratio:.2f} of "
        f"the bytes: streaming {speedup:.2f}x"
    )
    if speedup >= margin:
        return CodecChoice("lossless", speedup, f"codec lossless: the drive {speeds} with it")
    limit = "the CPU decodes slower than the drive reads" if decode_bytes_per_s < read_bytes_per_s else "too little"
    return CodecChoice("none", speedup, f"codec none: the drive {speeds} with lossless ({limit}; needs {margin:.2f}x)")


def measure_decode(nbytes: int = SAMPLE_BYTES, repeats: int = 3) -> tuple[float, float]:
    """The lossless codec's decode speed (best of ``repeats``, one thread) and ratio on random-normal bf16 values.

    Args:
        nbytes: Bytes of bf16 values to encode and decode.
        repeats: Decodes timed; the fastest counts (the others met a busy CPU).

    Returns:
        ``(decoded bytes per second, stored bytes / raw bytes)``.

    Raises:
        ConfigError: When the zstandard package is missing (the codec cannot be used at all).
    """
    import torch

    from .registry import codec_class

    codec = codec_class("lossless")()
    values = torch.randn(nbytes // 2, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    data = values.view(torch.uint8)
    stored = torch.empty(codec.max_stored_bytes(data.numel()), dtype=torch.uint8)
    stored = stored[: codec.encode(data, stored)].clone()
    out = torch.empty_like(data)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        codec.decode(stored, out)
        best = min(best, time.perf_counter() - start)
    return data.numel() / best, stored.numel() / data.numel()
