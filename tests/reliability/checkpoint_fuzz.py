"""Mutating the headers of small valid checkpoints (hypothesis): a ``torch.save`` zip's local headers, data
descriptors and directory, a safetensors header, a DCP ``.metadata``. Every load must equal the original or raise
``CheckpointError``; never another exception, a hang (the parent test's timeout) or a large allocation (this
process's address space is capped at what it had after set-up plus ``HEADROOM``).

Run as ``python -m tests.reliability.checkpoint_fuzz <kind> <examples> <folder>`` (what test_checkpoint_fuzz.py
does, in a child process); prints ``OK <kind> <counts>``."""

from __future__ import annotations

import collections
import os
import struct
import sys
import warnings
import zipfile
from pathlib import Path
from typing import Any, Callable

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import deepoffload
import deepoffload.dcp
from deepoffload.errors import CheckpointError
from deepoffload.formats import load_file

HEADROOM = 1 << 30  # bytes of address space a load may add: a crafted size asking for more fails the load
STATE: dict[str, Any] = {
    "weight": torch.arange(12.0).reshape(3, 4),
    "ids": torch.arange(5),
    "half": torch.ones(3, dtype=torch.float16),
}
INTERESTING = [0, 1, 0x7F, 0x80, 0xFF, 0xFFFF, 0x7FFFFFFF, 0xFFFFFFFF]


def zip_regions(path: Path) -> list[tuple[int, int]]:
    """(start, end) of every header the zip holds: local headers, data descriptors, the directory and end records."""
    data = path.read_bytes()
    regions = []
    with zipfile.ZipFile(path) as archive:
        for info in archive.infolist():
            name_length, extra_length = struct.unpack_from("<HH", data, info.header_offset + 26)
            data_start = info.header_offset + 30 + name_length + extra_length
            regions.append((info.header_offset, data_start))
            regions.append((data_start + info.file_size, data_start + info.file_size + 16))  # its descriptor
        regions.append((archive.start_dir, len(data)))
    return regions


def safetensors_regions(path: Path) -> list[tuple[int, int]]:
    """The length field and the JSON header."""
    data = path.read_bytes()
    return [(0, 8 + int.from_bytes(data[:8], "little"))]


mutations = st.lists(
    st.tuples(
        st.integers(0, 1 << 16),  # which region (modulo their count)
        st.integers(0, 1 << 16),  # where in it (modulo its length)
        st.one_of(
            st.tuples(st.just(1), st.integers(0, 255)),
            st.tuples(st.just(2), st.sampled_from(INTERESTING).map(lambda v: v & 0xFFFF)),
            st.tuples(st.just(4), st.sampled_from(INTERESTING)),
        ),
    ),
    min_size=1,
    max_size=3,
)


def mutate(original: bytes, regions: list[tuple[int, int]], changes) -> bytes:
    data = bytearray(original)
    for region, where, (width, value) in changes:
        start, end = regions[region % len(regions)]
        end = min(end, len(data))
        width = min(width, end - start)  # the header's bytes only, never the records' contents
        position = start + where % (end - start - width + 1)
        data[position : position + width] = value.to_bytes(4, "little")[:width]
    return bytes(data)


def same(loaded, original) -> bool:
    return loaded.keys() == original.keys() and all(
        torch.equal(loaded[k], original[k]) if isinstance(original[k], torch.Tensor) else loaded[k] == original[k]
        for k in original
    )


def cap_address_space() -> None:
    import resource

    with open("/proc/self/statm") as f:
        mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(resource.RLIMIT_AS, (mapped + HEADROOM, resource.RLIM_INFINITY))


def prepare(kind: str, folder: Path) -> tuple[bytes, list[tuple[int, int]], Path, Callable[[bool], Any], Any]:
    """The valid file's bytes, the regions to mutate, where mutated bytes go, a load (its flag: the other reader
    or mmap) and what it must return: a dict, or for safetensors a function of the mutated bytes giving what the
    safetensors library reads from them (None where it refuses them). A safetensors header carries no checksum: a
    mutation can make another valid file (a renamed tensor, a shape [3, 4] read as [4, 3]), which must then load as
    the reference reads it."""
    if kind == "zip":
        source = folder / "ckpt.pt"
        torch.save(STATE, source)
        return source.read_bytes(), zip_regions(source), folder / "mutated.pt", _load_zip(folder), STATE
    if kind == "safetensors":
        from safetensors.torch import save_file

        source = folder / "ckpt.safetensors"
        save_file(STATE, str(source))
        target = folder / "mutated.safetensors"
        return source.read_bytes(), safetensors_regions(source), target, _load_safetensors(target), _reference
    import torch.distributed.checkpoint as dcp

    source, state = folder / "ckpt", {**STATE, "step": 7}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=deepoffload.dcp.FileSystemWriter(source), no_dist=True)
    metadata = source / ".metadata"
    return metadata.read_bytes(), [(0, metadata.stat().st_size)], metadata, _load_dcp(source, state), state


def _reference(data: bytes) -> dict | None:
    from safetensors.torch import load

    try:
        return load(data)
    except Exception:  # noqa: BLE001 - the reference refuses these bytes (any way it likes)
        return None


def _load_zip(folder: Path) -> Callable[[bool], Any]:
    return lambda mmap: deepoffload.load(folder / "mutated.pt", mmap=mmap)


def _load_safetensors(target: Path) -> Callable[[bool], Any]:
    return lambda other: load_file(target) if other else deepoffload.load(target)


def _load_dcp(source: Path, state: dict) -> Callable[[bool], Any]:
    def load(_: bool) -> dict:
        into = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in state.items()}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            deepoffload.dcp.load(into, source, no_dist=True)
        return into

    return load


def run(kind: str, examples: int, folder: Path) -> collections.Counter:
    counts: collections.Counter = collections.Counter()
    original, regions, target, load, oracle = prepare(kind, folder)

    def expected(data: bytes) -> dict | None:
        return oracle(data) if callable(oracle) else oracle

    fuzz = settings(
        max_examples=examples,
        deadline=None,  # the parent's timeout catches a hang; a slow shared machine must not fail a load
        derandomize=True,  # the same cases every run (stable in CI)
        database=None,
        suppress_health_check=list(HealthCheck),
    )

    @fuzz
    @given(changes=mutations, flag=st.booleans())
    def check(changes, flag):
        data = mutate(original, regions, changes)
        target.write_bytes(data)
        try:
            loaded = load(flag)
        except CheckpointError as e:
            cause = e  # a refusal the address-space cap caused is a large allocation, not a check (DCP's load
            while cause is not None:  # passes its readers' errors on as text: the name is looked for there too)
                if isinstance(cause, MemoryError) or "MemoryError" in str(cause):
                    raise AssertionError(f"a mutated file made the load allocate past the cap: {changes}") from e
                cause = cause.__cause__ or cause.__context__
            counts["CheckpointError"] += 1
            return
        reference = expected(data)
        if reference is None or not same(loaded, reference):
            raise AssertionError(f"a mutated file loaded as something else: {changes}")
        counts["equal" if data != original else "unchanged"] += 1

    target.write_bytes(original)
    if not same(load(False), expected(original)) or not same(load(True), expected(original)):
        raise AssertionError(f"the {kind} file does not load unchanged")
    cap_address_space()
    check()
    return counts


if __name__ == "__main__":
    import logging

    logging.disable(logging.CRITICAL)  # DCP logs every failed load at ERROR level
    kind, examples, folder = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
    print("OK", kind, dict(run(kind, examples, folder)))
