"""Reading a shard's rows for publishing with bounded memory.

:func:`deltarec.artifacts.iter_shard` reads with pyarrow's defaults, which load a whole column
chunk (a row group) at a time and hold well over 100 MB for a large shard. Here the file is
streamed through a 1 MB read buffer in small record batches (8192 rows, no threads, no
pre-buffering), and the batches are joined into publish batches of ``batch_rows``: memory is
about two publish batches whatever the shard or row-group size. The checks are the same:
sha256 and size before reading, row count at the end.
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from deltarec.artifacts import ArtifactRoot, ShardRows, check_shard
from deltarec.artifacts.types import DType, ShardInfo
from deltarec.errors import ArtifactError, ChecksumError

READ_BUFFER = 1 << 20
READ_ROWS = 8192


def iter_shard_rows(
    root: ArtifactRoot,
    dump_dir: str,
    shard: ShardInfo,
    dtype: DType,
    batch_rows: int,
    verify: bool = True,
) -> Iterator[ShardRows]:
    """Yield a shard's rows in batches of ``batch_rows`` (the last may be shorter).

    Raises:
        ChecksumError: sha256/size (with ``verify``) or row count differ from the manifest.
        ArtifactError: the shard is missing or not readable parquet.
    """
    path = posixpath.join(dump_dir, shard.path)
    if verify:
        check_shard(root, dump_dir, shard)
    seen = 0
    try:
        with root.fs.open(path, "rb") as f:
            pf = pq.ParquetFile(f, buffer_size=READ_BUFFER, pre_buffer=False)
            parts: list[ShardRows] = []
            held = 0
            for batch in pf.iter_batches(batch_size=min(READ_ROWS, batch_rows), use_threads=False):
                part = ShardRows.from_arrow(batch, dtype)
                seen += len(part)
                parts.append(part)
                held += len(part)
                if held >= batch_rows:
                    yield ShardRows.concat(parts)
                    parts, held = [], 0
            if parts:
                yield ShardRows.concat(parts)
    except FileNotFoundError:
        raise ArtifactError(root.url(path), "shard listed in the manifest is missing") from None
    except (pa.ArrowInvalid, OSError) as e:
        raise ArtifactError(root.url(path), f"unreadable parquet: {e}") from e
    if seen != shard.rows:
        raise ChecksumError(root.url(path), f"holds {seen} rows, the manifest says {shard.rows}")
