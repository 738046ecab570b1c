"""Store configs (pydantic, unknown fields rejected) and the store URL syntax (SPEC §5).

==========================================================  ==============
URL                                                         config
==========================================================  ==============
``sqlite:///path/to/store.db`` (``sqlite:///:memory:``)      SqliteConfig
``postgresql://user@host:port/db?layout=float4[]``          PostgresConfig
``redis://host:port/0?prefix=emb:``                         RedisConfig
``featurestore://project/view?region=cn-hangzhou``          FeatureStoreConfig
==========================================================  ==============

Query parameters set config fields; an unknown one is a :class:`~deltarec.errors.ConfigError`
naming it and the fields the backend knows. Passwords are never part of a config's text form:
PostgreSQL reads ``PGPASSWORD`` (libpq), Redis ``REDIS_PASSWORD``, FeatureStore the Alibaba
Cloud credential chain and ``FEATUREDB_USERNAME``/``FEATUREDB_PASSWORD``.
"""

from __future__ import annotations

import os
import urllib.parse
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator

from deltarec.credentials import credential_problems, is_secret_option, redact_url
from deltarec.errors import ConfigError, InvalidIdentifierError, validation_problems
from deltarec.stores.naming import check_identifier, check_kv_prefix, check_prefix


def _as_value_error(check: Any, *args: Any) -> Any:
    """Run a naming check; pydantic reports ValueErrors as field errors."""
    try:
        return check(*args)
    except InvalidIdentifierError as e:
        raise ValueError(str(e)) from e


