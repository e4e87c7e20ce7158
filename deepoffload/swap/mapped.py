"""``MappedFiles``: a swapper's groups served read-only from tensors that already lie in another file (a checkpoint).

Such a group's records point into that file; it is read from the page holding its first byte to its last byte with
one request. The file's identity (device, inode, size, modification time) is recorded when it is mapped and checked
before every read, so a checkpoint replaced or rewritten since raises ``ChecksumError`` instead of serving other
values. A mapped group is never written, and forgetting it leaves its file alone.
"""

from __future__ import annotations

import errno
from typing import Mapping

from ..errors import ChecksumError
from .records import SwapRecord, file_identity


class MappedFiles:
    """The mapped groups of one swapper, each with the identity of its file when it was mapped."""

    def __init__(self) -> None:
        self._identities: dict[str, tuple] = {}  # group -> the file's identity
        self._encoded: set[str] = set()  # groups mapped to a codec's file (read and decoded as swap records)

    def raw(self, group: str) -> bool:
        """True when ``group`` is mapped to tensors as they lie (read from the page holding its first byte)."""
        return group in self._identities and group not in self._encoded

    def __contains__(self, group: object) -> bool:
        return group in self._identities

    def add(self, group: str, records: dict[str, SwapRecord], encoded: bool = False) -> None:
        """Map ``group`` to ``records`` (checked here), recording its file's identity.

        Args:
            group: The group's name.
            records: Where its tensors lie.
            encoded: The records are a codec's own file (a compressed copy): read as swap records are, decoded.

        Raises:
            ValueError: When the records are not back to back in one file at offsets that are multiples of their
                element sizes (or carry checksums or DTensor shards).
        """
        files = {r.file for r in records.values()}
        if encoded:
            if len(files) != 1:
                raise ValueError(f"group {group!r}: an encoded mapped group lies in one file, not {sorted(files)}")
            self._encoded.add(group)
            self._identities[group] = file_identity(next(iter(files)))
            return
        base = min((r.offset for r in records.values()), default=0)
        end = max((r.offset + r.nbytes for r in records.values()), default=0)
        if (
            len(files) != 1
            or end - base != sum(r.nbytes for r in records.values())
            or any(
                r.offset % r.dtype.itemsize or r.checksum is not None or r.dtensor is not None for r in records.values()
            )
        ):
            raise ValueError(
                f"group {group!r}: map_group needs tensors back to back in one file, each at an offset "
                f"that is a multiple of its element size, without checksums or DTensor shards"
            )
        self._identities[group] = file_identity(next(iter(files))) if files else ()

    def check(self, group: str, records: Mapping[str, SwapRecord]) -> None:
        """Refuse to read ``group`` when its file is no longer the one mapped.

        Args:
            group: A mapped group.
            records: Its records (at least one).

        Raises:
            ChecksumError: When the file was replaced, rewritten or removed since it was mapped.
        """
        file = next(iter(records.values())).file
        try:
            same = file_identity(file) == self._identities[group]
        except FileNotFoundError:
            same = False
        if not same:
            raise ChecksumError(
                errno.EIO,
                f"group {group!r} is served from {file}, which was replaced, rewritten or "
                f"removed since it was mapped: its values may differ from those checked "
                f"then; map it (offload_parameters) again",
                file,
            )

    def refuse_write(self, group: str, records: Mapping[str, SwapRecord]) -> None:
        """Refuse a write of ``group`` when it is mapped.

        Args:
            group: The group's name.
            records: Its records.

        Raises:
            PermissionError: When ``group`` is mapped (its file is someone else's).
        """
        if group in self._identities:
            file = next(iter(records.values())).file
            raise PermissionError(
                errno.EACCES,
                f"group {group!r} is served read-only from {file} (map_group): it cannot be written",
                file,
            )

    def forget(self, group: str) -> bool:
        """Forget ``group`` (its file is left alone).

        Args:
            group: The group's name.

        Returns:
            Whether it was mapped.
        """
        self._encoded.discard(group)
        return self._identities.pop(group, None) is not None
