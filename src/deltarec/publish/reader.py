"""Reading a shard's rows for publishing with bounded memory: one row group at a time.

:func:`deltarec.artifacts.iter_shard` streams with ``ParquetFile.iter_batches``, whose read-ahead
holds well over 100 MB for a large shard; reading whole row groups (``read_row_group``, no
threads, a 1 MB read buffer) keeps the publisher's memory bounded by the largest row group
(one ``ShardWriter.write`` call) plus the batch being written. The checks are the same: sha256
and size before reading, row count at the end.
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from deltarec.artifacts import ArtifactRoot, ShardRows, check_shard
from deltarec.artifacts.types import DType, ShardInfo
from deltarec.errors import ArtifactError, ChecksumError

_READ_BUFFER = 1 << 20


def iter_shard_rows(
    root: ArtifactRoot,
    dump_dir: str,
    shard: ShardInfo,
    dtype: DType,
    batch_rows: int,
    verify: bool = True,
) -> Iterator[ShardRows]:
    """Yield a shard's rows in batches of at most ``batch_rows``, one row group at a time.

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
            pf = pq.ParquetFile(f, buffer_size=_READ_BUFFER)
            for i in range(pf.num_row_groups):
                group = ShardRows.from_arrow(pf.read_row_group(i, use_threads=False), dtype)
                seen += len(group)
                for start in range(0, len(group), batch_rows):
                    stop = start + batch_rows
                    yield ShardRows(
                        group.keys[start:stop],
                        group.embedding[start:stop],
                        group.ops[start:stop],
                        group.steps[start:stop],
                    )
                del group
    except FileNotFoundError:
        raise ArtifactError(root.url(path), "shard listed in the manifest is missing") from None
    except (pa.ArrowInvalid, OSError) as e:
        raise ArtifactError(root.url(path), f"unreadable parquet: {e}") from e
    if seen != shard.rows:
        raise ChecksumError(root.url(path), f"holds {seen} rows, the manifest says {shard.rows}")
