"""Scores of the example click model from the replica's promoted pair (``POST /v1/score``).

``deltarec serve --score`` answers ``POST /v1/score`` with the example model's click
probabilities (``deltarec train``'s model, :class:`~deltarec.model.ClickModel`, configured by
``--model-config``): its embedding lookups go to the replica's rows and its dense layers load the
replica's dense state, both of the one point the replica serves (:class:`ServingModel`), so a
score is always dense and sparse state of one promoted generation, switched together at
promote and rollback. The point must carry dense state (train with ``--dense-every N``, the
pipeline's ``dense_every``, the chart's ``denseEvery``); else the answer is 503 naming it.

Body: ``{"dense": [[float, ...], ...], "features": {"<feature>": [[id, ...], ...], ...}}``:
one row of ``dense_features`` floats per sample, and per feature (a table of ``tables``,
``history``, ``ad_id``) one list of int64 ids per sample; a feature left out has no ids.
Answer: ``{"generation", "seq", "scores": [float, ...]}`` (sigmoid of the logit per sample).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import torch

from deltarec.errors import BadInputError
from deltarec.model.click_model import HISTORY, ZCH_TABLE, ClickModel
from deltarec.model.config import ModelConfig
from deltarec.serving.model import ServingModel
from deltarec.serving.replica import Replica
from deltarec.serving.types import NotReadyError, ReplicaError

_EXPECTED = (
    '/v1/score: expected {"dense": [[<float>, ...], ...], "features": {"<feature>": '
    "[[<int64 id>, ...], ...], ...}}"
)


@dataclass(frozen=True)
class ScoreInputs:
    """One parsed scoring request: the model's inputs for ``batch`` samples."""

    batch: int
    ids: int
    dense: torch.Tensor
    bags: Any
    history: Any
    ads: Any


class ExampleScorer:
    """Scores the example model from the replica's served point.

    Args:
        replica: the replica (its snapshot gives the rows and the dense state).
        config: the model's configuration (``deltarec train --model-config``; default
            :class:`ModelConfig`).
    """

    def __init__(self, replica: Replica, config: ModelConfig | None = None) -> None:
        self.config = config or ModelConfig()
        # The embedding modules are replaced by lookups into the replica (world size 1:
        # the replica holds every row; ZCH ids are looked up as raw ids).
        model = ClickModel(self.config, 1, torch.device("cpu"), torch.device("meta"))
        self.model = ServingModel(replica, model)
        self.bag_features = list(self.config.tables)
        self.features = [*self.bag_features, HISTORY, ZCH_TABLE]

    def parse(self, body: bytes | bytearray, max_ids: int) -> ScoreInputs:
        """The model's inputs of a request body (400 on anything else; at most ``max_ids``).

        Raises:
            BadInputError: the body is not a scoring request of this model, or names more than
                ``max_ids`` ids.
        """
        try:
            req = json.loads(body or b"{}", parse_constant=_no_constant)
        except (RecursionError, ValueError) as e:
            raise BadInputError(f"{_EXPECTED}; the body is not JSON: {e}") from e
        if not isinstance(req, dict) or not isinstance(req.get("dense"), list):
            raise BadInputError(f"{_EXPECTED}; no dense rows")
        dense = _dense(req["dense"], self.config.dense_features)
        features = req.get("features", {})
        if not isinstance(features, dict):
            raise BadInputError(f"{_EXPECTED}; features is not an object")
        unknown = sorted(set(features) - set(self.features))
        if unknown:
            raise BadInputError(f"/v1/score: unknown features {unknown}; known: {self.features}")
        batch = dense.shape[0]
        lists = {f: _id_lists(f, features.get(f, [[]] * batch), batch) for f in self.features}
        n = sum(len(ids) for per in lists.values() for ids in per)
        if n > max_ids:
            raise BadInputError(f"/v1/score: {n} ids; at most {max_ids} per request")
        return ScoreInputs(
            batch,
            n,
            dense,
            _kjt(self.bag_features, lists),
            _kjt([HISTORY], lists),
            _kjt([ZCH_TABLE], lists),
        )

    def score(self, inputs: ScoreInputs) -> dict[str, Any]:
        """``{"generation", "seq", "scores"}`` of the served point.

        Raises:
            NotReadyError: the replica serves nothing yet, or its point carries no dense state.
        """
        labels = torch.zeros(inputs.batch)
        try:
            position, (_, logits) = self.model.score_at(
                inputs.dense, inputs.bags, inputs.history, inputs.ads, labels
            )
        except ReplicaError as e:
            raise NotReadyError(f"/v1/score: {e}") from e
        scores = torch.sigmoid(logits.float()).tolist()
        return {"generation": position.generation, "seq": position.seq, "scores": scores}


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _dense(rows: list[Any], width: int) -> torch.Tensor:
    if not rows or not all(isinstance(r, list) and len(r) == width for r in rows):
        raise BadInputError(f"/v1/score: dense must be one list of {width} numbers per sample")
    if not all(type(v) in (int, float) and math.isfinite(v) for r in rows for v in r):
        raise BadInputError("/v1/score: every dense value must be a finite number")
    return torch.tensor(rows, dtype=torch.float32)


def _id_lists(feature: str, per: Any, batch: int) -> list[list[int]]:
    if not isinstance(per, list) or len(per) != batch:
        raise BadInputError(f"/v1/score: feature {feature!r} needs one id list per sample")
    for ids in per:
        if not isinstance(ids, list) or not all(type(i) is int for i in ids):
            raise BadInputError(f"/v1/score: feature {feature!r}: ids must be integers")
        if any(not -(1 << 63) <= i < (1 << 63) for i in ids):
            raise BadInputError(f"/v1/score: feature {feature!r}: an id is outside int64")
    return per


def _kjt(features: list[str], lists: dict[str, list[list[int]]]) -> Any:
    from torchrec import KeyedJaggedTensor

    values = [i for f in features for ids in lists[f] for i in ids]
    lengths = [len(ids) for f in features for ids in lists[f]]
    return KeyedJaggedTensor.from_lengths_sync(
        features, torch.tensor(values, dtype=torch.int64), torch.tensor(lengths, dtype=torch.int32)
    )


def load_model_config(path: str | None) -> ModelConfig:
    """``--model-config FILE`` (JSON of :class:`ModelConfig`), or the default configuration.

    Raises:
        BadInputError: the file cannot be read or is not a model configuration.
    """
    if not path:
        return ModelConfig()
    from pydantic import ValidationError

    from deltarec.errors import validation_problems

    try:
        with open(path, encoding="utf-8") as f:
            return ModelConfig.model_validate(json.load(f))
    except (OSError, json.JSONDecodeError) as e:
        raise BadInputError(f"--model-config {path}: {e}") from e
    except ValidationError as e:
        raise BadInputError(f"--model-config {path}: {validation_problems(e)}") from e


__all__ = ["ExampleScorer", "ScoreInputs", "load_model_config"]
