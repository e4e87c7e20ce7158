"""``CompressedCopy``: a served checkpoint's blocks compressed once, in the background, and read from then on.

With ``serve_from_checkpoint=True`` and ``SwapConfig(codec=...)`` other than ``none``:

The first run serves the blocks from the checkpoint's own bytes while a background thread reads each served block's
range from the checkpoint, encodes it with the codec and writes it to a temporary folder; once every block is
written and fsynced, a manifest (the codec, every block's records, and each source file's size, modification time,
inode and xxh3-64 of its first and last 64 KiB) is written and fsynced, and the temporary folder is renamed to
``<swap folder>/deepoffload-copy-<hash of the checkpoint's path>`` (then the swap folder is fsynced). A crash at any
point leaves no copy (a temporary folder, removed by the next run once its writer is dead) or a whole one. In the
same run, once the copy is published, each block switches to it at its next read; later runs read it from the
start. A copy whose manifest does not match the checkpoint as it is now (a source file changed, other blocks, another
codec) is never read: it is removed and built again. It warns once when it starts building, naming the folder.

Memory: the writer holds one block's raw bytes and its encoded bytes (B + S); served blocks' reads are raw, so the
plan's (prefetch + 2) S for encoded bytes in flight (S >= B) is unused while it runs, and covers it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Mapping

import torch

from ....formats.commit import sync_folder
from ....io.owners import is_alive
from ...codecs import codec_class
from ...pool import round_up
from ...records import TENSOR_ALIGNMENT, SwapRecord, file_identity, group_span, hash_bytes

SAMPLE = 64 << 10  # bytes hashed at each end of a source file (with its size, mtime and inode: its identity)
MANIFEST = "manifest.json"
DTYPES = {str(t): t for t in (torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int64, torch.int32,
                              torch.int16, torch.int8, torch.uint8, torch.bool)}  # fmt: skip


def source_identity(path: str) -> list:
    """A checkpoint file's identity: size, modification time, device, inode and the hash of its two ends.

    Args:
        path: The file.

    Returns:
        ``[device, inode, size, mtime_ns, xxh3 of the first and last SAMPLE bytes]``, as JSON keeps it.
    """
    device, inode, size, mtime = file_identity(path)
    with open(path, "rb") as f:
        head = f.read(SAMPLE)
        f.seek(max(0, size - SAMPLE))
        tail = f.read(SAMPLE)
    ends = torch.frombuffer(bytearray(head + tail), dtype=torch.uint8) if head or tail else torch.empty(0)
    return [device, inode, size, mtime, hash_bytes(ends.to(torch.uint8))]


class CompressedCopy:
    """The compressed copy of the blocks one offload serves from a checkpoint.

    Args:
        base: The swap folder the copy lives in (``SwapConfig.folder``'s first, or the system's temporary folder).
        codec: The codec's registered name.
    """

    def __init__(self, base: str | None, codec: str):
        self.codec = codec
        self.base = base or tempfile.gettempdir()
        self.sources: dict[str, dict[str, SwapRecord]] = {}  # group -> its records in the checkpoint
        self.folder: str | None = None
        self.records: dict[str, dict[str, SwapRecord]] | None = None  # the copy's, once whole and matching
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.used: set[str] = set()  # groups read from the copy now

    # -- in the caller's thread -------------------------------------------------------------------------------
    def add(self, group: str, records: Mapping[str, SwapRecord]) -> None:
        """Serve ``group`` from ``records`` (a checkpoint range) until the copy holds it."""
        self.sources[group] = dict(records)

    def start(self) -> None:
        """Use a whole, matching copy if there is one; else start building it in the background (once)."""
        if self.folder is not None or not self.sources:
            return
        files = sorted({r.file for rs in self.sources.values() for r in rs.values()})
        named = "\n".join([self.codec, *files]).encode()
        key = hash_bytes(torch.frombuffer(bytearray(named), dtype=torch.uint8))
        self.folder = os.path.join(self.base, f"deepoffload-copy-{key:016x}")
        for name in os.listdir(self.base):  # temporaries of dead writers
            stem, _, pid = name.rpartition(".tmp-")
            if stem == os.path.basename(self.folder) and pid.isdigit() and not is_alive(int(pid), 0):
                shutil.rmtree(os.path.join(self.base, name), ignore_errors=True)
        self.records = self._read_manifest()
        if self.records is not None:
            return
        if os.path.exists(self.folder):  # stale: its checkpoint changed, or other blocks or codec
            stale = f"{self.folder}.old-{os.getpid()}"
            os.rename(self.folder, stale)
            shutil.rmtree(stale, ignore_errors=True)
        warnings.warn(
            f"deepoffload: writing a compressed copy (codec {self.codec!r}) of the {len(self.sources)} served blocks "
            f"to {self.folder} in the background; blocks are served from the checkpoint until it is complete",
            stacklevel=4,
        )
        self._thread = threading.Thread(target=self._build, name="deepoffload-compressed-copy", daemon=True)
        self._thread.start()

    def ready(self, group: str) -> dict[str, SwapRecord] | None:
        """The copy's records of ``group`` once the copy is whole and published (else None: serve the source)."""
        if self.records is None and self._thread is not None and not self._thread.is_alive():
            self._thread = None
            if self.error is None:
                self.records = self._read_manifest()
        return self.records.get(group) if self.records is not None else None

    def wait(self) -> bool:
        """Wait for the background writer; True when a whole copy is there to read."""
        if self._thread is not None:
            self._thread.join()
        return bool(self.sources) and all(self.ready(g) is not None for g in self.sources)

    def close(self) -> None:
        """Stop a writer still running (its temporary folder is removed: no copy this time)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    # -- the manifest ---------------------------------------------------------------------------------------------
    def _read_manifest(self) -> dict[str, dict[str, SwapRecord]] | None:
        """The copy's records when its manifest matches the sources as they are now, else None."""
        folder = self.folder
        if folder is None:
            return None
        try:
            with open(os.path.join(folder, MANIFEST)) as f:
                manifest = json.load(f)
            files = {r.file for rs in self.sources.values() for r in rs.values()}
            if manifest["codec"] != self.codec or manifest["sources"] != {f: source_identity(f) for f in files}:
                return None
            copies = {}
            for group, source in self.sources.items():
                entries = manifest["groups"][group]
                records = {
                    key: SwapRecord(key, DTYPES[e["dtype"]], tuple(e["shape"]), e["nbytes"],
                                    os.path.join(folder, e["file"]), e["offset"], torch.device("cpu"),
                                    codec=self.codec, stored=e["stored"])
                    for key, e in entries.items()
                }  # fmt: skip
                if {k: (r.dtype, r.shape, r.nbytes) for k, r in records.items()} != {
                    k: (r.dtype, tuple(r.shape), r.nbytes) for k, r in source.items()
                } or any(os.path.getsize(r.file) < r.stored for r in records.values()):
                    return None
                copies[group] = records
            return copies
        except (OSError, KeyError, ValueError, TypeError):  # no copy, or not a whole one: never read, rebuilt
            return None

    # -- the background writer ------------------------------------------------------------------------------------
    def _build(self) -> None:
        folder = self.folder
        if folder is None:
            return
        tmp = f"{folder}.tmp-{os.getpid()}"
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp, mode=0o700)
            codec = codec_class(self.codec)()
            files = sorted({r.file for rs in self.sources.values() for r in rs.values()})
            identities = {f: source_identity(f) for f in files}
            groups = {}
            for group, source in self.sources.items():
                if self._stop.is_set():
                    raise InterruptedError("closed before the copy was complete")
                groups[group] = self._write_group(tmp, group, source, codec)
            if {f: source_identity(f) for f in files} != identities:
                raise OSError(f"the checkpoint changed while its compressed copy was written: {files}")
            manifest = os.path.join(tmp, MANIFEST)
            with open(manifest, "w") as f:
                json.dump({"codec": self.codec, "sources": identities, "groups": groups}, f)
                f.flush()
                os.fsync(f.fileno())
            sync_folder(Path(tmp))
            os.rename(tmp, folder)  # refused over a copy another run published first: that one is used
            sync_folder(Path(self.base))
        except BaseException as e:  # noqa: BLE001 - the run goes on serving the checkpoint; no copy this time
            self.error = e
            shutil.rmtree(tmp, ignore_errors=True)

    def _write_group(self, tmp: str, group: str, source: dict[str, SwapRecord], codec) -> dict:
        """Read ``group``'s tensors from the checkpoint, lay them out as a swap file would, encode, write, fsync."""
        layout, offset = {}, 0
        for key, record in source.items():
            layout[key] = offset
            offset = round_up(offset + record.nbytes, TENSOR_ALIGNMENT)
        span = group_span([dataclasses.replace(r, offset=layout[k]) for k, r in source.items()])
        raw = torch.zeros(span, dtype=torch.uint8)
        with open(next(iter(source.values())).file, "rb", buffering=0) as f:
            for key, record in source.items():
                f.seek(record.offset)
                view = raw[layout[key] : layout[key] + record.nbytes].numpy().data
                if f.readinto(view) != record.nbytes:
                    raise OSError(f"{record.file}: cut short at {key!r}")
        stored = torch.empty(codec.max_stored_bytes(span), dtype=torch.uint8)
        nbytes = codec.encode(raw, stored)
        name = f"{group}.bin"
        with open(os.path.join(tmp, name), "wb") as f:
            f.write(stored[:nbytes].numpy().data)
            f.write(bytes(round_up(nbytes) - nbytes))  # whole pages: a read takes them at once
            f.flush()
            os.fsync(f.fileno())
        return {
            key: {"dtype": str(r.dtype), "shape": list(r.shape), "nbytes": r.nbytes, "offset": layout[key],
                  "file": name, "stored": nbytes}
            for key, r in source.items()
        }  # fmt: skip