class _Config(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SqliteConfig(_Config):
    """The embedded default: one SQLite file."""

    type: Literal["sqlite"] = "sqlite"
    path: str
    """Database file (created if missing); ``:memory:`` for a private in-memory store."""
    prefix: str = "emb_"
    """View name prefix."""
    timeout_s: float = Field(30.0, gt=0)
    """How long a writer waits for another writer's lock before failing."""
    synchronous: Literal["OFF", "NORMAL", "FULL"] = "NORMAL"
    """SQLite ``PRAGMA synchronous`` (WAL mode: NORMAL is durable across process crashes)."""
    cache_mb: int = Field(16, gt=0)
    """Page cache per connection (MB). Writes reach the B-tree in key order, so a small cache
    is enough."""
    checkpoint_pages: int = Field(65536, gt=0)
    """WAL pages before an automatic checkpoint (64k pages = 256 MB of WAL at most): rarer
    checkpoints merge more writes to the same page (about 1.7x faster bulk publishing)."""

    @field_validator("prefix")
    @classmethod
    def _prefix(cls, v: str) -> str:
        return _as_value_error(check_prefix, v)


class PostgresConfig(_Config):
    """PostgreSQL and wire-compatible stores (Hologres)."""

    type: Literal["postgres"] = "postgres"
    host: str = "localhost"
    """Server host (or a socket directory)."""
    port: int = Field(5432, gt=0, lt=65536)
    """Server port."""
    user: str | None = None
    """Role name; None lets libpq choose (``PGUSER``)."""
    dbname: str = "postgres"
    """Database name."""
    password: str | None = Field(None, repr=False, exclude=True)
    """Only from the URL if given there; prefer ``PGPASSWORD``. Never printed."""
    schema_name: str = Field("public", alias="schema")
    """Schema holding the views and the registry."""
    prefix: str = "emb_"
    """View name prefix."""
    layout: Literal["bytea", "float4[]"] = "bytea"
    """``bytea``: packed little-endian rows; ``float4[]``: arrays (float32/float16 tables)."""
    connect_timeout: int = Field(10, gt=0)
    """Seconds before a connection attempt fails (and is retried by the publisher)."""
    sslmode: str | None = None
    """libpq ``sslmode``."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    @field_validator("prefix")
    @classmethod
    def _prefix(cls, v: str) -> str:
        return _as_value_error(check_prefix, v)

    @field_validator("schema_name")
    @classmethod
    def _schema(cls, v: str) -> str:
        return _as_value_error(check_identifier, v, "schema name")


class RedisConfig(_Config):
    """Redis: one hash per table, field = key, value = 8-byte version + packed row."""

    type: Literal["redis"] = "redis"
    host: str = "localhost"
    """Server host."""
    port: int = Field(6379, gt=0, lt=65536)
    """Server port."""
    db: int = Field(0, ge=0)
    """Database number."""
    username: str | None = None
    """ACL user; the password comes from ``REDIS_PASSWORD``."""
    prefix: str = "emb:"
    """Key prefix of the per-table hashes and of the registry keys."""
    socket_timeout_s: float = Field(10.0, gt=0)
    """Seconds before a command times out (and is retried by the publisher)."""
    rows_per_script: int = Field(2000, gt=0)
    """Rows per server-side script call inside one pipelined batch."""

    @field_validator("prefix")
    @classmethod
    def _prefix(cls, v: str) -> str:
        return _as_value_error(check_kv_prefix, v)


class FeatureStoreConfig(_Config):
    """Alibaba PAI FeatureStore through its Python SDK (``feature_store_py``).

    The defaults of the view settings are TorchEasyRec's (TTL 15 days, 20 shards, 1 replica,
    1000 rows per SDK batch, a 600 s shutdown drain).
    """

    type: Literal["featurestore"] = "featurestore"
    project: str
    """FeatureStore project name."""
    view: str
    """The DynamicEmbedding feature view holding every table (one ``embedding_name`` each)."""
    region: str = Field(
        default_factory=lambda: os.environ.get("ALIBABA_CLOUD_REGION", ""), validate_default=True
    )
    """Alibaba Cloud region id, e.g. ``cn-hangzhou`` (default: ``ALIBABA_CLOUD_REGION``)."""
    entity: str = "deltarec_key"
    """Feature entity the view joins on (created by rank 0 if missing)."""
    endpoint: str | None = None
    """PAI-FeatureStore OpenAPI endpoint override."""
    sdk_version: str = "deltarec"
    """The SDK's ``version`` namespace the rows are written under and read from."""
    registry: str | None = None
    """Store URL holding the registry (default: a SQLite file under the artifact root)."""
    contract: Literal["deltarec", "tzrec"] = "deltarec"
    """``tzrec``: TorchEasyRec's serving contract (its embedding names, INT8 as uint8 rows)."""
    ttl_s: int = Field(15 * 86400, gt=0)
    """TTL of rows in a view deltarec creates (seconds)."""
    shard_count: int = Field(20, ge=1, le=20)
    """Shards of a view deltarec creates."""
    replication_count: int = Field(1, ge=1, le=3)
    """Replicas of a view deltarec creates."""
    batch_size: int = Field(1000, ge=1, le=1000)
    """Rows per ``write_features`` call (capped by the view's own ``_batch_size``)."""
    shutdown_timeout_s: float = Field(600.0, gt=0)
    """How long closing the store waits for the SDK writer to drain."""
    create_wait_s: float = Field(600.0, gt=0)
    """How long a rank other than 0 waits for rank 0 to create the view."""

    @field_validator("project", "view", "entity")
    @classmethod
    def _names(cls, v: str) -> str:
        return _as_value_error(check_identifier, v, "FeatureStore name")

    @field_validator("region")
    @classmethod
    def _region(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("required: add ?region=<region id> or set ALIBABA_CLOUD_REGION")
        return v.strip()

    @field_validator("sdk_version")
    @classmethod
    def _version(cls, v: str) -> str:
        if not v.strip() or v.strip() == "default":
            raise ValueError("sdk_version must be an explicit version name, not 'default'")
        return v.strip()


class ReplicaConfig(_Config):
    """A serving replica's HTTP endpoint, read-only (``deltarec serve``, docs/serving.md)."""

    type: Literal["replica"] = "replica"
    host: str = "localhost"
    """The replica's host."""
    port: int = Field(8470, gt=0, lt=65536)
    """The replica's port (``deltarec serve --port``)."""
    timeout_s: float = Field(30.0, gt=0)
    """Seconds before a request fails."""


StoreConfig = Annotated[
    SqliteConfig | PostgresConfig | RedisConfig | FeatureStoreConfig | ReplicaConfig,
    Field(discriminator="type"),
]
_ADAPTER: TypeAdapter[Any] = TypeAdapter(StoreConfig)
_SCHEMES = {
    "sqlite": "sqlite",
    "postgresql": "postgres",
    "postgres": "postgres",
    "redis": "redis",
    "featurestore": "featurestore",
    "replica": "replica",
}


def parse_config(
    obj: dict[str, Any],
) -> StoreConfig:
    """Validate a config mapping (``{"type": "sqlite", "path": ...}``)."""
    try:
        return _ADAPTER.validate_python(obj)  # type: ignore[no-any-return]
    except ValidationError as e:
        raise ConfigError(f"store config {_redacted(obj)}: {_errors(e)}") from e


def parse_store_url(url: str) -> StoreConfig:
    """Parse a store URL into its config; raises :class:`ConfigError` naming the problem."""
    if not isinstance(url, str) or "://" not in url:
        # not echoed: a mistyped URL may still hold a password
        raise ConfigError(
            f"the store URL is not a URL (no scheme://); expected one of {_examples()}"
        )
    parts = urllib.parse.urlsplit(url)
    kind = _SCHEMES.get(parts.scheme.lower())
    if kind is None:
        raise ConfigError(
            f"store URL {redact_url(url)!r}: unknown scheme {parts.scheme!r}; "
            f"expected one of {_examples()}"
        )
    params = _query(url, parts.query)
    try:
        fields = _URL_FIELDS[kind](parts)
    except ValueError as e:
        raise ConfigError(f"store URL {redact_url(url)!r}: {e}") from e
    overlap = set(fields) & set(params)
    if overlap:
        raise ConfigError(f"store URL {redact_url(url)!r}: {sorted(overlap)} given twice")
    obj = {"type": kind, **fields, **params}
    try:
        return _ADAPTER.validate_python(obj)  # type: ignore[no-any-return]
    except ValidationError as e:
        raise ConfigError(f"store URL {redact_url(url)!r}: {_errors(e)}") from e


def _query(url: str, query: str) -> dict[str, str]:
    params: dict[str, str] = {}
    for key, value in urllib.parse.parse_qsl(query, keep_blank_values=True, strict_parsing=False):
        if key in params:
            raise ConfigError(f"store URL {redact_url(url)!r}: option {key!r} given twice")
        _refuse_secret_option(url, key, value)
        params[key] = value
    return params


def _refuse_secret_option(url: str, key: str, value: str) -> None:
    """Credentials never come from query options (they would reach logs, records, argv)."""
    if is_secret_option(key):
        raise ConfigError(
            f"store URL {redact_url(url)!r}: option {key!r} holds a credential, which a URL "
            f"must not carry; {_WHERE_PASSWORDS_GO}"
        )
    nested = credential_problems(value, 1)
    if nested:
        raise ConfigError(
            f"store URL {redact_url(url)!r}: option {key!r} carries {', '.join(nested)}; "
            f"{_WHERE_PASSWORDS_GO}"
        )


_WHERE_PASSWORDS_GO = (
    "pass passwords through the environment (PGPASSWORD or ~/.pgpass for PostgreSQL, "
    "REDIS_PASSWORD for Redis, FEATUREDB_PASSWORD for FeatureStore) or the credentials Secret"
)


def _sqlite_fields(parts: urllib.parse.SplitResult) -> dict[str, Any]:
    if parts.netloc not in ("", "localhost"):
        raise ValueError("a SQLite URL has no host: use sqlite:///relative or sqlite:////absolute")
    path = urllib.parse.unquote(parts.path)
    path = path[1:] if path.startswith("/") else path  # sqlite:///rel, sqlite:////abs
    if not path:
        raise ValueError("no database path (sqlite:///path/to/store.db)")
    return {"path": path}


def _postgres_fields(parts: urllib.parse.SplitResult) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    if parts.hostname:
        fields["host"] = urllib.parse.unquote(parts.hostname)
    if parts.port is not None:
        fields["port"] = parts.port
    if parts.username:
        fields["user"] = urllib.parse.unquote(parts.username)
    if parts.password:
        fields["password"] = urllib.parse.unquote(parts.password)
    db = parts.path.lstrip("/")
    if db:
        fields["dbname"] = urllib.parse.unquote(db)
    return fields


def _redis_fields(parts: urllib.parse.SplitResult) -> dict[str, Any]:
    if parts.password:
        raise ValueError("put the Redis password in REDIS_PASSWORD, not in the URL")
    fields: dict[str, Any] = {}
    if parts.hostname:
        fields["host"] = parts.hostname
    if parts.port is not None:
        fields["port"] = parts.port
    if parts.username:
        fields["username"] = urllib.parse.unquote(parts.username)
    db = parts.path.strip("/")
    if db:
        if not db.isdigit():
            raise ValueError(f"database {db!r} is not a number")
        fields["db"] = int(db)
    return fields


def _featurestore_fields(parts: urllib.parse.SplitResult) -> dict[str, Any]:
    if parts.username or parts.password:
        raise ValueError(
            "credentials never go in the URL: use the Alibaba Cloud default credential chain "
            "and FEATUREDB_USERNAME/FEATUREDB_PASSWORD"
        )
    view = parts.path.strip("/")
    if not parts.hostname or not view or "/" in view:
        raise ValueError("expected featurestore://<project>/<view>?region=<region>")
    options = dict(urllib.parse.parse_qsl(parts.query, keep_blank_values=True))
    if "datasource" in options:
        raise ValueError(
            "option 'datasource' is not supported: the FeatureStore SDK writes to the "
            "project's online datasource; remove it from the URL"
        )
    return {"project": parts.hostname, "view": view}


_URL_FIELDS = {
    "sqlite": _sqlite_fields,
    "postgres": _postgres_fields,
    "redis": _redis_fields,
    "featurestore": _featurestore_fields,
    "replica": lambda parts: _replica_fields(parts),
}


def _replica_fields(parts: urllib.parse.SplitResult) -> dict[str, Any]:
    if parts.username or parts.password or parts.path.strip("/") or not parts.hostname:
        raise ValueError("expected replica://<host>:<port> (read-only; no path, no user)")
    return {"host": parts.hostname, **({"port": parts.port} if parts.port is not None else {})}


def _examples() -> str:
    return (
        "sqlite:///path/to/store.db, postgresql://user@host:port/db, redis://host:port/0, "
        "featurestore://project/view?region=..."
    )


def _errors(e: ValidationError) -> str:
    # The first part of a location is the backend's tag of the discriminated union.
    return validation_problems(e, lambda loc: ".".join(str(p) for p in loc[1:]) or str(loc[0]))


def _redacted(obj: dict[str, Any]) -> dict[str, Any]:
    return {
        k: ("***" if is_secret_option(k) else redact_url(v) if isinstance(v, str) else v)
        for k, v in obj.items()
    }


def env_password(name: str) -> str | None:
    """A password from the environment variable ``name`` (None if unset or empty)."""
    return os.environ.get(name) or None
