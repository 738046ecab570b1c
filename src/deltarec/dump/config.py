"""The dumper's configuration (pydantic; unknown keys are rejected)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from deltarec.artifacts.types import DType
from deltarec.dump.budget import default_encode_workers, default_host_budget
from deltarec.errors import ConfigError, InvalidIdentifierError
from deltarec.ids import validate_run, validate_table_id


class DumperConfig(BaseModel):
    """How and when the dumper writes generation artifacts (SPEC §3, §4).

    With neither ``every_steps`` nor ``every_minutes`` only the snapshot (if enabled), a
    restore's republish dump and the final dump are written.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    artifacts: str = Field(min_length=1)
    """Artifact root: a local path or any fsspec URI (``s3://bucket/prefix``, ...)."""
    run: str
    """Run name (``[A-Za-z0-9_.-]``): one model's training lineage."""
    every_steps: int | None = Field(default=None, ge=1)
    """Dump after every this many training steps (counted from the generation's start)."""
    every_minutes: float | None = Field(default=None, gt=0)
    """Dump when this many minutes have passed since the previous dump (see docs/dump.md for
    how ranks agree on the step without a per-step collective)."""
    snapshot: bool = True
    """Write dump 0 with every row when a generation starts without a parent, if the tables
    fit ``snapshot_max_bytes`` (else no snapshot is written, and a warning says so)."""
    snapshot_max_bytes: int | None = Field(default=None, ge=0)
    """The largest snapshot written: a rank's share of the tables' rows in bytes (rows x dim x
    4 summed over the tables, over the world size), checked against every rank's limit; if it
    exceeds any, no rank writes dump 0. None:
    this rank's host budget (:meth:`host_budget_bytes`), so a snapshot never makes the
    training thread wait for the writer (it would otherwise stall ``on_start`` for as long as
    writing every row takes: 36 GB at about 2 GB/s). 0: no limit."""
    default_dtype: DType = DType.FLOAT32
    """Encoding of tables not named in ``table_dtypes``."""
    table_dtypes: dict[str, DType] = Field(default_factory=dict)
    """Per-table encoding (``float32`` | ``float16`` | ``int8_rowwise``), by table id."""
    chunk_rows: int = Field(default=65536, ge=1)
    """Rows per gathered chunk (written as row groups of at most 2M values,
    :func:`~deltarec.artifacts.codec.row_group_rows`)."""
    queue_bytes: int | None = Field(default=None, ge=1 << 16)
    """Host staging budget: bytes of host memory the dump path may hold. It is shared out
    (:func:`~deltarec.dump.budget.plan_host_budget`) between the encoders' reusable piece
    buffers (1/8, at most 128 MiB), in a publishing trainer the rows handed to its background
    publisher from memory (1/8), the scratch of the encodings running at once (at most
    1/4: fewer encoding threads run if it affords fewer,
    :func:`~deltarec.dump.encode.encode_scratch_bytes`) and the rest, for gathered rows and
    their encoded copies (queued, copied from a device staging buffer, being encoded or
    written). None: sized from the available memory
    (:func:`~deltarec.dump.budget.default_host_budget`). When it is full the training thread
    waits (rows gathered into host memory) or the worker does (rows staged on the device):
    nothing is dropped."""
    device_staging_share: float = Field(default=0.25, ge=0.0, lt=1.0)
    """CUDA tables: share of the device's free memory (measured at the first dump) that device
    staging buffers may hold. A dump's touched rows are gathered into such a buffer and the
    training thread goes on at once; a table that does not fit is logged, counted, and
    gathered into host memory under the host budget instead. 0 disables device staging."""
    device_graph_bytes: int | None = Field(default=None, ge=0)
    """CUDA tables: device bytes of each of the two buffer sets that let a dump deduplicate
    and gather a device's tables in one CUDA graph replay, captured at start (docs/dump.md,
    *Graphed dumps*). A dump whose tables recorded more ids than a set holds takes the exact
    path. None: 256 MiB, at most 1/256 of the device's memory; 0: no graphed dumps."""
    spread_steps: int | None = Field(default=None, ge=1)
    """Tables grouped by device (CUDA tables; every plain table on one device where set): read a
    dump's touched rows over this many training steps after the dump step instead of at it,
    copy on write (a lookup in those steps reads its rows first), and commit the dump once
    all are read (docs/dump.md, *Spread dumps*). The dump step then only hands the bitmap of
    touched rows over. Needs lookups recorded before the step's update (torchrec's tracker,
    deltarec's recorders, or ``ManualTracker.record`` before the backward). None: every row is
    read at the dump step."""
    encode_workers: int | None = Field(default=None, ge=1)
    """Threads that encode and checksum chunks in parallel. None: the cores the training
    processes leave free (:func:`~deltarec.dump.budget.default_encode_workers`)."""
    encoder: Literal["auto", "thread", "process"] = "auto"
    """Where chunks are encoded and shards written. ``process``: in a child process of the
    training process, fed through a shared (on CUDA also pinned) memory ring, so that the
    encoding's Python work never holds the training process's GIL; ``thread``: on threads of
    the training process. ``auto``: ``process`` where CUDA is available (the tables are taken
    to be on the GPU), ``thread`` otherwise (on few CPU cores the child costs more than it
    saves)."""
    fsync: bool = True
    """fsync shards and manifests on local disks before renaming them into place."""
    storage_options: dict[str, Any] = Field(default_factory=dict)
    """fsspec storage options for the artifact root (credentials come from the environment
    by default)."""
    commit_timeout_s: float = Field(default=1800.0, gt=0)
    """How long a rank waits for the other ranks at a dump's commit before failing."""
    lease_ttl_s: float = Field(default=60.0, gt=0)
    """The run's lease expires this many seconds after its holder's last renewal (renewed
    every quarter of it); a second trainer of the run refuses to start while it is held."""
    time_sync_max_steps: int = Field(default=1000, ge=1)
    """With ``every_minutes``: at most this many steps between two clock agreements."""
    read_p99_ms: float | None = Field(default=None, gt=0)
    """A read-latency budget for the background publisher (with a store): the p99 of serving
    reads, in milliseconds, that publishing holds itself within by smaller transactions and
    pauses (:mod:`deltarec.publish.budget`, docs/publish.md). None: publish as fast as the
    store takes it."""
    compact_every_dumps: int | None = Field(default=None, ge=1)
    """Rank 0 compacts the generation in a background child process after every this many
    committed dumps (:mod:`deltarec.dump.compactor`, docs/history.md); readers then start from
    the base and ``deltarec gc`` may delete the dumps it covers. None (the default): never,
    compaction is left to the pipeline's step or ``deltarec compact``. On a GPU host with idle
    cores the steps during a compaction kept their mean and p99 (H100, 20 ms steps); on a
    2-core CPU host, with the child at idle priority and paced at the default
    ``compact_busy_share``, a compaction running all the time left the mean step time within
    1.03x. Its duration and the replay's index in memory grow with every rank's tables, and each
    base is a full copy of them until ``gc``, so it stays off unless a job asks (docs/history.md
    says how to choose N)."""
    compact_busy_share: float = Field(default=0.25, gt=0, le=1)
    """With ``compact_every_dumps``: the most of its time the background compaction spends
    working (its CPU time against the pauses it takes). Between bounded chunks of its work (a
    part or shard read, a table's records resolved, a row group gathered and encoded, 16 MB
    hashed) it sleeps to stay under it (:mod:`deltarec.artifacts.pacing`). What idle priority
    leaves to the training loop is the memory traffic the compaction makes; pacing spreads it
    over a compaction about ``1 / compact_busy_share`` times as long, which bounds what a
    compaction that runs all the time costs. 0.25 (the default) kept the mean step time of a
    2-core CPU loop within 1.03x where 1 (never pause) cost 1.10x (docs/history.md). A base
    written paced is byte for byte the one written unpaced."""
    zch_misses: bool = False
    """ZCH tables: also dump the raw ids that training looked up but the table did not hold
    (never admitted, or not admitted yet), each as ``op = 1`` with the fallback row the model
    answers them with, as TorchEasyRec publishes them. For PAI FeatureStore with
    ``contract=tzrec``, where serving must find a row for every id the model answers; the
    training hook turns it on when it publishes to such a store. Off by default: these ids can
    be many, and a store that deletes keeps a tombstone for each."""

    @field_validator("run")
    @classmethod
    def _run_is_safe(cls, value: str) -> str:
        try:
            return validate_run(value)
        except InvalidIdentifierError as e:
            raise ValueError(str(e)) from e

    @field_validator("table_dtypes")
    @classmethod
    def _tables_are_safe(cls, value: dict[str, DType]) -> dict[str, DType]:
        for table in value:
            try:
                validate_table_id(table)
            except InvalidIdentifierError as e:
                raise ValueError(str(e)) from e
        return value

    @model_validator(mode="after")
    def _chunk_fits_queue(self) -> DumperConfig:
        # A chunk of a 1-dim float32 table must fit, else every put would wait for an empty
        # queue and the writer could never overlap with the gather.
        if self.queue_bytes is not None and self.chunk_rows * 13 > self.queue_bytes:
            raise ValueError(
                f"queue_bytes {self.queue_bytes} cannot hold one chunk of {self.chunk_rows} "
                "rows (13 bytes per row at least); lower chunk_rows or raise queue_bytes"
            )
        return self

    def host_budget_bytes(self) -> int:
        """The host staging budget in bytes (``queue_bytes``, or sized from memory now)."""
        return self.queue_bytes if self.queue_bytes is not None else default_host_budget()

    def encode_threads(self) -> int:
        """The number of encoding threads (``encode_workers``, or the cores left free)."""
        return self.encode_workers or default_encode_workers()

    def dtype_of(self, table: str) -> DType:
        """The encoding of ``table``."""
        return self.table_dtypes.get(table, self.default_dtype)


