"""``offload_activations``: tensors saved for backward go to storage in the forward and come back ahead of the backward.

A context manager over ``torch.autograd.graph.saved_tensors_hooks``. Its pack hook decides per saved tensor:

- kept as it is (never written): tensors whose storage is smaller than ``min_bytes``; parameters (``nn.Parameter``,
  leaves requiring grad) and views of them; tensors already on storage (a storage mapping a file shared, or one this
  run read back); tensors saved while a backward runs (a recomputation's short-lived graph); tensors that have no
  plain strided storage (sparse, quantized, subclasses, conjugate or negative views); tensors not in CPU memory
  (accelerator tensors, warned once); every tensor after a write failed;
- stored once per storage: a tensor saved twice, or a view of a tensor already saved (same storage, same base, same
  version), shares the first one's bytes; the handle keeps dtype, shape, strides and offset and rebuilds the view;
- otherwise written (``ActivationStore``), the tensor held only until its writes complete.

The unpack hook serves the bytes from memory while they are still being written (or after a write failed), else
from the read started ahead (``prefetch`` stored tensors below the one asked for, in the forward's order, which the
backward walks backwards), else reads them now. Checksums are on by default: a changed file raises ``ChecksumError``.
"""

from __future__ import annotations

import collections
import threading
import warnings
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from ..errors import UnsupportedError
from ..swap.config import SwapConfig
from .drives import ActivationDrives
from .store import StoredBytes

MIN_BYTES = 1 << 20
PREFETCH = 2
CHUNK_BYTES = 8 << 20
COUNTS = ("written", "deduplicated", "kept", "served_from_memory", "read")


class _Saved:
    """What the pack hook returns for a stored tensor: its bytes' record and how to rebuild the tensor on them."""

    __slots__ = ("owner", "stored", "dtype", "size", "stride", "offset", "base", "version")

    def __init__(self, owner: "ActivationOffload", stored: StoredBytes, tensor: torch.Tensor):
        self.owner = owner
        self.stored = stored
        # An in-place change after the save bumps the version counter its views share; every view holds its base, so
        # while one could still change it the base lives and shows it (plain autograd raises at the backward then).
        self.base = weakref.ref(tensor if tensor._base is None else tensor._base)
        self.version = tensor._version
        self.dtype = tensor.dtype
        self.size = tensor.size()
        self.stride = tensor.stride()
        self.offset = tensor.storage_offset()
        stored.users += 1

    def __del__(self) -> None:
        try:
            self.owner._drop(self.stored)
        except Exception:  # (at interpreter exit modules may be gone; the run folder goes by its own finalizer)
            pass


