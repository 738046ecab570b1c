"""The entry points that the pipeline's components call, one per step.

Each KFP component body imports :mod:`deltarec` and calls exactly one function here; all logic
lives here, where it is tested without KFP. The steps run the ``deltarec`` commands in-process
through :func:`deltarec.cli.main` (so a step behaves exactly like the command line) and read
the artifacts to describe what they produced.

Every step is idempotent in the sense of SPEC §7: provision and promote may be repeated, verify
only reads, and a multi-node train step follows the PyTorchJob it created earlier.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Sequence
from typing import Any

from deltarec.artifacts import ArtifactRoot
from deltarec.errors import BadInputError
from deltarec.orchestrate.types import (
    ArtifactLike,
    GenerationRecord,
    MetricsLike,
    StepFailedError,
)

log = logging.getLogger(__name__)

PASS, FAIL = "PASS", "FAIL"
"""The verify step's verdicts; promote runs only on PASS."""

PUBLISH_MODES = ("direct", "staged")


def run_cli(step: str, argv: Sequence[str]) -> int:
    """Run one ``deltarec`` command in-process and return its exit code.

    Raises:
        StepFailedError: the command exited with 2 (bad input) or any code other than 0 and 1.
    """
    from deltarec.cli import main

    log.info("step %s: deltarec %s", step, " ".join(argv))
    code = main(list(argv))
    if code not in (0, 1):
        raise StepFailedError(step, code, f"deltarec {argv[0]} rejected its input")
    return code


def _require_ok(step: str, argv: Sequence[str]) -> None:
    code = run_cli(step, argv)
    if code != 0:
        raise StepFailedError(step, code)


def _store_args(artifacts: str, run: str, store: str) -> list[str]:
    if not store:
        raise BadInputError("the store URL is empty; this step needs a store")
    return ["--artifacts", artifacts, "--run", run, "--store", store]


# ---- provision ---------------------------------------------------------------------------------
def provision(*, artifacts: str, run: str, store: str) -> int | None:
    """Create the store views for the run's tables (idempotent).

    The tables come from the newest generation of ``run`` (GENERATION.json). A run that has no
    generation yet has nothing to describe its tables; the train step's publisher then creates
    the views from the new generation's GENERATION.json before it writes the first rows.

    Returns:
        The generation whose tables were provisioned, or None for a run without generations.
    """
    gens = ArtifactRoot(artifacts).list_generations(run)
    if not gens:
        log.info("run %r has no generation under %s yet; nothing to provision", run, artifacts)
        return None
    _require_ok("provision", ["provision", *_store_args(artifacts, run, store)])
    return gens[-1]


# ---- train -------------------------------------------------------------------------------------
def train_args(
    *,
    artifacts: str,
    run: str,
    store: str,
    steps: int,
    dump_every_steps: int,
    dump_every_minutes: float,
    publish_mode: str,
    checkpoint_dir: str = "",
    extra_args: Sequence[str] = (),
) -> list[str]:
    """The ``deltarec train`` arguments after ``train`` (no ``--device``, ``--nproc-per-node``).

    A cadence of 0 turns that trigger off; an empty ``store`` trains and dumps without
    publishing; an empty ``checkpoint_dir`` keeps the trainer's default.
    """
    if steps < 1:
        raise BadInputError(f"train: steps must be >= 1, got {steps}")
    if publish_mode not in PUBLISH_MODES:
        raise BadInputError(f"train: publish mode {publish_mode!r} is not one of {PUBLISH_MODES}")
    if dump_every_steps <= 0 and dump_every_minutes <= 0:
        raise BadInputError("train: set dump_every_steps or dump_every_minutes (or both) above 0")
    args = ["--artifacts", artifacts, "--run", run, "--steps", str(steps)]
    if dump_every_steps > 0:
        args += ["--dump-every-steps", str(dump_every_steps)]
    if dump_every_minutes > 0:
        args += ["--dump-every-minutes", f"{dump_every_minutes:g}"]
    if store:
        args += ["--store", store, "--publish-mode", publish_mode]
    if checkpoint_dir:
        args += ["--workdir", checkpoint_dir]
    return [*args, *extra_args]


