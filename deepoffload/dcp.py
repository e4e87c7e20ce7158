"""``torch.distributed.checkpoint`` (DCP) storage whose bytes move through the async-IO op.

``FileSystemWriter`` and ``FileSystemReader`` are DCP's own classes with their filesystem swapped for one that opens
``DirectWriter``/``DirectReader`` streams, so planning and the rank files' contents are exactly DCP's (either side
reads what the other wrote); the IO differs (each rank's file is written through multi-buffered aligned O_DIRECT
writes and read with aligned read-ahead), and so do the rank files' names (one generation per save, below) and with
them the names ``.metadata`` records. Use them wherever DCP's are used::

    import torch.distributed.checkpoint as dcp
    from deepoffload.dcp import FileSystemReader, FileSystemWriter

    dcp.save(state_dict, storage_writer=FileSystemWriter("/nvme/ckpt/step100"))
    dcp.load(state_dict, storage_reader=FileSystemReader("/nvme/ckpt/step100"))

Saving again into the same folder is crash-consistent: each save's data files get names no earlier save used
(``__<rank>_<generation>_<n>.distcp``) and are written privately (``0600``); the ``.metadata`` naming them is
renamed over the old one (never removed first) and the folder fsynced, which switches readers from the whole old
checkpoint to the whole new one. Only then are the old data files removed, and the new ones given the old
checkpoint's mode (or the umask's).

Saves that overlap in one folder (a resubmitted job, an asynchronous save still running) each leave a loadable
checkpoint, and the one whose ``.metadata`` rename comes last is what the folder holds once both end. DCP writes data
files under their final names before ``.metadata`` names them, so each save marks its generation as in progress with
an empty file ``.__<generation>.partial-<pid>.<start>.<host>-<random>`` (made by the coordinator before any rank
writes, removed once ``.metadata`` names the files), and a save's ``finish`` (the ``.metadata`` rename, then the
removal of data files it does not name) runs under the folder's save lock (``deepoffload.io.folder_lock``). It
removes a data file only if the new ``.metadata`` does not name it and no live writer's marker covers its
generation: a superseded file, or one of a save that died (its marker too is removed then).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import weakref
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Generator, cast

from torch.distributed.checkpoint import filesystem as _dcp_fs
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem, SavePlan, SavePlanner
from torch.distributed.checkpoint.state_dict_loader import load as _dcp_load
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from .config import AioConfig
from .errors import CheckpointError
from .formats.commit import new_generation, sync_folder
from .formats.dcp_metadata import check_metadata, read_metadata
from .formats.torch_zip.streams import DirectReader, DirectWriter
from .io.folder_lock import folder_lock
from .io.owners import PRIVATE_MODE, adopt_mode, create_private, remove_dead_temporaries, temporary_name

METADATA_NAME = ".metadata"  # DCP's name for the file that names every data file of a checkpoint
_DATA_FILE = re.compile(r"__(?P<rank>\d+)_(?:(?P<generation>[0-9a-f]{8})_)?\d+\.distcp")
_PREFIX = re.compile(r"__\d+_(?P<generation>[0-9a-f]{8})_")  # a save plan's file prefix (see prepare_global_plan)
_MARKER = re.compile(r"\.(?P<target>__[0-9a-f]{8})\.partial-.*")  # a save in progress (see the module docstring)

__all__ = ["FileSystemReader", "FileSystemWriter", "OpFileSystem", "load"]


class OpFileSystem(_dcp_fs.FileSystem):
    """DCP's local ``FileSystem`` with streams through the async-IO op.

    Args:
        config: The async-IO op's settings for every stream (default: ``AioConfig.from_env()``).

    Examples:
        >>> from deepoffload.dcp import OpFileSystem
        >>> fs = OpFileSystem()
        >>> with fs.create_stream("part.bin", "wb") as stream:
        ...     stream.write(b"hello")
        5
        >>> with fs.create_stream("part.bin", "rb") as stream:
        ...     stream.read()
        b'hello'
    """

    def __init__(self, config: AioConfig | None = None) -> None:
        super().__init__()
        self.config = config

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[Any, None, None]:
        """Open ``path`` as a stream through the op: a ``DirectWriter`` for ``"wb"``, else a ``DirectReader``.

        A new file is written front to back, private (``0600``) until the save is complete, and not fsynced here
        (DCP fsyncs itself); if the writing fails, the file is removed. A read error that ``torch.load`` hides is
        raised instead of what it caused.

        Args:
            path: The file to open.
            mode: ``"wb"`` (also ``"w+b"``, ``"bw"``) to write a new file; a mode without ``w``, ``a`` or ``+`` to
                read.

        Yields:
            The open stream; it is closed when the ``with`` block ends.

        Raises:
            ValueError: When ``mode`` writes other than ``"wb"`` (appending or updating a file).
        """
        if "w" in mode or "a" in mode or "+" in mode:
            if mode not in ("wb", "w+b", "bw"):
                raise ValueError(
                    f"deepoffload.dcp: cannot open {path} with mode {mode!r}; only 'wb' (a new file, "
                    f"written front to back) is supported"
                )
            # private until the save is complete; DCP fsyncs itself (sync_files)
            stream = DirectWriter(path, config=self.config, sync=False, mode=PRIVATE_MODE)
            try:
                yield stream
            except BaseException:
                stream.abort()
                _remove(path)
                raise
            try:
                stream.close()  # DCP may have closed it already; a second close does nothing
            except BaseException:
                _remove(path)
                raise
        else:
            with DirectReader(path, config=self.config) as reader:
                try:
                    yield reader
                except Exception as e:
                    if reader.error is not None and reader.error is not e:  # torch.load hides the read's error
                        raise reader.error from e
                    raise

    def rm_file(self, path: str | os.PathLike) -> None:
        """Remove ``path``, except DCP's ``.metadata``.

        DCP removes ``.metadata`` just before renaming the new one over it: the rename replaces it atomically, and
        removing it first would leave no checkpoint if the writer died.

        Args:
            path: The file to remove.
        """
        if Path(path).name.endswith(METADATA_NAME):
            return
        os.unlink(path)

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        """Atomically replace ``new_path`` by ``path`` (given ``new_path``'s mode first) and fsync the folder.

        Args:
            path: The file to rename.
            new_path: Its new name; a file already there is replaced.
        """
        adopt_mode(path, new_path)
        os.replace(path, new_path)
        sync_folder(Path(new_path).parent)


def _remove(path: str | os.PathLike) -> None:
    """Remove the file of a failed write: a failed save leaves no file behind."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class FileSystemWriter(_dcp_fs.FileSystemWriter):
    """DCP's ``FileSystemWriter`` (same arguments), writing through the async-IO op.

    Re-saving into a folder is crash-consistent (see the module docstring).

    Args:
        path: The checkpoint's folder.
        *args: DCP's ``FileSystemWriter`` arguments (``single_file_per_rank``, ``sync_files``, ...).
        config: The async-IO op's settings (default: ``AioConfig.from_env()``).
        **kwargs: DCP's ``FileSystemWriter`` keyword arguments.

    Examples:
        >>> import torch, torch.distributed.checkpoint as dcp
        >>> from deepoffload.dcp import FileSystemReader, FileSystemWriter
        >>> _ = dcp.save({"weight": torch.arange(4.0)}, storage_writer=FileSystemWriter("step1"))
        >>> state = {"weight": torch.zeros(4)}
        >>> dcp.load(state, storage_reader=FileSystemReader("step1"))
        >>> state["weight"]
        tensor([0., 1., 2., 3.])
    """

    def __init__(self, path: str | os.PathLike, *args: Any, config: AioConfig | None = None, **kwargs: Any) -> None:
        super().__init__(path, *args, **kwargs)
        self.fs = OpFileSystem(config)
        self.path = self.fs.init_path(path)
        # per generation, what removes its in-progress marker (once): one writer may serve overlapping saves (an
        # async_save still writing when the next save starts), so each save's mark is its own
        self._markers: dict[str, weakref.finalize] = {}

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """DCP's local plan, with a new generation in this rank's file names when the rank names its own files.

        Args:
            plan: This rank's save plan.

        Returns:
            The plan DCP's writer makes; when it sets a file prefix (each rank names its own files, no collectives),
            the prefix gets a generation no earlier save used, marked in the folder as in progress.
        """
        plan = super().prepare_local_plan(plan)
        if plan.storage_data is not None:  # each rank names its own files (no collectives): add a generation
            generation = new_generation()
            self._mark(generation)
            plan = dataclasses.replace(
                plan, storage_data=_dcp_fs._StoragePrefix(f"{plan.storage_data.prefix}{generation}_")
            )
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Give every rank's plan the file prefix ``__<rank>_<generation>_``, one generation for the whole save.

        The generation is marked in the folder as in progress before any rank writes (see the module docstring).

        Args:
            plans: The ranks' plans, in rank order (on the coordinator).

        Returns:
            The plans, each without a prefix given ``__<i>_<generation>_``; a plan that has one is kept.
        """
        generation = new_generation()  # one for the whole save, chosen by the coordinator
        if any(plan.storage_data is None for plan in plans):
            self._mark(generation)
        return [
            dataclasses.replace(plan, storage_data=_dcp_fs._StoragePrefix(f"__{i}_{generation}_"))
            if plan.storage_data is None
            else plan
            for i, plan in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Write this rank's items as DCP's writer does; if that fails, this save's in-progress mark goes at once.

        Args:
            plan: This rank's save plan.
            planner: The planner that supplies the data.

        Returns:
            DCP's future of this rank's write results.
        """
        try:
            return super().write_data(plan, planner)
        except BaseException:  # the save fails: what it wrote is nobody's to keep (the next save removes it)
            prefix = plan.storage_data.prefix if plan.storage_data is not None else ""
            self._unmark({m["generation"]} if (m := _PREFIX.fullmatch(prefix)) else set())
            raise

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Put the checkpoint in place: mode the data files, rename the metadata over the old, remove old data files.

        All under the folder's save lock (see the module docstring). The new data files get the old checkpoint's
        mode (or the umask's) before the metadata names them; the data files of earlier saves (and of saves that
        died) are removed only after the metadata's rename: all of them for the global metadata, else this rank's,
        except those of a save still in progress.

        Args:
            metadata: The checkpoint's metadata (as for DCP's ``finish``).
            results: Every rank's write results (as for DCP's ``finish``).

        Raises:
            TimeoutError: When another save into the folder holds its lock for longer than ``folder_lock.TIMEOUT_S``.
        """
        folder = Path(self.path)
        global_metadata = self.use_collectives or self.rank is None
        metadata_path = folder / (METADATA_NAME if global_metadata else f"__{self.rank}{METADATA_NAME}")
        names = {result.storage_data.relative_path for group in results for result in group}
        generations = {m["generation"] for name in names if (m := _DATA_FILE.fullmatch(name))}
        try:
            with folder_lock(folder):
                for name in names:  # the checkpoint's mode, before its files can be reached through the metadata
                    with contextlib.suppress(FileNotFoundError):  # another node's file, in a folder not shared
                        adopt_mode(folder / name, metadata_path)
                super().finish(metadata, results)  # writes the metadata, renames it into place (see OpFileSystem)
                self._remove_superseded(folder, names, global_metadata)
        finally:
            self._unmark(generations)  # the metadata names this save's files now (or the save failed)

    def __getstate__(self) -> dict[str, Any]:
        """The writer's state for pickling (DCP's process-based ``async_save`` sends the writer).

        Returns:
            The attributes, without the in-progress markers' finalizers: a marker belongs to the process that made it.
        """
        return {**self.__dict__, "_markers": {}}

    def _mark(self, generation: str) -> None:
        """Mark ``generation`` in the folder as a save in progress (an empty file naming this process).

        The mark goes when that save finishes or fails here, else with the writer (a save that failed on another
        rank: its files are kept until then).
        """
        marker = Path(self.path) / temporary_name(f"__{generation}", "partial")
        os.close(create_private(marker))
        self._markers[generation] = weakref.finalize(self, _remove, marker)

    def _unmark(self, generations: set[str]) -> None:
        for generation in generations:
            finalizer = self._markers.pop(generation, None)
            if finalizer is not None:
                finalizer()

    def _remove_superseded(self, folder: Path, names: set[str], global_metadata: bool) -> None:
        """Remove the data files in scope that the new metadata does not name, except a live save's.

        A file is a live save's when a marker of a process that may still run covers its generation; the markers of
        saves that died are removed first. Called under the folder's lock, just after the switch.
        """
        entries = list(os.scandir(folder))
        for target in {m["target"] for e in entries if (m := _MARKER.fullmatch(e.name))}:
            remove_dead_temporaries(folder, target)
        live = {m["target"] for e in os.scandir(folder) if (m := _MARKER.fullmatch(e.name))}
        for entry in entries:
            match = _DATA_FILE.fullmatch(entry.name)
            if (
                match
                and entry.name not in names
                and (global_metadata or int(match["rank"]) == self.rank)
                and f"__{match['generation']}" not in live
            ):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)


class FileSystemReader(_dcp_fs.FileSystemReader):
    """DCP's ``FileSystemReader`` (same arguments), reading through the async-IO op, only inside its folder.

    Items are read in file order (DCP's reader takes them in plan order), so each file is read front to back and
    the read-ahead never fetches what is then skipped. It reads checkpoints written by DCP's own writer too.

    Unlike DCP's reader it does not trust ``.metadata``: it is unpickled with an allow-list of the classes DCP's
    metadata is made of (a pickle payload cannot run), and every entry must name a byte range of a file inside the
    checkpoint's folder (no ``../``, no absolute path, no link out of it). A refusal, and any damage found while
    reading, is a ``CheckpointError`` naming the file and the entry; ``dcp.load`` reports it inside DCP's
    ``CheckpointException`` (its message holds ours; the reader keeps it as ``refusal``), ``deepoffload.dcp.load``
    raises it as it is.

    Args:
        path: The checkpoint's folder.
        *args: DCP's ``FileSystemReader`` arguments.
        config: The async-IO op's settings (default: ``AioConfig.from_env()``).
        trust_metadata: Unpickle ``.metadata`` with ``pickle`` as DCP's reader does (any class: only for files
            you trust, e.g. one whose metadata holds classes of your own); the entries are checked either way.
        **kwargs: DCP's ``FileSystemReader`` keyword arguments.

    Examples:
        >>> import torch, torch.distributed.checkpoint as dcp
        >>> from deepoffload.dcp import FileSystemReader
        >>> _ = dcp.save({"bias": torch.ones(2)}, storage_writer=dcp.FileSystemWriter("plain"))  # DCP's own writer
        >>> state = {"bias": torch.zeros(2)}
        >>> dcp.load(state, storage_reader=FileSystemReader("plain"))
        >>> state["bias"]
        tensor([1., 1.])
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *args: Any,
        config: AioConfig | None = None,
        trust_metadata: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(path, *args, **kwargs)
        self.fs = OpFileSystem(config)
        self.path = self.fs.init_path(path)
        self.trust_metadata = trust_metadata
        self.refusal: CheckpointError | None = None  # the last CheckpointError raised (DCP's loader rewraps it)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """Read ``.metadata`` (or ``__<rank>.metadata``) with the allow-list, and check every entry.

        Args:
            *args: As for DCP's ``read_metadata``.
            **kwargs: As for DCP's ``read_metadata`` (``rank``).

        Returns:
            The metadata, as DCP's reader returns it.

        Raises:
            CheckpointError: When the file cannot be unpickled with the allow-list, or an entry is malformed or
                reads outside the checkpoint's folder (naming the entry).
        """
        if self.refusal is not None:  # DCP falls back to a rank's own metadata: the refusal stands
            raise self.refusal
        path = os.fspath(self._get_metadata_path(kwargs.get("rank")))
        try:
            with self.fs.create_stream(path, "rb") as stream:
                metadata = read_metadata(stream, path, self.trust_metadata)
            check_metadata(metadata, os.fspath(self.path), path)
        except CheckpointError as e:
            self.refusal = e
            raise
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        cast(StorageMeta, metadata.storage_meta).load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read ``plan``'s items as DCP's reader does, sorted by file and offset.

        Args:
            plan: This rank's load plan.
            planner: The planner that receives the data.

        Returns:
            DCP's future, done once every item is read.

        Raises:
            CheckpointError: When the bytes an entry names are not what it says (damaged or crafted), naming the
                checkpoint and the error.
            OSError: When a read fails (as it is).
        """

        def position(item: ReadItem) -> tuple[str, int]:
            info = self.storage_data[item.storage_index]
            return info.relative_path, info.offset

        try:
            return super().read_data(dataclasses.replace(plan, items=sorted(plan.items, key=position)), planner)
        except OSError:
            raise
        except Exception as e:  # noqa: BLE001 - bytes that the metadata's entries do not describe
            self.refusal = CheckpointError(f"cannot load the DCP checkpoint {self.path}: {type(e).__name__}: {e}")
            raise self.refusal from e


