"""A synthetic click stream for the example model: Zipf-distributed ids, deterministic.

Batch ``i`` of rank ``r`` depends only on ``(seed, stream, r, i)``, so a run resumed at step
``s`` sees exactly the batches it would have seen, and every rank has the same batch size
(row-wise EBC sharding needs that on CPU). Ids of each feature follow a truncated Zipf law
over the table's rows; popularity rank ``k`` maps to id ``(k * stride + shift) % n`` so hot ids
are spread over the row-wise shards. ZCH raw ids live in ``[0, raw_id_space)``, far more than
the ZCH capacity, and their popular set moves every ``drift_every`` steps so admissions and
evictions keep happening. Labels come from a fixed hidden score of the ids and dense
features, so the model has something to learn.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
from torchrec import KeyedJaggedTensor

from deltarec.model.click_model import HISTORY, ZCH_TABLE
from deltarec.model.config import DataConfig, ModelConfig

__all__ = ["EVAL_STREAM", "TRAIN_STREAM", "Batch", "ClickStream", "DataConfig", "zipf_ids"]

TRAIN_STREAM, EVAL_STREAM = 0, 1
"""Stream ids: evaluation batches never repeat training batches."""


@dataclass
class Batch:
    """One rank's batch of ``batch_size`` samples.

    Attributes:
        dense: float32 ``[batch, dense_features]``.
        bags: KJT of the EmbeddingBagCollection features (one key per table).
        history: KJT with key ``history`` (variable length, possibly 0).
        ads: KJT with key ``ad_id`` (raw ids).
        labels: float32 ``[batch]`` of 0/1 clicks.
    """

    dense: torch.Tensor
    bags: KeyedJaggedTensor
    history: KeyedJaggedTensor
    ads: KeyedJaggedTensor
    labels: torch.Tensor

    def to(self, device: torch.device) -> Batch:
        """This batch on ``device`` (non-blocking copies)."""
        return Batch(
            dense=self.dense.to(device, non_blocking=True),
            bags=self.bags.to(device, non_blocking=True),
            history=self.history.to(device, non_blocking=True),
            ads=self.ads.to(device, non_blocking=True),
            labels=self.labels.to(device, non_blocking=True),
        )

    def model_inputs(
        self,
    ) -> tuple[torch.Tensor, KeyedJaggedTensor, KeyedJaggedTensor, KeyedJaggedTensor, torch.Tensor]:
        """Arguments of :meth:`deltarec.model.ClickModel.forward`, in order."""
        return self.dense, self.bags, self.history, self.ads, self.labels


@lru_cache(maxsize=16)
def _zipf_cdf(n: int, a: float) -> np.ndarray:
    weights = 1.0 / np.power(np.arange(1, n + 1, dtype=np.float64), a)
    cdf = np.cumsum(weights)
    return cdf / cdf[-1]


@lru_cache(maxsize=64)
def _stride(n: int) -> int:
    s = max(1, int(n * 0.6180339887)) | 1
    while math.gcd(s, n) != 1:
        s += 2
    return s


def zipf_ids(rng: np.random.Generator, n: int, a: float, size: int, shift: int = 0) -> np.ndarray:
    """``size`` ids in ``[0, n)``: Zipf(``a``) popularity ranks mapped through a fixed stride."""
    ranks = np.searchsorted(_zipf_cdf(n, a), rng.random(size), side="right")
    ranks = np.minimum(ranks, n - 1)
    return ((ranks * _stride(n) + shift) % n).astype(np.int64)


class ClickStream:
    """The batches of one rank.

    Args:
        model: the model configuration (tables, dims, ZCH raw-id space).
        data: stream length per rank.
        batch_size: samples per batch (the same on every rank).
        seed: the run's seed.
        rank: this rank.
        stream: :data:`TRAIN_STREAM` or :data:`EVAL_STREAM`.
    """

    def __init__(
        self,
        model: ModelConfig,
        data: DataConfig,
        batch_size: int,
        seed: int,
        rank: int,
        stream: int = TRAIN_STREAM,
    ) -> None:
        self.model = model
        self.batch_size = batch_size
        self.seed = seed
        self.rank = rank
        self.stream = stream
        self.length = data.length_for(rank) if stream == TRAIN_STREAM else None

    def has(self, index: int) -> bool:
        """Whether batch ``index`` (0-based) exists on this rank."""
        return self.length is None or index < self.length

    def batch(self, index: int, at_step: int | None = None) -> Batch:
        """Batch ``index`` (0-based) of this rank; deterministic.

        Args:
            index: the batch number in this stream.
            at_step: the training step whose ZCH popularity the batch follows (default:
                ``index``; evaluation passes the current training step).

        Raises:
            IndexError: if this rank's stream has fewer batches.
        """
        if not self.has(index):
            raise IndexError(f"rank {self.rank} has {self.length} batches, asked for {index}")
        rng = np.random.default_rng([self.seed, self.stream, self.rank, index])
        b, m = self.batch_size, self.model
        bag_ids = {
            name: zipf_ids(rng, t.num_embeddings, t.zipf_a, b * t.ids_per_sample)
            for name, t in m.tables.items()
        }
        hist_len = rng.integers(0, m.history.ids_per_sample + 1, size=b)
        hist = zipf_ids(rng, m.history.num_embeddings, m.history.zipf_a, int(hist_len.sum()))
        z = m.zch
        phase = index if at_step is None else at_step
        shift = (phase // z.drift_every) * 7919
        ads = zipf_ids(rng, z.raw_id_space, z.zipf_a, b * z.ids_per_sample, shift=shift)
        dense = rng.standard_normal((b, m.dense_features), dtype=np.float32)
        labels = self._labels(rng, bag_ids, ads, dense)
        return Batch(
            dense=torch.from_numpy(dense),
            bags=_kjt({n: (v, m.tables[n].ids_per_sample) for n, v in bag_ids.items()}, b),
            history=KeyedJaggedTensor.from_lengths_sync(
                [HISTORY], torch.from_numpy(hist), torch.from_numpy(hist_len.astype(np.int32))
            ),
            ads=_kjt({ZCH_TABLE: (ads, z.ids_per_sample)}, b),
            labels=torch.from_numpy(labels),
        )

    def _labels(
        self,
        rng: np.random.Generator,
        bag_ids: dict[str, np.ndarray],
        ads: np.ndarray,
        dense: np.ndarray,
    ) -> np.ndarray:
        b = self.batch_size
        score = dense[:, 0] * 0.5 - 1.0
        for name, ids in bag_ids.items():
            per = self.model.tables[name].ids_per_sample
            score += (_hidden_weight(ids) * 0.8).reshape(b, per).mean(1)
        score += (_hidden_weight(ads) * 0.8).reshape(b, -1).mean(1)
        p = 1.0 / (1.0 + np.exp(-score))
        return (rng.random(b) < p).astype(np.float32)


def _hidden_weight(ids: np.ndarray) -> np.ndarray:
    """A fixed pseudo-random weight in [-1, 1] per id (the ground truth the model learns)."""
    h = (ids.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(40)
    return (h.astype(np.float64) / float(1 << 24)) * 2.0 - 1.0


def _kjt(features: dict[str, tuple[np.ndarray, int]], batch_size: int) -> KeyedJaggedTensor:
    """A KJT with fixed ``per_sample`` ids per sample for each feature, keys in dict order."""
    keys = list(features)
    values = torch.from_numpy(np.concatenate([features[k][0] for k in keys]))
    lengths = torch.cat(
        [torch.full((batch_size,), features[k][1], dtype=torch.int32) for k in keys]
    )
    return KeyedJaggedTensor.from_lengths_sync(keys, values, lengths)


def max_ids_per_batch(model: ModelConfig, batch_size: int) -> int:
    """Most ZCH raw ids one rank's batch can carry (sizes the MCH history buffer)."""
    return batch_size * model.zch.ids_per_sample
