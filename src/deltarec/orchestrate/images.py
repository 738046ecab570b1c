"""The container images of the pipeline's steps, pinned in one place.

Every KFP component and the PyTorchJob that the train step creates take their image from here.
Both images are built from ``images/<name>/Dockerfile`` and tagged with the deltarec version,
so a compiled pipeline always names the images that carry the same deltarec code.

* ``TRAINER_IMAGE``: CUDA base, torch, fbgemm-gpu, torchrec and deltarec (the train step).
* ``TOOLS_IMAGE``: slim, no torch: pyarrow, store clients and deltarec (provision, verify,
  promote, rollback).
"""

from __future__ import annotations

from deltarec import __version__

REGISTRY = "ghcr.io/deltarec"
"""Where the images are pushed (``make images`` tags them so)."""

TRAINER_IMAGE = f"{REGISTRY}/deltarec-trainer:{__version__}"
"""The train step's image (CUDA 12.8 runtime, torch 2.13.0, fbgemm-gpu 1.8.0, torchrec 1.8.0)."""

TOOLS_IMAGE = f"{REGISTRY}/deltarec-tools:{__version__}"
"""The image of provision, verify, promote and rollback (Python 3.11 slim, no torch)."""

TRAINER_CPU_IMAGE = f"{TRAINER_IMAGE}-cpu"
"""The train step's CPU variant (``VARIANT=cpu``: Python 3.11 slim, torch 2.13.0 CPU build,
fbgemm-gpu-cpu 1.8.0, torchrec 1.8.0); otherwise identical to ``TRAINER_IMAGE``."""
