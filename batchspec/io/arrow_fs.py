"""fsspec filesystems as pyarrow reads them: ranged reads, no read-ahead."""

from __future__ import annotations

import pyarrow as pa
from pyarrow.fs import FSSpecHandler, PyFileSystem


class RangeReads(FSSpecHandler):
    """fsspec files for pyarrow without read-ahead: pyarrow already coalesces the byte ranges
    of the projected column chunks, and s3fs's default 50 MiB read-ahead would fetch the
    unread columns (``generated_text``) along with them."""

    def open_input_file(self, path: str):
        if not self.fs.isfile(path):
            raise FileNotFoundError(path)
        return pa.PythonFile(self.fs.open(path, mode="rb", cache_type="none"), mode="r")


def arrow_fs(fs) -> PyFileSystem:
    """``fs`` for pyarrow, read through :class:`RangeReads`."""
    return PyFileSystem(RangeReads(fs))
