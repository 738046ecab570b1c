"""A follower round is bounded: past its deadline or on a stop it leaves the rest to later."""

from __future__ import annotations

import dataclasses

import numpy as np

from .conftest import T_EMB
from .test_promote import _serving_first_generation


def _more_dumps(outbox, g, seqs):
    for seq in seqs:
        outbox.dump(g, seq, {T_EMB: (np.array([seq, 100 + seq]), float(seq))})


def test_a_round_past_its_deadline_stops_between_dumps_says_blocked_and_the_next_goes_on(
    outbox, store, store_url
):
    g1, follower = _serving_first_generation(outbox, store, store_url)
    _more_dumps(outbox, g1, [2, 3])
    follower.options = dataclasses.replace(follower.options, round_deadline_s=0.0)
    follower.poll()
    assert follower.replica.current.position.seq == 1
    assert "deadline" in (follower.blocked or "")
    assert "deadline" in (follower.status().blocked or "")

    follower.options = dataclasses.replace(follower.options, round_deadline_s=300.0)
    follower.poll()
    assert follower.replica.current.position.seq == 3
    assert follower.blocked is None


def test_a_requested_stop_ends_the_round_before_its_next_dump(outbox, store, store_url):
    g1, follower = _serving_first_generation(outbox, store, store_url)
    _more_dumps(outbox, g1, [2])
    follower.request_stop()
    follower.poll()
    assert follower.replica.current.position.seq == 1
