"""A dense bf16 Llama (random weights, its own init) streamed by ``deepoffload.from_pretrained`` for greedy
``generate``: bytes read per token and tokens/s, in one process, interleaved A B A B, with the raw disk in the same run:

1. ``codec="none"`` against ``codec="lossless"`` (``SwapConfig(codec=)``), no block resident;
2. the raw disk reading the bytes one ``codec="none"`` generate read (8 MiB requests through the op, 4 in flight,
   O_DIRECT where the folder takes it): the speed streaming cannot beat without reading fewer bytes;
3. bytes read per token against ``StreamOptions(max_resident_bytes=)``: 0, 1/4, 1/2, 3/4 and all of the blocks kept
   resident (``deepoffload plan`` shows the ``max_memory`` that keeps each), codec ``none``;
4. bytes read per token against ``StreamOptions(max_memory=)`` itself, as a curve (codec none and lossless): from
   the least headroom above the process's own memory the plan takes, up by 0.25 to 1.25 times the blocks' bytes.

Every variant's tokens are checked equal to the first's (a difference is an error, not a figure). Goals of issue 40:
the codec reads <= 0.70 of the bytes and gives >= 1.3x the tokens/s of uncompressed streaming on this disk; on a
disk faster than the CPU decodes (``decode MB/s`` below) the codec is a loss.

    python benchmarks/codec.py [--folder DIR] [--rounds N] [--tokens N] [--quick] [--json PATH]

``--json PATH`` writes the ratios (bars) to PATH and the curve to PATH's name with ``_curve`` (``codec_curve.json``).

The 2 cores and the disk are shared: read the ratios, not the absolutes.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import write_json  # noqa: E402

from deepoffload.swap.codecs.choice import MARGIN  # noqa: E402

warnings.filterwarnings("ignore")
FULL = dict(vocab_size=8192, hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8)
QUICK = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2)
FRACTIONS = (0.0, 0.25, 0.5, 0.75, 1.0)
CURVE_SHARES = (0.0, 0.25, 0.5, 0.75, 1.0, 1.25)  # headroom = the least taken + this share of the blocks


def save_model(folder: str, size: dict) -> str:
    """A bf16 Llama of ``size`` with transformers' own init, saved with ``save_pretrained``; returns its folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**size, num_key_value_heads=size["num_attention_heads"], max_position_embeddings=256)
    path = os.path.join(folder, "model")
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    return path


def generate(
    model_folder: str, swap: str, codec: str, resident: float, ids: torch.Tensor, tokens: int, max_memory: int = 0
) -> dict:
    """One streamed ``generate``: its tokens, seconds, bytes read and the bytes of the model's blocks."""
    import deepoffload
    from deepoffload import LoadOptions, StreamOptions, SwapConfig

    load = LoadOptions(dtype=torch.bfloat16)
    stream = StreamOptions(max_memory=max_memory or None)
    model, off = deepoffload.from_pretrained(
        model_folder, path=swap, load=load, stream=stream, config=SwapConfig(codec=codec)
    )
    try:
        blocks = sum(b.nbytes for b in off.blocks)
        if resident:
            off.set_max_resident_bytes(int(blocks * resident) + 1)
        with torch.no_grad():
            before, start = off.stats.bytes_read, time.perf_counter()
            out = model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
            seconds = time.perf_counter() - start
        return {"out": out, "seconds": seconds, "read": off.stats.bytes_read - before, "blocks": blocks}
    finally:
        off.close()


