"""fsspec URLs to pyarrow filesystems: local paths use Arrow's native filesystem, the rest fsspec."""

from __future__ import annotations

import fsspec
import pyarrow.fs as pafs
from fsspec.implementations.local import LocalFileSystem


def url_to_fs(url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """The fsspec filesystem of a URL (a plain path is a local file) and the path inside it."""
    return fsspec.core.url_to_fs(url)


def arrow_filesystem(fs: fsspec.AbstractFileSystem) -> pafs.FileSystem:
    if isinstance(fs, LocalFileSystem):
        return pafs.LocalFileSystem()
    return pafs.PyFileSystem(pafs.FSSpecHandler(fs))


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    return isinstance(fs, LocalFileSystem)


def join(url: str, *parts: str) -> str:
    return "/".join([url.rstrip("/"), *parts])