class ActivationOffload:
    """One run of ``offload_activations``: use it once, as a context manager.

    Args:
        config: Folder, bytes being written at once (``buffer_count * chunk_bytes``), checksums, aio settings.
        min_bytes: Saved tensors whose storage holds fewer bytes stay in memory.
        prefetch: Stored tensors read ahead of the backward (>= 0).

    Attributes:
        counts: How many saved tensors were ``written``, ``deduplicated`` (shared a stored tensor's bytes),
            ``kept`` in memory, ``served_from_memory`` (still being written when unpacked) and ``read``.

    Examples:
        >>> import torch, deepoffload
        >>> x = torch.randn(512, 512, requires_grad=True)
        >>> with deepoffload.offload_activations(".", min_bytes=0) as off:
        ...     x.exp().sin().sum().backward()  # exp saves its result, sin its input: one storage
        >>> off.stats()["written"], off.stats()["deduplicated"], off.stats()["stored"]
        (1, 1, 0)
    """

    def __init__(self, config: SwapConfig, min_bytes: int, prefetch: int):
        for name, value in (("min_bytes", min_bytes), ("prefetch", prefetch)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"offload_activations: {name} must be an integer >= 0, got {value!r}")
        self.config = config
        self.min_bytes = min_bytes
        self.prefetch = prefetch
        self.store: ActivationDrives | None = None
        self.counts = collections.Counter[str]()
        self._lock = threading.Lock()
        self._state = "new"
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None
        self._order: list[StoredBytes] = []
        self._by_storage: dict[int, list[tuple[weakref.ref, weakref.ref, int, StoredBytes]]] = {}
        self._read_back: dict[int, tuple[weakref.ref, StoredBytes]] = {}
        self._dead: collections.deque[StoredBytes] = collections.deque()
        self._warned_device = False

    # -- the context ------------------------------------------------------------------------------------------
    def __enter__(self) -> "ActivationOffload":
        with self._lock:
            if self._state != "new":
                raise UnsupportedError(
                    f"this offload_activations() context is {self._state}: each one is a run of its own, entered "
                    f"once (on one thread); use a new deepoffload.offload_activations() for each with block"
                )
            self._state = "active"
        try:
            self.store = ActivationDrives(self.config)
        except BaseException:
            self._state = "closed"
            raise
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        hooks, self._hooks = self._hooks, None
        if hooks is not None:
            hooks.__exit__(*exc)
        with self._lock:
            self._state = "exited"
            store = self.store
            if store is None:
                return
            self._process_dead()
            try:
                store.reap(wait=True)
            finally:
                error = store.take_error()
                if not store.live:
                    self._close()
        if error is not None and exc[0] is None:
            raise error

    def stats(self) -> dict[str, int]:
        """Counts and bytes of this run so far.

        Returns:
            ``counts`` plus ``bytes_written``, ``bytes_read``, ``stored`` (stored tensors alive), ``file_bytes`` and
            ``peak_held_bytes`` (the library's own part of the memory: the most bytes of saved tensors it kept
            alive while they were being written plus those read ahead and not yet used, at once).
        """
        store = self.store
        extra = {"bytes_written": 0, "bytes_read": 0, "stored": 0, "file_bytes": 0, "peak_held_bytes": 0}
        if store is not None:
            extra = {
                "bytes_written": store.bytes_written,
                "bytes_read": store.bytes_read,
                "stored": store.live,
                "file_bytes": store.file_bytes,
                "peak_held_bytes": store.peak_held,
            }
        return {**{name: self.counts[name] for name in COUNTS}, **extra}

    @property
    def folder(self) -> str | None:
        """The run folder (the first drive's with several folders; None before the context is entered)."""
        return None if self.store is None else self.store.folders[0]

    @property
    def folders(self) -> list[str]:
        """The run folder on each drive (empty before the context is entered)."""
        return [] if self.store is None else self.store.folders

    # -- pack ---------------------------------------------------------------------------------------------------
    def _pack(self, tensor: torch.Tensor) -> Any:
        storage = self._storage_to_write(tensor)
        if storage is None:
            self.counts["kept"] += 1
            return tensor.detach()  # (no grad_fn: a saved output must not hold its own node)
        with self._lock:
            self._process_dead()
            store = self.store
            if store is None or store.failed is not None:
                self.counts["kept"] += 1
                return tensor.detach()
            store.reap()
            # A tensor no autograd node made (a buffer, an input, a no-grad result) may change in place without its
            # version counter moving (BatchNorm's running statistics do, in the kernel that saves them): its bytes are
            # copied at the save, and it is never taken for an earlier save of the same storage and version.
            fresh = tensor.grad_fn is not None
            stored = self._stored_already(tensor, storage) if fresh else None
            if stored is not None:
                self.counts["deduplicated"] += 1
                return _Saved(self, stored, tensor)
            stored = store.write(tensor.detach(), tensor._version, len(self._order), copy=not fresh)
            self._order.append(stored)
            base = tensor if tensor._base is None else tensor._base
            entry = (weakref.ref(storage), weakref.ref(base), tensor._version, stored)
            self._by_storage.setdefault(storage.data_ptr(), []).append(entry)
            self.counts["written"] += 1
            return _Saved(self, stored, tensor)

    def _storage_to_write(self, tensor: torch.Tensor) -> torch.UntypedStorage | None:
        """The storage of ``tensor`` when it should be written, else None (see the module docstring)."""
        if torch._C._current_autograd_node() is not None:  # saved while a backward runs: a recomputation's graph
            return None
        if type(tensor) is not torch.Tensor or tensor.is_leaf and tensor.requires_grad:  # (nn.Parameter too)
            return None
        base = tensor._base
        if base is not None and (isinstance(base, torch.nn.Parameter) or base.is_leaf and base.requires_grad):
            return None
        if tensor.layout != torch.strided or tensor.is_quantized or tensor.is_conj() or tensor.is_neg():
            return None
        if tensor.device.type != "cpu":  # (accelerator tensors: not yet measured or tested on a device)
            if not self._warned_device:
                self._warned_device = True
                warnings.warn(
                    f"offload_activations: saved tensors on {tensor.device.type} stay in device memory; only CPU "
                    f"tensors are written to storage (torch.autograd.graph.save_on_cpu moves them to CPU memory)",
                    UserWarning,
                    stacklevel=2,
                )
            return None
        storage = tensor.untyped_storage()
        if storage.nbytes() < max(self.min_bytes, 1) or storage.filename is not None:
            return None
        read_back = self._read_back.get(storage.data_ptr())
        if read_back is not None and read_back[0]() is storage:  # read back by this run: on storage already
            return None
        return storage

    def _stored_already(self, tensor: torch.Tensor, storage: torch.UntypedStorage) -> StoredBytes | None:
        """The record of a save of the same storage, base and version as ``tensor`` still alive, or None."""
        base = tensor if tensor._base is None else tensor._base
        entries = self._by_storage.get(storage.data_ptr(), [])
        entries[:] = [e for e in entries if e[0]() is not None and e[3].users > 0]
        for storage_ref, base_ref, version, stored in entries:
            if storage_ref() is storage and base_ref() is base and version == tensor._version:
                return stored
        return None

    # -- unpack -------------------------------------------------------------------------------------------------
    def _unpack(self, saved: Any) -> torch.Tensor:
        if not isinstance(saved, _Saved):
            return saved
        with self._lock:
            self._process_dead()
            store = self.store
            if store is None:
                raise UnsupportedError("offload_activations: a saved tensor of a run that was never entered")
            error = store.take_error()
            if error is not None:
                raise error
            store.reap()
            stored = saved.stored
            original, base = stored.original, saved.base()
            kept = original if not stored.copied else None  # (a copy's own counter says nothing of the user's)
            changed = [t for t in (base, kept) if t is not None and t._version != saved.version]
            if changed:
                raise UnsupportedError(
                    f"offload_activations: a tensor saved for backward ({tuple(saved.size)}, {saved.dtype}) was "
                    f"changed in place after it was saved (version {saved.version}, now "
                    f"{changed[0]._version}); plain autograd refuses this backward "
                    f"too, as its gradients would not be those of the forward. Change a clone instead "
                    f"(x = x.clone(); x.add_(...)), or use an out-of-place op"
                )
            in_memory = stored.original is not None
            self.counts["served_from_memory" if in_memory else "read"] += 1
            storage, skip = store.bytes_of(stored)
            if not in_memory:  # a tensor of it saved again (a recomputation, a double backward) is not written again
                self._read_back[storage.data_ptr()] = (weakref.ref(storage), stored)
            self._read_ahead(stored)
        tensor = torch.empty(0, dtype=saved.dtype, device=stored.device)
        return tensor.set_(storage, saved.offset + skip // tensor.element_size(), saved.size, saved.stride)

    def _read_ahead(self, stored: StoredBytes) -> None:
        """Start reading the ``prefetch`` stored tensors saved before ``stored`` (the backward's next ones)."""
        store = self.store
        if store is None:
            return
        for index in range(stored.index - 1, max(stored.index - 1 - self.prefetch, -1), -1):
            before = self._order[index]
            if before.users > 0 and before.original is None:
                store.start_read(before)

    # -- lifetime -----------------------------------------------------------------------------------------------
    def _drop(self, stored: StoredBytes) -> None:
        """A handle of ``stored`` died (any thread, maybe inside this object's own calls): counted at the next call."""
        self._dead.append(stored)
        if self._lock.acquire(blocking=False):
            try:
                self._process_dead()
            finally:
                self._lock.release()

    def _process_dead(self) -> None:
        """Free the records whose last handle died (under the lock)."""
        store = self.store
        while self._dead:
            stored = self._dead.popleft()
            stored.users -= 1
            if stored.users == 0 and store is not None and not store.closed:
                store.free(stored)
        if store is not None and not store.live and not store.closed:
            self._order.clear()
            self._by_storage.clear()
            self._read_back.clear()
            if self._state == "exited":
                self._close()

    def _close(self) -> None:
        store = self.store
        if store is not None and not store.closed:
            store.close()
            self._state = "closed"


def offload_activations(
    path: str | Sequence[str] | None = None,
    *,
    min_bytes: int = MIN_BYTES,
    prefetch: int = PREFETCH,
    checksum: bool = True,
    config: SwapConfig | None = None,
) -> ActivationOffload:
    """Store the tensors autograd saves for backward on disk during the forward, and read them back for the backward.

    Use it as a context manager around the forward (and, typically, the backward). Each saved tensor whose storage
    holds at least ``min_bytes`` bytes is written asynchronously, straight from its memory, while the forward goes
    on; its memory is released once written. The backward reads them back ahead of use, in reverse order.
    Parameters, views of parameters and tensors already on storage are never written; a tensor saved twice (or
    several views of one storage) is written once. The gradients are bit-identical to those of the same step
    without the context (``tests/activations/test_offload_activations.py``).

    Files: one file in a run folder of its own under ``path`` (see ``SwapConfig.folder``), removed at the exit of the
    context once nothing saved is left, else once the last graph that saved tensors in it is freed (a backward run
    after the context), and at interpreter exit; the next run removes the folders of crashed processes. Several
    folders (``path=[a, b]``, each on a drive of its own): a run folder and file on each, each drive with its own IO
    queue, each saved tensor placed on the drive with the fewest bytes so far per unit of ``config.folder_speeds``
    (``tests/activations/test_activation_drives.py``).

    Errors: a failed write (full disk) leaves that tensor, and every later one of the run, in memory, and raises its
    ``OSError`` (errno, path, offset) once: at the next backward use of a stored tensor or at the context's exit,
    whichever comes first. Bytes changed on storage raise ``ChecksumError`` at the backward.

    Nesting and threads: saved-tensor hooks are per thread and the innermost ones apply, so a nested context (or
    ``torch.utils.checkpoint``'s own hooks) takes the tensors saved inside it. A context object is entered once;
    entering it again (on any thread) raises ``UnsupportedError``. Its stored tensors may be unpacked from any thread.

    Args:
        path: The base folder for the run folder, or a list of them (one per drive; default: ``config.folder``, else
            the temp folder).
        min_bytes: Saved tensors whose storage is smaller stay in memory (bytes).
        prefetch: Stored tensors read ahead of the backward.
        checksum: Hash each staged chunk (xxh3-64) and check it when read back (replaces ``config.checksum``).
        config: Bytes of saved tensors being written at once (at most ``buffer_count * chunk_bytes``, or one tensor
            when larger), bytes per checksum (``chunk_bytes``), aio settings (default: 4 x 8 MiB).

    Returns:
        The context manager (an ``ActivationOffload``; ``stats()`` gives its counts and bytes).

    Raises:
        ValueError: When ``min_bytes`` or ``prefetch`` is negative or not an integer.
        FileNotFoundError: When one of several folders does not exist (at the context's entry).

    Examples:
        >>> import torch, deepoffload
        >>> model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 1))
        >>> x = torch.randn(1024, 512)
        >>> with deepoffload.offload_activations(".", min_bytes=1 << 20) as off:
        ...     model(x).sum().backward()
        >>> off.stats()["written"] > 0
        True
    """
    config = config or SwapConfig(chunk_bytes=CHUNK_BYTES)
    config = config.replace(checksum=checksum, **({} if path is None else {"folder": path}))
    if isinstance(config.folder, tuple) and len(config.folder) == 1:
        config = config.replace(folder=config.folder[0], folder_speeds=None)
    return ActivationOffload(config, min_bytes, prefetch)