def memory_curve(folder: str, model_folder: str, ids: torch.Tensor, tokens: int, blocks: int, expected) -> dict:
    """Bytes read per token against ``max_memory`` above the process's own memory at the call (MB), per codec: from
    the least such headroom the plan takes (a step doubled until it is not refused) up by shares of the blocks'
    bytes. The headroom, not ``max_memory`` itself, is the x axis: this process grows as it runs variants."""
    from deepoffload.errors import MemoryBudgetError
    from deepoffload.swap.memory import process_bytes  # (what the plan counts as the process: RssAnon)

    curve: dict[str, tuple[list, list]] = {}
    for codec in ("none", "lossless"):
        xs, ys = curve.setdefault(f"codec {codec}", ([], []))
        least, step = 0, max(blocks // 4, 1 << 20)
        for share in CURVE_SHARES:
            swap = os.path.join(folder, f"curve-{codec}-{share}")
            os.makedirs(swap, exist_ok=True)
            while True:
                headroom = (least or step) + int(blocks * share)
                gc.collect()  # the last variant's model and buffers: freed now, not while the plan measures
                try:
                    run = generate(model_folder, swap, codec, 0.0, ids, tokens, max_memory=process_bytes() + headroom)
                    break
                except MemoryBudgetError:
                    if least:
                        least += 1 << 20  # the process grew since the least was found
                    else:
                        step *= 2
            least = least or headroom
            if not torch.equal(run["out"], expected):
                raise SystemExit(f"max_memory headroom {headroom} codec={codec}: tokens differ from the first run's")
            xs.append(headroom / 1e6)
            ys.append(run["read"] / tokens / 1e6)
    return curve


def raw_read(folder: str, nbytes: int) -> float:
    """Seconds the raw disk takes to read ``nbytes`` (a file written first; 8 MiB requests, 4 in flight)."""
    from deepoffload import AsyncIOHandle
    from deepoffload.io.buffers import aligned_empty

    chunk = 8 << 20
    buffers = [aligned_empty(chunk) for _ in range(4)]
    for b in buffers:
        b.fill_(1)
    path = os.path.join(folder, "raw.bin")
    offsets = range(0, max(nbytes, 1), chunk)
    with AsyncIOHandle() as handle:
        for write in (True, False):
            pending, start = [], time.perf_counter()
            for i, offset in enumerate(offsets):
                if len(pending) == len(buffers):
                    pending.pop(0).wait()
                b = buffers[i % len(buffers)][: min(chunk, nbytes - offset)] if nbytes else buffers[0][:0]
                request = (
                    handle.write_async(b, path, offset, truncate=False) if write else handle.read_async(b, path, offset)
                )
                pending.append(request)
            for request in pending:
                request.wait()
            seconds = time.perf_counter() - start
    os.unlink(path)
    return seconds


def decode_rate(model_folder: str) -> float:
    """The lossless codec's decode speed on this model's first block file's bytes (decoded bytes per second)."""
    from safetensors.torch import load_file

    from deepoffload.swap.codecs import codec_class

    state = load_file(os.path.join(model_folder, "model.safetensors"))
    data = torch.cat([t.reshape(-1).view(torch.uint8) for k, t in state.items() if ".layers." in k])
    codec = codec_class("lossless")()
    stored = torch.empty(codec.max_stored_bytes(data.numel()), dtype=torch.uint8)
    stored = stored[: codec.encode(data, stored)].clone()
    out = torch.empty_like(data)
    start = time.perf_counter()
    codec.decode(stored, out)
    return data.numel() / (time.perf_counter() - start)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--folder", default=None, help="where the model and swap files go (default: a temporary one)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--quick", action="store_true", help="a tiny model, 1 round, 4 tokens (a smoke run)")
    parser.add_argument("--json", default=None, help="write the ratios for benchmarks/plot.py here")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.tokens = 1, 4
    with tempfile.TemporaryDirectory(dir=args.folder) as folder:
        model_folder = save_model(folder, QUICK if args.quick else FULL)
        ids = torch.randint(0, 200, (1, 8), generator=torch.Generator().manual_seed(1))
        runs: dict[str, list[dict]] = {}
        expected = None
        variants = [("none", 0.0), ("lossless", 0.0), *[("none", f) for f in FRACTIONS[1:]]]
        for round_ in range(args.rounds):
            order = variants if round_ % 2 == 0 else variants[1::-1] + variants[2:]  # A B, then B A
            for codec, resident in order:
                swap = os.path.join(folder, f"swap-{codec}-{resident}")
                os.makedirs(swap, exist_ok=True)
                run = generate(model_folder, swap, codec, resident, ids, args.tokens)
                expected = run["out"] if expected is None else expected
                if not torch.equal(run["out"], expected):
                    print(f"codec={codec} resident={resident}: tokens differ from the first run's", file=sys.stderr)
                    return 1
                runs.setdefault(f"{codec} {resident}", []).append(run)
            plain_read = runs["none 0.0"][-1]["read"]
            runs.setdefault("raw", []).append({"seconds": raw_read(folder, plain_read), "read": plain_read})
        rate = decode_rate(model_folder)
        curve = memory_curve(folder, model_folder, ids, args.tokens, runs["none 0.0"][0]["blocks"], expected)

    def median(key: str, field: str) -> float:
        return statistics.median(r[field] for r in runs[key])

    tokens = args.tokens
    plain, packed, raw = "none 0.0", "lossless 0.0", "raw"
    print(f"dense bf16 Llama, {runs[plain][0]['blocks'] / 1e6:.1f} MB of blocks, {tokens} tokens, {args.rounds} rounds")
    print(f"{'variant':<34}{'MB read/token':>15}{'tokens/s':>10}")
    for label, key in (("codec none", plain), ("codec lossless", packed), ("raw disk, codec none's bytes", raw)):
        print(f"{label:<34}{median(key, 'read') / tokens / 1e6:15.2f}{tokens / median(key, 'seconds'):10.2f}")
    read_ratio = median(packed, "read") / median(plain, "read")
    speed = [p["seconds"] / c["seconds"] for p, c in zip(runs[plain], runs[packed])]
    bound = [p["seconds"] / r["seconds"] for p, r in zip(runs[plain], runs[raw])]
    print(f"lossless bytes / none bytes: {read_ratio:.3f} (goal <= 0.70)")
    print(f"lossless tokens/s / none tokens/s, per round: {' '.join(f'{x:.2f}' for x in speed)} (goal >= 1.3)")
    print(f"raw disk / none streaming (time per same bytes), per round: {' '.join(f'{x:.2f}' for x in bound)}")
    print(f"lossless decode on this CPU: {rate / 1e6:.0f} MB/s of decoded bytes (a faster disk makes the codec a loss)")
    print("bytes read per token against the blocks kept resident (max_resident_bytes, codec none):")
    for fraction in FRACTIONS:
        key = f"none {fraction}"
        print(f"  {fraction:>5.2f} of the blocks resident: {median(key, 'read') / tokens / 1e6:8.2f} MB/token")
    print("bytes read per token against max_memory above the process's own memory at the call:")
    for series, (xs, ys) in curve.items():
        print(f"  {series}: " + ", ".join(f"{x:.0f} MB -> {y:.2f} MB/token" for x, y in zip(xs, ys)))
    if args.json:
        results = [
            {"label": "lossless bytes / none bytes", "value": read_ratio, "bound": 0.70, "higher_is_better": False},
            {"label": "lossless tokens/s / none tokens/s", "value": statistics.median(speed), "bound": 1.3},
            {
                "label": "lossless decode speed / raw read speed",
                "value": rate / (median(raw, "read") / median(raw, "seconds")),
                "bound": MARGIN,
            },
        ]
        write_json(args.json, "codec", "Lossless codec: bytes and speed against uncompressed streaming", results)
        stem, suffix = os.path.splitext(args.json)
        series = [{"label": label, "x": xs, "y": ys} for label, (xs, ys) in curve.items()]
        write_json(
            f"{stem}_curve{suffix}",
            "codec",
            "Dense bf16 Llama streamed: bytes read per token against max_memory",
            series,
            unit="MB read per token",
            extra={"kind": "curve", "x_label": "StreamOptions(max_memory=) above the process's own memory (MB)"},
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
