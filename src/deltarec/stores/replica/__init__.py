"""The ``replica://`` backend: a running serving replica read as a store, read-only.

Modules:
    store: :class:`~deltarec.stores.replica.store.ReplicaStore`, the HTTP client
        (``open_store("replica://host:port")``).
    status: ``ReplicaStatus`` (``GET /v1/status``) and the bearer token, shared with the replica
        (``deltarec.serving``), which reaches them through the :mod:`deltarec.stores` face.
"""
