"""The PAI FeatureStore backend (``featurestore://``): a managed store behind its SDK.

Modules:
    store: :class:`~deltarec.stores.featurestore.store.FeatureStoreStore`, the backend.
    sdk: the one place the SDK is called (errors mapped, rows converted).
    registry: the control plane in a side store (a SQL registry named by ``registry=``).
    tzrec: the TorchEasyRec contract (``contract=tzrec``: embedding names and int8 rows).

Opened through :func:`deltarec.stores.open_store`; nothing outside :mod:`deltarec.stores`
imports these modules.
"""