def load(
    state_dict: dict[str, Any],
    path: str | os.PathLike,
    *,
    config: AioConfig | None = None,
    trust_metadata: bool = False,
    **kwargs: Any,
) -> None:
    """``dcp.load(state_dict, storage_reader=FileSystemReader(path))``, raising a refusal as a ``CheckpointError``.

    DCP's loader reports every reader error inside its own ``CheckpointException`` (a ``BaseException``) and turns
    a metadata error into an ``AssertionError`` message; this raises the reader's ``CheckpointError`` itself, an
    ``OSError`` of a read as it is, and any other failure (the planner's: a key or shape the checkpoint does not
    have) as a ``CheckpointError`` naming the checkpoint.

    Args:
        state_dict: The state to load into, in place (as for ``dcp.load``).
        path: The checkpoint's folder.
        config: The async-IO op's settings (default: ``AioConfig.from_env()``).
        trust_metadata: As for ``FileSystemReader``.
        **kwargs: Further ``dcp.load`` arguments (``planner``, ``process_group``, ``no_dist``).

    Raises:
        CheckpointError: When the reader refused the checkpoint (naming the file and the entry), or the load
            failed otherwise (naming the checkpoint and DCP's error).
        OSError: When a read failed (as it is).

    Examples:
        >>> import torch, torch.distributed.checkpoint as dcp
        >>> from deepoffload.dcp import FileSystemWriter, load
        >>> _ = dcp.save({"w": torch.ones(2)}, storage_writer=FileSystemWriter("ckpt"))
        >>> state = {"w": torch.zeros(2)}
        >>> load(state, "ckpt")
        >>> state["w"]
        tensor([1., 1.])
    """
    reader = FileSystemReader(path, config=config, trust_metadata=trust_metadata)
    try:
        _dcp_load(state_dict, storage_reader=reader, **kwargs)
    except CheckpointException as e:
        if reader.refusal is not None:
            raise reader.refusal from e
        failures = [failure for failure, _ in e.failures.values()]
        read_errors = [failure for failure in failures if isinstance(failure, OSError)]
        if read_errors:
            raise read_errors[0] from e
        first = failures[0] if failures else e
        raise CheckpointError(f"cannot load the DCP checkpoint {path}: {type(first).__name__}: {first}") from e