def generation_record(root: ArtifactRoot, run: str, generation: int) -> GenerationRecord:
    """Describe one generation from its committed manifests.

    Raises:
        BadInputError: the generation has no committed dump.
    """
    seqs = root.list_dumps(run, generation)
    if not seqs:
        raise BadInputError(
            f"run {run!r} generation {generation} under {root.uri} has no committed dump"
        )
    manifests = [root.read_manifest(run, generation, s) for s in seqs]
    return GenerationRecord(
        run=run,
        generation=generation,
        last_seq=seqs[-1],
        last_step=manifests[-1].last_step,
        dumps=len(seqs),
        rows=sum(sum(m.tables.values()) for m in manifests),
        uri=root.url(root.gen_dir(run, generation)),
    )


def _new_generation(root: ArtifactRoot, run: str, before: set[int]) -> int:
    new = sorted(set(root.list_generations(run)) - before)
    if not new:
        raise StepFailedError("train", 1, f"training wrote no new generation of run {run!r}")
    if len(new) > 1:
        log.warning("several new generations of run %r appeared: %s; using %d", run, new, new[-1])
    return new[-1]


def train(
    *,
    artifacts: str,
    run: str,
    store: str,
    steps: int,
    dump_every_steps: int,
    dump_every_minutes: float,
    publish_mode: str,
    ranks_per_node: int,
    nodes: int = 1,
    gpus_per_node: int = 0,
    checkpoint_dir: str = "",
    extra_args: Sequence[str] = (),
    job_id: str = "",
    secrets: Sequence[str] | str = (),
    output: ArtifactLike | None = None,
) -> GenerationRecord:
    """Train one generation with delta dumps (and publishing), then describe it.

    One node: ``deltarec train --nproc-per-node R`` (torchrun) in this container. Several
    nodes: a Training Operator PyTorchJob (see :mod:`deltarec.orchestrate.pytorchjob`) named
    after ``run`` and ``job_id``, followed until it ends. The generation is the one that
    appeared under the artifact root during the step.

    Args:
        artifacts: the artifact root (local path or fsspec URI).
        run: the run name.
        store: the store URL; empty trains and dumps without publishing.
        steps: training steps.
        dump_every_steps: dump cadence in steps (0: off).
        dump_every_minutes: dump cadence in minutes (0: off).
        publish_mode: ``direct`` or ``staged``.
        ranks_per_node: training processes per node.
        nodes: nodes; above 1 a PyTorchJob trains.
        gpus_per_node: GPUs per node; 0 trains on CPU.
        checkpoint_dir: the trainer's ``--workdir``; empty for its default.
        extra_args: more ``deltarec train`` arguments.
        job_id: the pipeline run's id (names the PyTorchJob, so a retry follows it).
        secrets: Secret names whose keys become the PyTorchJob pods' environment (a list,
            or one comma-separated string as the component passes it).
        output: the KFP artifact that receives the :class:`GenerationRecord` (JSON file and
            metadata); None outside KFP.

    Raises:
        StepFailedError: training failed or produced no generation.
        TrainJobFailedError: the PyTorchJob failed or timed out.
    """
    if ranks_per_node < 1 or nodes < 1 or gpus_per_node < 0:
        raise BadInputError(
            f"train: ranks_per_node={ranks_per_node}, nodes={nodes}, gpus_per_node="
            f"{gpus_per_node}: need ranks_per_node >= 1, nodes >= 1, gpus_per_node >= 0"
        )
    args = train_args(
        artifacts=artifacts,
        run=run,
        store=store,
        steps=steps,
        dump_every_steps=dump_every_steps,
        dump_every_minutes=dump_every_minutes,
        publish_mode=publish_mode,
        checkpoint_dir=checkpoint_dir,
        extra_args=extra_args,
    )
    root = ArtifactRoot(artifacts)
    before = set(root.list_generations(run))
    if nodes == 1:
        device = "cuda" if gpus_per_node > 0 else "cpu"
        argv = ["train", "--nproc-per-node", str(ranks_per_node), "--device", device, *args]
        _require_ok("train", argv)
    else:
        names = secrets.split(",") if isinstance(secrets, str) else list(secrets)
        names = [n.strip() for n in names if n.strip()]
        _train_on_cluster(run, job_id, nodes, ranks_per_node, gpus_per_node, args, names)
    record = generation_record(root, run, _new_generation(root, run, before))
    if output is not None:
        write_record(output, record)
    log.info("train: %s", record)
    return record


