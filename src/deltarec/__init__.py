"""deltarec: publish the embedding rows a torchrec job changes to an online store while it trains.

Data flows one way: tracking -> dump -> artifacts (the outbox) -> publish -> stores; verify and
promote read artifacts and the store. Sub-packages:

* ``deltarec.artifacts``: the generation/dump layout on any fsspec URI (SPEC §3).
* ``deltarec.stores``: online store backends behind one small interface (SPEC §5).
* ``deltarec.publish``: the publisher (SPEC §6).
* ``deltarec.verify`` / ``deltarec.promote``: readback verification, promote, rollback (SPEC §7).
* ``deltarec.dump`` / ``deltarec.tracking``: the training side (SPEC §4); these import torch.
* ``deltarec.model`` / ``deltarec.train``: the example model and the ``deltarec train`` entry.

Exports: ``__version__``, ``DeltarecError``.
"""

from deltarec.errors import DeltarecError

__version__ = "0.1.0"

__all__ = ["DeltarecError", "__version__"]
