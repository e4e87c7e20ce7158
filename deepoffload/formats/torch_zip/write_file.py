"""Writing a ``torch.save`` file through the op: privately under a temporary name, fsynced, renamed over the path.

``deepoffload.save``/``save_async`` (the layer above) and the ``torch`` checkpoint format write through
``write_file``.
"""

from __future__ import annotations

import os

import torch

from ...config import AioConfig
from ...errors import naming_target
from ...io import retire
from ...io.owners import PRIVATE_MODE, adopt_mode, remove_dead_temporaries, temporary_name
from .streams import DirectWriter
from .torch_format import Record, remove_quietly, write_records


def write_file(records: list[Record], path: str, checksum: bool, sync: bool, config: AioConfig | None) -> str:
    """Write ``records`` as a ``torch.save`` file at ``path``: privately under a temporary name, then renamed over it.

    A failure leaves a previous file under ``path`` as it was and no temporary behind.

    Args:
        records: What ``record`` made of the object saved.
        path: The file (a symbolic link is written through, as ``torch.save`` does).
        checksum: Store each record's CRC-32.
        sync: Fsync the file and its folder.
        config: The async-IO settings (default: ``AioConfig.from_env()``).

    Returns:
        ``path``.

    Raises:
        OSError: Naming ``path``, when the file cannot be written, synced or renamed.
    """  # noqa: DOC501, DOC502 -- ruff takes naming_target(...) for an exception class; it returns the OSError
    target = os.path.realpath(path) if os.path.islink(path) else path  # like torch.save: write through a link
    folder = os.path.dirname(os.path.abspath(target))
    remove_dead_temporaries(folder, os.path.basename(target))
    temporary = os.path.join(folder, temporary_name(os.path.basename(target)))
    try:  # private while written; given the checkpoint's mode (or the umask's) just before the rename
        sink = DirectWriter(temporary, config=config, sync=sync, size_hint=size_bound(records), mode=PRIVATE_MODE)
    except OSError as e:
        raise naming_target(e, path) from e
    try:
        try:
            write_records(records, sink, checksum)
        except BaseException:
            sink.abort()
            raise
        sink.close()  # raises the first write error
        adopt_mode(temporary, target)
        retire.replace(temporary, target)  # the old file's blocks are freed in the background
    except BaseException as e:
        remove_quietly(temporary)
        if isinstance(e, OSError):
            raise naming_target(e, path) from e
        raise
    if sync:
        fsync_folder(folder, path)
    return path


def size_bound(records: list[Record]) -> int:
    """Return an upper bound of the file's bytes for ``records``.

    Args:
        records: The records the file will hold.

    Returns:
        The records' bytes, plus per record its local header, data descriptor and central directory entry (together
        under 512 bytes plus twice the name) and alignment padding, plus the serialization id record and the end
        records.
    """
    names = sum(len(name.encode()) for name, _, _ in records)
    per_record = 512 + torch.serialization._get_storage_alignment()
    return sum(nbytes for _, _, nbytes in records) + per_record * (len(records) + 2) + 2 * names + 4096


def fsync_folder(folder: str, path: str) -> None:
    """Fsync ``folder`` so the rename of ``path`` in it is durable (a no-op where folders cannot be opened).

    Args:
        folder: The folder.
        path: The file renamed in it (named in the error).

    Raises:
        OSError: When the fsync fails.
    """
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return  # no directory descriptors here (Windows): the rename is as durable as this system makes it
    try:
        os.fsync(fd)
    except OSError as e:
        raise OSError(e.errno, f"cannot save {path}: fsync of its folder failed ({e.strerror})", path) from e
    finally:
        os.close(fd)