def _train_on_cluster(
    run: str,
    job_id: str,
    nodes: int,
    ranks_per_node: int,
    gpus_per_node: int,
    args: Sequence[str],
    secrets: Sequence[str],
) -> None:
    from deltarec.orchestrate import pytorchjob
    from deltarec.orchestrate.images import TRAINER_IMAGE

    spec = pytorchjob.TrainJobSpec(
        name=pytorchjob.job_name(run, job_id or run),
        namespace=pytorchjob.current_namespace(),
        image=TRAINER_IMAGE,
        nodes=nodes,
        procs_per_node=ranks_per_node,
        gpus_per_node=gpus_per_node,
        train_args=tuple(args),
        secrets=tuple(secrets),
        service_account=os.environ.get("DELTAREC_TRAIN_SERVICE_ACCOUNT") or None,
    )
    pytorchjob.run_train_job(spec)


def write_record(output: ArtifactLike, record: GenerationRecord) -> None:
    """Store ``record`` as the generation artifact: a JSON file plus the same fields as metadata."""
    os.makedirs(os.path.dirname(output.path) or ".", exist_ok=True)
    with open(output.path, "w", encoding="utf-8") as f:
        json.dump(record.to_metadata(), f, indent=2)
    output.metadata.update(record.to_metadata())


def read_record(generation: ArtifactLike) -> GenerationRecord:
    """The :class:`GenerationRecord` of a generation artifact (metadata, else its JSON file)."""
    if generation.metadata.get("generation") is not None:
        return GenerationRecord.from_metadata(dict(generation.metadata), generation.uri)
    try:
        with open(generation.path, encoding="utf-8") as f:
            return GenerationRecord.from_metadata(json.load(f), generation.path)
    except (OSError, json.JSONDecodeError) as e:
        raise BadInputError(f"{generation.uri}: cannot read the generation record: {e}") from e


# ---- verify ------------------------------------------------------------------------------------
def verify(
    *,
    artifacts: str,
    store: str,
    generation: ArtifactLike,
    sample_size: int,
    metrics: MetricsLike | None = None,
    report: ArtifactLike | None = None,
    json_path: str | None = None,
) -> str:
    """Verify the generation (through its newest dump) against the store.

    ``sample_size <= 0`` compares every key (``--all``). verify's KFP metrics plus the publish
    lag percentiles (``freshness_p50_s``, ``freshness_p99_s``) are logged to ``metrics``; the
    HTML report is written to ``report``; ``json_path`` keeps verify's JSON document.

    Returns:
        ``"PASS"`` or ``"FAIL"`` (the command's exit code 0 or 1).

    Raises:
        StepFailedError: verify rejected its input (exit code 2), or stopped without a result
            (e.g. the store is down): that fails the step instead of reading as a mismatch.
    """
    record = read_record(generation)
    report_path = report.path if report is not None else None
    verdict, _, values = run_verify(
        artifacts=artifacts,
        run=record.run,
        store=store,
        generation=record.generation,
        through_seq=record.last_seq,
        sample_size=sample_size,
        json_path=json_path,
        report_path=report_path,
    )
    if metrics is not None:
        for name, value in sorted(values.items()):
            metrics.log_metric(name, value)
    if report is not None:
        report.metadata.update({"run": record.run, "generation": record.generation})
        report.metadata["verdict"] = verdict
    log.info("verify: run %s generation %d: %s", record.run, record.generation, verdict)
    return verdict


