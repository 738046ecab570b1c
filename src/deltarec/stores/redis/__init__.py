"""The Redis backend (``redis://``): one hash per view, versions guarded by Lua or plain commands.

Modules:
    store: :class:`~deltarec.stores.redis.store.RedisStore`, the backend (writes, merges).
    reads: its reads (point reads, key counts, scans), a mixin.
    registry: the control plane in Redis keys (``RedisRegistry``).
    lua: the versioned-write scripts and the version packing they share.
    plain: versioned writes without scripts (plain commands, for servers that forbid Lua).
    paced: writes that reads interleave with, in small server-side units (a read budget's).
    resp: RESP command bodies built in bulk.
    scan: reading a hash's rows in pages.
    legacy: moving a store of the runless layout to per-run views.

Opened through :func:`deltarec.stores.open_store`; nothing outside :mod:`deltarec.stores`
imports these modules.
"""
