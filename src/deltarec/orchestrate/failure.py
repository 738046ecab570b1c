"""The pipeline's FAIL branch: what a failed verify does to serving, and the webhook (SPEC §8).

A failed verify changes who serves only if its run serves (SPEC §7). The KFP component, the
Airflow task and the CLI call :func:`on_verify_failed` (re-exported by
:mod:`deltarec.orchestrate.steps`), then end the run failed with :class:`VerifyFailedError`.
"""

from __future__ import annotations

import json
import logging
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from deltarec.artifacts import ArtifactRoot
from deltarec.credentials import redact_url
from deltarec.errors import CheckFailedError
from deltarec.orchestrate.params import PipelineParams
from deltarec.orchestrate.types import VerifyOutcome
from deltarec.promote import RollbackCheckError, Serving, is_staged, who_serves
from deltarec.promote import rollback as rollback_store
from deltarec.publish.types import PublishMode
from deltarec.stores import open_store

log = logging.getLogger("deltarec.orchestrate.steps")  # the steps' log, as before the split


@dataclass(frozen=True)
class FailureAction:
    """What the FAIL branch did.

    Attributes:
        action: ``dropped-staging`` (a staged generation: nothing reached serving; its
            staging views are dropped), ``rolled-back`` (the failing run served: serving
            restored to its last promoted generation, and verified), ``serving-unchanged``
            (the run does not serve: the store is left as it was), ``nothing-to-undo`` (the
            run serves but was never promoted: there is no generation to go back to).
        rolled_back_to: the generation serving was restored to (``rolled-back``).
        dropped_views: staging views dropped.
        webhook_status: the webhook's HTTP status; None when no webhook is set, 0 when the
            call failed.
        summary: the JSON object sent to the webhook (with who served before and after).
        message: one line saying what happened to serving (also logged).
    """

    action: str
    rolled_back_to: int | None
    dropped_views: int
    webhook_status: int | None
    summary: dict[str, Any]
    message: str = ""


class VerifyFailedError(CheckFailedError):
    """Verify failed; the FAIL branch ran. Ends the pipeline run failed."""

    def __init__(self, outcome: VerifyOutcome, action: FailureAction) -> None:
        self.outcome = outcome
        self.action = action
        super().__init__(
            f"verify of run {outcome.run!r} generation {outcome.generation} failed "
            f"({outcome.failure}); {action.action}: {action.message}"
        )


def on_verify_failed(params: PipelineParams, outcome: VerifyOutcome) -> FailureAction:
    """Undo what the failed generation did to serving, then call the webhook.

    A failed verify changes who serves only if its run serves (SPEC §7):

    * a staged generation never reached serving: its staging views are dropped, serving is
      unchanged;
    * the run serves (direct mode): serving is rolled back to the run's last promoted
      generation at its promoted dump, and the rollback verifies the store against it
      (:func:`deltarec.promote.rollback`); never promoted: nothing to roll back to;
    * the run does not serve: the store is left as it was ("serving unchanged: run X
      generation G", naming who serves).

    The webhook (``webhook_url``) gets the summary as JSON, with who served before and after;
    its failure is logged and does not hide the verify failure. A rollback whose check fails
    is reported in the summary (``rollback_check``) and the log.
    """
    root = ArtifactRoot(params.artifact_root)
    run, gen = outcome.run, outcome.generation
    staged = params.publish_mode is PublishMode.STAGED
    rolled_back_to: int | None = None
    dropped, check = 0, ""
    with open_store(params.store_url, params.artifact_root, run=run) as store:
        before = who_serves(store)
        if staged or is_staged(store, run, gen):
            dropped = store.drop_staging(run, gen)
            staged = True
        pointer = store.registry.get_serving(run)
        if staged:
            action = "dropped-staging"
        elif not before.serves(run):
            action = "serving-unchanged"
        elif pointer is None:
            action = "nothing-to-undo"
        else:
            try:
                rollback_store(root, run, store, pointer.generation, through_seq=pointer.seq)
            except RollbackCheckError as e:
                check = str(e)
            rolled_back_to, action = pointer.generation, "rolled-back"
        after = who_serves(store)
    message = _serving_message(run, action, rolled_back_to, before, after, check)
    summary = {
        "run": run,
        "generation": gen,
        "through_seq": outcome.through_seq,
        "verdict": outcome.verdict,
        "failure": outcome.failure,
        "publish_mode": params.publish_mode.value,
        "action": action,
        "rolled_back_to": rolled_back_to,
        "rollback_check": check or ("passed" if rolled_back_to is not None else None),
        "serving_before": {"describe": before.describe(), **before.to_json()},
        "serving_after": {"describe": after.describe(), **after.to_json()},
        "message": message,
        "report": outcome.report_path,
        "metrics": outcome.metrics,
    }
    status = call_webhook(params.webhook_url, summary) if params.webhook_url else None
    log.warning("verify FAILED for run %s generation %d: %s", run, gen, message)
    return FailureAction(action, rolled_back_to, dropped, status, summary, message)


def _serving_message(
    run: str,
    action: str,
    rolled_back_to: int | None,
    before: Serving,
    after: Serving,
    check: str,
) -> str:
    """One line: what the FAIL branch did to serving, who served before and after."""
    if action == "rolled-back":
        head = f"run {run!r} served: rolled back to generation {rolled_back_to}"
        if check:
            head += f", but the store does not equal it: {check}"
    elif action == "nothing-to-undo":
        head = f"run {run!r} serves but was never promoted: nothing to roll back to"
    elif action == "dropped-staging":
        head = f"staging views dropped; serving unchanged: {after.describe()}"
    else:
        head = f"serving unchanged: {after.describe()}"
    return f"{head} (serving before: {before.describe()}; after: {after.describe()})"


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """A redirect handler that follows none.

    Following one would let whoever answers the webhook make the step request any address it
    can reach (cloud metadata included).
    """

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


_WEBHOOK_OPENER = urllib.request.build_opener(_NoRedirects)


def call_webhook(url: str, summary: Mapping[str, Any], timeout_s: float = 10.0) -> int:
    """POST ``summary`` as JSON to ``url``; returns the HTTP status (0 if the call failed).

    A redirect is not followed: a 3xx answer is a failed call.
    """
    body = json.dumps(summary).encode()
    request = urllib.request.Request(
        url, data=body, method="POST", headers={"Content-Type": "application/json"}
    )
    try:
        with _WEBHOOK_OPENER.open(request, timeout=timeout_s) as response:
            return int(response.status)
    except OSError as e:
        log.error("the webhook %s failed: %s", redact_url(url), e)
        return 0


__all__ = ["FailureAction", "VerifyFailedError", "call_webhook", "on_verify_failed"]