def run_verify(
    *,
    artifacts: str,
    run: str,
    store: str,
    generation: int,
    through_seq: int | None,
    sample_size: int,
    json_path: str | None = None,
    report_path: str | None = None,
) -> tuple[str, dict[str, Any], dict[str, float]]:
    """Run ``deltarec verify`` once; returns ``(verdict, verify JSON, metrics)``."""
    with tempfile.TemporaryDirectory(prefix="deltarec-verify-") as tmp:
        out_json = json_path or os.path.join(tmp, "verify.json")
        out_metrics = os.path.join(tmp, "metrics.json")
        argv = ["verify", *_store_args(artifacts, run, store), "--generation", str(generation)]
        if through_seq is not None:
            argv += ["--through-seq", str(through_seq)]
        argv += ["--all"] if sample_size <= 0 else ["--sample", str(sample_size)]
        argv += ["--json", out_json, "--metrics", out_metrics]
        if report_path:
            os.makedirs(os.path.dirname(report_path) or ".", exist_ok=True)
            argv += ["--report", report_path]
        code = run_cli("verify", argv)
        summary = _load_json(out_json)
        values = {k: float(v) for k, v in numeric_summary(_load_json(out_metrics)).items()}
    if code != 0 and "passed" not in summary:
        # exit code 1 without a result document: verify did not finish (store down, ...)
        raise StepFailedError("verify", code, "verify stopped before it had a result")
    verdict = PASS if code == 0 else FAIL
    values["passed"] = 1.0 if verdict == PASS else 0.0
    values.update(freshness_percentiles(summary))
    return verdict, summary, values


def verify_serving(
    *,
    artifacts: str,
    run: str,
    store: str,
    sample_size: int,
    json_path: str | None = None,
    report_path: str | None = None,
) -> str:
    """Verify the generation that serving is promoted to (through its promoted dump).

    The scheduled check of the Helm chart's CronJob: it finds the serving pointer in the
    store's registry and runs ``deltarec verify`` on it.

    Returns:
        ``"PASS"`` or ``"FAIL"``.

    Raises:
        BadInputError: ``run`` was never promoted in this store.
    """
    from deltarec.stores import open_store

    with open_store(store) as s:
        pointer = s.registry.get_serving(run)
    if pointer is None:
        raise BadInputError(f"run {run!r} has no promoted generation in the store")
    verdict, _, _ = run_verify(
        artifacts=artifacts,
        run=run,
        store=store,
        generation=pointer.generation,
        through_seq=pointer.seq,
        sample_size=sample_size,
        json_path=json_path,
        report_path=report_path,
    )
    return verdict


def _load_json(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def numeric_summary(summary: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """Every number in a (nested) JSON summary, keyed by its dotted path; lists are skipped."""
    out: dict[str, float] = {}
    for key, value in summary.items():
        name = f"{prefix}{key}"
        if isinstance(value, bool | int | float):
            out[name] = float(value)
        elif isinstance(value, dict):
            out.update(numeric_summary(value, f"{name}."))
    return out


def freshness_percentiles(summary: dict[str, Any]) -> dict[str, float]:
    """p50/p99 of the dumps' publish lag (seconds from commit to visible in the store).

    Read from verify's JSON (``dumps[].lag_s``); empty when the store holds no freshness
    record.
    """
    lags = sorted(
        float(d["lag_s"])
        for d in summary.get("dumps") or []
        if isinstance(d, dict) and isinstance(d.get("lag_s"), int | float)
    )
    if not lags:
        return {}
    return {"freshness_p50_s": _quantile(lags, 0.50), "freshness_p99_s": _quantile(lags, 0.99)}


def _quantile(sorted_values: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile of an ascending, non-empty sequence."""
    pos = q * (len(sorted_values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


# ---- promote / rollback ------------------------------------------------------------------------
def promote(*, artifacts: str, store: str, generation: ArtifactLike) -> int:
    """Record the verified generation as serving's current one (merges staging if staged).

    Returns:
        The promoted generation.
    """
    record = read_record(generation)
    argv = ["promote", *_store_args(artifacts, record.run, store)]
    argv += ["--generation", str(record.generation), "--through-seq", str(record.last_seq)]
    _require_ok("promote", argv)
    return record.generation


def rollback(*, artifacts: str, run: str, store: str, to_generation: int) -> int:
    """Restore serving to an earlier promoted generation; returns that generation."""
    argv = ["rollback", *_store_args(artifacts, run, store), "--to-generation", str(to_generation)]
    _require_ok("rollback", argv)
    return to_generation
