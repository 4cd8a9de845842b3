"""Checkpoint files read back as data, never code, and never bigger than they look.

Every file evendp reads back may have been replaced by someone else (a copied checkpoint, a
shared folder), so each is read distrusting it first: ``torch.save`` zips
(:func:`check_archive`; the legacy format allocates the sizes it reads), DCP's ``.metadata``
pickle (:func:`read_dcp_metadata`) and its items (:func:`safe_dcp`). :class:`Refused` carries
``"FIELD: why"``, which :mod:`evendp._training._checkpoint` turns into one line naming the file.
"""

from __future__ import annotations

import functools
import io
import math
import numbers
import pickle
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

import torch

from .._core._files import NotReadable, open_regular
from .._core._validate import shown

__all__ = [
    "Refused",
    "check_archive",
    "check_kind",
    "read_dcp_metadata",
    "safe_dcp",
]

_MAX_ENTRIES = 100_000  # a torch.save archive holds one entry per storage, plus a few
_MAX_METADATA = 256 << 20  # .metadata lists every item: far below this for any real model
_MAX_PICKLE = 256 << 20  # a torch.save pickle holds the structure; the tensors are entries


class Refused(ValueError):
    """A file or field evendp will not load; the message is ``"WHAT: why"``."""


def check_archive(source: str | Path | IO[bytes], limit: int | None = None) -> None:
    """``source`` is a ``torch.save`` zip whose entries are stored (not compressed), unpack to
    no more than the archive's own size and, with ``limit``, to at most ``limit`` bytes.

    >>> bomb = io.BytesIO()
    >>> with zipfile.ZipFile(bomb, "w", zipfile.ZIP_DEFLATED) as z:
    ...     z.writestr("a/data/0", bytes(10_000_000))
    >>> check_archive(bomb)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    evendp._training._safe_read.Refused: archive: entry 'a/data/0' is compressed ...
    """
    try:
        with zipfile.ZipFile(source) as archive:
            entries = archive.infolist()
    except PermissionError:  # the OS's refusal: said as such by the caller
        raise
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as exc:
        raise Refused(f"archive: not a torch.save zip archive ({exc})") from None
    if isinstance(source, str | Path):
        size = Path(source).stat().st_size
    else:
        size = source.seek(0, io.SEEK_END)
        source.seek(0)
    if len(entries) > _MAX_ENTRIES:
        raise Refused(f"archive: {len(entries)} entries, more than {_MAX_ENTRIES}")
    total = 0
    for entry in entries:
        if entry.filename.endswith("data.pkl") and entry.file_size > _MAX_PICKLE:
            raise Refused(
                f"archive: its pickle {shown(entry.filename)} is {entry.file_size} bytes, more "
                f"than {_MAX_PICKLE}"
            )
        if entry.compress_type != zipfile.ZIP_STORED:
            raise Refused(
                f"archive: entry {shown(entry.filename)} is compressed "
                f"({entry.compress_size} bytes unpack to {entry.file_size}); torch.save never "
                "compresses"
            )
        total += entry.file_size
    if total > size or (limit is not None and total > limit):
        bound = size if limit is None else min(size, limit)
        raise Refused(f"archive: its entries unpack to {total} bytes, more than {bound}")


class _Slice(io.RawIOBase):
    """Bytes ``[offset, offset + length)`` of an open file, as a seekable file of their own."""

    def __init__(self, file: IO[bytes], offset: int, length: int):
        super().__init__()
        self._file, self._start, self._length, self._pos = file, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = max(0, min(self._length, base + pos))
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, buffer: Any) -> int:
        want = min(len(buffer), self._length - self._pos)
        self._file.seek(self._start + self._pos)
        data = self._file.read(want)
        buffer[: len(data)] = data
        self._pos += len(data)
        return len(data)