def parse_row_encodings(spec: str) -> tuple[DType | None, dict[str, DType]]:
    """Parse row encodings: ``"float16,sparse.ebc.user_id=int8_rowwise"``.

    An entry without ``=`` is the default encoding of every table not named; ``table=dtype``
    sets one table's. Encodings are ``float32``, ``float16`` and ``int8_rowwise``.

    Returns:
        ``(default or None, {table id: encoding})``.

    Raises:
        ConfigError: an unknown encoding, a bad table id, two defaults or a table given twice
            (names the entry).
    """
    default: DType | None = None
    tables: dict[str, DType] = {}
    known = [d.value for d in DType]
    for entry in (e.strip() for e in spec.split(",")):
        if not entry:
            continue
        table, _, name = entry.rpartition("=")
        try:
            dtype = DType(name.strip())
        except ValueError:
            raise ConfigError(
                f"row encoding {entry!r}: unknown encoding {name.strip()!r}; known: {known}"
            ) from None
        if not table:
            if default is not None:
                raise ConfigError(f"row encodings {spec!r} give two defaults")
            default = dtype
            continue
        try:
            validate_table_id(table.strip())
        except InvalidIdentifierError as e:
            raise ConfigError(f"row encoding {entry!r}: {e}") from e
        if table.strip() in tables:
            raise ConfigError(f"row encodings {spec!r} name table {table.strip()!r} twice")
        tables[table.strip()] = dtype
    return default, tables


def check_row_encoding(table: str, dim: int, dtype: DType) -> None:
    """Refuse an encoding a table's rows cannot take (int8_rowwise needs an even dim).

    Serving reads int8_rowwise rows as fbgemm's QUint8RowwiseF16 layout (``dim`` uint8 codes,
    fp16 scale, fp16 offset), whose kernels take even dims only.

    Raises:
        ConfigError: names the table, its dim and the encodings it can use.
    """
    if DType(dtype) is DType.INT8_ROWWISE and dim % 2:
        raise ConfigError(
            f"table {table!r} has dim {dim}: int8_rowwise needs an even dim; use float32 or "
            "float16 for this table (e.g. --row-encodings int8_rowwise,"
            f"{table}=float16)"
        )
