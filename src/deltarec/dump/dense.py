"""The training side of dense state: read the model's non-embedding state at a dump's step.

:class:`DenseDumps` is the dump hook's dense part (``make_train_hook(dense_every=N)``, or the
``DELTAREC_DENSE_EVERY`` variable): at every ``N``-th dump it copies the model's dense state
(:func:`dense_state`) to host memory on the training thread, at the step the dump's rows are
read, and hands it to the commit (:class:`~deltarec.artifacts.dense.DenseCommitRoot`), which
writes it into the dump before MANIFEST.json. Only rank 0 copies (dense parameters are
replicated; rank 0 commits). The bytes are encoded on the commit thread, not the training one.
"""

from __future__ import annotations

import io
from collections.abc import Callable

import torch
import torch.distributed as dist

from deltarec.artifacts.dense import DenseCapture, DenseCommitRoot

DenseStateFn = Callable[[torch.nn.Module], dict[str, torch.Tensor]]
"""Reads a model's dense state: parameter and buffer name -> tensor."""

_WRAPPERS = ("_dmp_wrapped_module.", "module.")


def _unwrapped(name: str) -> str:
    """A module or state name without DMP's and DDP's wrapper prefixes."""
    changed = True
    while changed:
        changed = False
        for prefix in _WRAPPERS:
            if name.startswith(prefix):
                name, changed = name[len(prefix) :], True
    return name


def _is_embedding_module(module: torch.nn.Module) -> bool:
    name = type(module).__name__
    return "EmbeddingBagCollection" in name or "EmbeddingCollection" in name


def dense_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state outside its embedding modules, as host copies (names unwrapped).

    Every entry of ``model.state_dict()`` except those under an EmbeddingBagCollection or
    EmbeddingCollection (sharded or not, managed-collision included: their rows are the sparse
    half, published as dumps) and except sharded tensors.
    """
    embedding = [
        _unwrapped(n) + "." for n, m in model.named_modules() if n and _is_embedding_module(m)
    ]
    out: dict[str, torch.Tensor] = {}
    for name, value in model.state_dict().items():
        key = _unwrapped(name)
        if any(key.startswith(prefix) for prefix in embedding):
            continue
        if type(value) not in (torch.Tensor, torch.nn.Parameter):  # sharded: not dense
            continue
        out[key] = value.detach().to("cpu", copy=True)
    return out


def _encode(state: dict[str, torch.Tensor]) -> Callable[[], bytes]:
    def payload() -> bytes:
        buf = io.BytesIO()
        torch.save(state, buf)
        return buf.getvalue()

    return payload


class DenseDumps:
    """Commits the model's dense state with every ``every``-th dump (rank 0).

    Args:
        every: dense state with every N-th dump (1: every dump; the first dump of a
            generation and the final dump always carry it).
        state_fn: reads the dense state (default: :func:`dense_state`).
    """

    def __init__(self, every: int = 1, state_fn: DenseStateFn | None = None) -> None:
        if every < 1:
            raise ValueError(f"dense_every must be >= 1, got {every}")
        self.every = every
        self.state_fn = state_fn or dense_state
        self.capture = DenseCapture()
        self._model: torch.nn.Module | None = None
        self._dumps = 0
        self._rank0 = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0

    def root(self, uri: str, storage_options: dict[str, object] | None) -> DenseCommitRoot:
        """The artifact root the dumper must commit through."""
        return DenseCommitRoot(uri, storage_options, self.capture)

    def started(self, model: torch.nn.Module, step: int) -> None:
        """The generation started at ``step`` (its snapshot or republish dump is queued)."""
        self._model = model
        self._settle(step, True)

    def stepped(self, step: int, dumped: bool) -> None:
        """After the dumper's turn at ``step``; ``dumped``: it queued a dump."""
        due = dumped and self._dumps % self.every == 0
        self._dumps += int(dumped)
        self._settle(step, due)

    def ending(self, step: int) -> None:
        """The final dump at ``step`` comes next."""
        self._settle(step, True)

    def close(self) -> None:
        """Release commits waiting for a step (training ended or failed)."""
        self.capture.close()

    def _settle(self, step: int, capture: bool) -> None:
        payload = None
        try:
            if capture and self._rank0 and self._model is not None:
                payload = _encode(self.state_fn(self._model))
        finally:
            self.capture.settle(step, payload)


__all__ = ["DenseDumps", "DenseStateFn", "dense_state"]