# The classes a DCP .metadata pickle is made of (torch 2.13), and nothing else.
_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a layout by its name ("torch.strided")
    ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id
    ("pathlib", "WindowsPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_CLASSES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise Refused(f".metadata: it names {shown(f'{module}.{name}')}, not DCP metadata")


def read_dcp_metadata(path: str | Path) -> Any:
    """DCP's ``.metadata`` at ``path``, unpickled with only DCP's own classes admitted."""
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        opened = open_regular(path, _MAX_METADATA, mine=True)
    except NotReadable as exc:
        raise Refused(f".metadata: {exc}") from None
    with opened as f:
        try:
            metadata = _MetadataUnpickler(f).load()
        except Refused:
            raise
        except Exception as exc:  # truncated or garbled: a pickle error of some kind
            raise Refused(f".metadata: unreadable ({type(exc).__name__}: {exc})") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise Refused(f".metadata: holds a {type(metadata).__name__}, not DCP metadata")
    for info in metadata.storage_data.values():
        where = str(getattr(info, "relative_path", ""))
        if not where or "/" in where or "\\" in where or where in (".", ".."):
            raise Refused(f".metadata: names the item file {shown(where)}, outside its folder")
    return metadata


@functools.cache
def safe_dcp() -> tuple[type, type]:
    """``(SafeReader, SafeLoadPlanner)``: DCP's file reader and default load planner, made safe
    (built on first use: DCP is imported only by FSDP2 runs)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class SafeReader(FileSystemReader):
        """:func:`read_dcp_metadata`, and each item's archive checked before it is read."""

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            from torch.distributed.checkpoint.metadata import StorageMeta

            if kwargs.get("rank") is not None:  # per-rank metadata: not what evendp writes
                raise Refused(".metadata: per-rank metadata files are not read")
            metadata = read_dcp_metadata(Path(self.path) / ".metadata")
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

        def read_data(self, plan: Any, planner: Any) -> Any:
            for item in plan.items:
                info = self.storage_data[item.storage_index]
                try:
                    with open_regular(Path(self.path) / info.relative_path, mine=True) as f:
                        check_archive(_Slice(f, info.offset, info.length))  # type: ignore[arg-type]
                except (Refused, NotReadable) as exc:
                    raise Refused(f"{item.storage_index.fqn}: {exc}") from None
            return super().read_data(plan, planner)

    class SafeLoadPlanner(DefaultLoadPlanner):
        """Byte items load with ``weights_only=True``, of the kind of the value they replace."""

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            fqn = read_item.dest_index.fqn
            try:
                loaded = torch.load(value, weights_only=True)
            except Exception as exc:  # a pickle of anything but plain values
                raise Refused(f"{fqn}: not plain data ({type(exc).__name__})") from None
            current = self.state_dict.get(fqn) if self.flatten_state_dict else None
            check_kind(fqn, current, loaded)
            buffer = io.BytesIO()  # DCP's loader reads what loaded as data, never the file
            torch.save(loaded, buffer)
            buffer.seek(0)
            super().load_bytes(read_item, buffer)

    return SafeReader, SafeLoadPlanner


def _number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_kind(field: str, current: Any, loaded: Any) -> None:
    """``loaded`` may replace ``current``: the same kind (a finite number for a number, a flag
    for a flag, text for text, as long a tuple or list of the same kinds, a tensor of the same
    shape). ``current=None`` takes ``None`` or a plain value.

    >>> check_kind("lr", 0.1, 0.01)
    >>> check_kind("lr", 0.1, "fast")
    Traceback (most recent call last):
    ...
    evendp._training._safe_read.Refused: lr: must be a finite number like 0.1, got 'fast'
    """
    if isinstance(current, torch.Tensor) and current.numel() > 1:
        ok = isinstance(loaded, torch.Tensor) and loaded.shape == current.shape
        if not ok:
            got = tuple(loaded.shape) if isinstance(loaded, torch.Tensor) else shown(loaded)
            raise Refused(f"{field}: must be a tensor of shape {tuple(current.shape)}, got {got}")
        return
    if isinstance(current, torch.Tensor):  # a scalar state (Adam's step): a number or scalar
        if isinstance(loaded, torch.Tensor) and loaded.numel() == 1:
            loaded = loaded.item()
        current = current.item()
    if isinstance(current, bool) or (current is None and isinstance(loaded, bool)):
        if not isinstance(loaded, bool | None):
            raise Refused(f"{field}: must be True or False, got {shown(loaded)}")
    elif _number(current) or (current is None and _number(loaded)):
        if not (_number(loaded) and math.isfinite(loaded)):
            raise Refused(f"{field}: must be a finite number like {current!r}, got {shown(loaded)}")
    elif isinstance(current, str):
        if not isinstance(loaded, str) or len(loaded) > 1000:
            raise Refused(f"{field}: must be text like {current!r}, got {shown(loaded)}")
    elif isinstance(current, list | tuple):
        if not isinstance(loaded, list | tuple) or len(loaded) != len(current):
            raise Refused(f"{field}: must be {len(current)} values, got {shown(loaded)}")
        for i, (a, b) in enumerate(zip(current, loaded, strict=True)):
            check_kind(f"{field}.{i}", a, b)
    elif isinstance(current, Mapping):
        if not isinstance(loaded, Mapping):
            raise Refused(f"{field}: must be a mapping, got {shown(loaded)}")
        for key in current.keys() & loaded.keys():
            check_kind(f"{field}.{key}", current[key], loaded[key])
    elif current is None and loaded is not None and not isinstance(loaded, str | list | tuple):
        raise Refused(f"{field}: must be None or a plain value, got {shown(loaded)}")
