"""The pipeline's KFP v2 components: one thin function per step.

Each component is a Python component on a pinned deltarec image
(:mod:`deltarec.orchestrate.images`) whose body reads the run's parameters
(``PipelineParams.from_arguments(params)``) and calls one function of
:mod:`deltarec.orchestrate.steps`; the logic lives there. No ``packages_to_install``: the images
carry deltarec, and ``kfp.local``'s SubprocessRunner runs the bodies in the current environment.

Every component takes the whole parameter set as one ``params`` struct, which the first
component (:func:`params_component`, generated from :class:`PipelineParams`'s fields) builds
from the pipeline's parameters and validates. Typed artifacts: ``train``
outputs ``generation`` (an ``Artifact`` whose metadata is the ``GenerationRecord``), which
``verify``, ``promote`` and ``verify_failed`` consume; ``verify`` outputs ``Metrics``, an
``HTML`` report (its metadata carries the ``VerifyOutcome``) and its verdict.

This module is not written with postponed annotations: KFP reads the parameter types of the
component functions at definition time.
"""

import functools
import linecache
from typing import Any, NamedTuple

from kfp import dsl
from kfp.dsl import HTML, Artifact, Input, Metrics, Output

from deltarec.orchestrate.images import TOOLS_IMAGE, TRAINER_IMAGE
from deltarec.orchestrate.params import PipelineParams

_PARAMS_SOURCE = "<deltarec.orchestrate.components.params>"


@functools.cache
def params_component() -> Any:
    """The first step: the pipeline's parameters, validated, as one ``params`` struct.

    Its inputs are :class:`PipelineParams`'s fields (the function's source is generated from
    them, so a new field needs no edit here); its output is the struct every other component
    takes. Invalid parameters fail this step, before anything is provisioned.
    """
    inputs = [f"{name}: {kind.__name__}" for name, kind in PipelineParams.parameter_types().items()]
    source = (
        f"def params({', '.join(inputs)}) -> dict:\n"
        '    """The pipeline\'s parameters, validated, as one struct."""\n'
        "    values = dict(locals())\n"
        "    from deltarec.orchestrate.params import PipelineParams\n\n"
        "    return PipelineParams.from_arguments(values).arguments()\n"
    )
    # kfp reads the function's source to build the component: keep it where inspect finds it
    linecache.cache[_PARAMS_SOURCE] = (len(source), None, source.splitlines(True), _PARAMS_SOURCE)
    namespace: dict[str, Any] = {}
    exec(compile(source, _PARAMS_SOURCE, "exec"), namespace)
    return dsl.component(base_image=TOOLS_IMAGE)(namespace["params"])


@dsl.component(base_image=TOOLS_IMAGE)
def provision(params: dict):
    """Create the store views of the run (on a fresh run from the declared tables).

    Args:
        params: the pipeline's parameters (``PipelineParams`` fields).
    """
    from deltarec.orchestrate import steps
    from deltarec.orchestrate.params import PipelineParams

    steps.provision(PipelineParams.from_arguments(params))


@dsl.component(base_image=TRAINER_IMAGE)
def train(params: dict, credentials_secret: str, job_id: str, generation: Output[Artifact]) -> dict:
    """Train one generation on this node with delta dumps and publishing (torchrun).

    Args:
        params: the pipeline's parameters (``PipelineParams`` fields).
        credentials_secret: comma-separated Secret names (for a multi-node job's pods).
        job_id: the pipeline run's id (names a multi-node job, so a retry follows it).
        generation: receives the ``GenerationRecord`` of the generation trained.

    Returns:
        The ``GenerationRecord`` as a dict (what verify and promote take).
    """
    from deltarec.orchestrate import steps

    return steps.train_output(params, credentials_secret, job_id, generation)


@dsl.component(base_image=TOOLS_IMAGE)
def train_launcher(
    params: dict, credentials_secret: str, job_id: str, generation: Output[Artifact]
) -> dict:
    """The multi-node train step's launcher: creates the TrainJob (or PyTorchJob) and follows it.

    Runs on the slim image and requests no GPU: the job's nodes hold the GPUs.

    Args:
        params: the pipeline's parameters (``PipelineParams`` fields).
        credentials_secret: comma-separated Secret names the job's pods get.
        job_id: the pipeline run's id (names the job, so a retry follows it).
        generation: receives the ``GenerationRecord`` of the generation trained.

    Returns:
        The ``GenerationRecord`` as a dict (what verify and promote take).
    """
    from deltarec.orchestrate import steps

    return steps.train_output(params, credentials_secret, job_id, generation)


@dsl.component(base_image=TOOLS_IMAGE)
def verify_plan(params: dict, generation: dict, base: str = "") -> list:
    """The fan-out of verify: one work item per partition (``verify_partitions`` of them).

    Each item carries all its task needs (``params``, ``generation``, ``partition`` ``I/N``),
    so the loop body takes the item alone.

    Args:
        params: the pipeline's parameters (``PipelineParams`` fields).
        generation: the train step's generation record.
        base: what the compaction before verify did (JSON; logged): verify runs after it, so
            it reads from the newest base.
    """
    from deltarec.orchestrate import steps
    from deltarec.orchestrate.params import PipelineParams

    if base:
        print(f"compaction before verify: {base}")

    p = PipelineParams.from_arguments(params)
    record = steps.record_of(generation).to_metadata()
    return [
        {"params": p.arguments(), "generation": record, "partition": part}
        for part in steps.verify_plan(p)
    ]


@dsl.component(base_image=TOOLS_IMAGE)
def verify_partition(item: dict) -> str:
    """Verify one partition (a key range of every table) of the generation; its JSON document.

    The document travels as JSON text (it holds nulls, which KFP parameter structs do not
    take).

    Args:
        item: a work item of ``verify_plan`` (``params``, ``generation``, ``partition``).
    """
    import json

    from deltarec.orchestrate import steps
    from deltarec.orchestrate.params import PipelineParams

    work = json.loads(item) if isinstance(item, str) else item
    params = PipelineParams.from_arguments(work["params"])
    doc = steps.verify_part(params, steps.record_of(work["generation"]), work["partition"])
    return json.dumps(doc)


@dsl.component(base_image=TOOLS_IMAGE)
def verify(
    params: dict,
    generation: dict,
    partitions: list,
    metrics: Output[Metrics],
    report: Output[HTML],
) -> str:
    """The gate: combine the verify partitions into one verdict, ``PASS`` or ``FAIL``.

    Args:
        params: the pipeline's parameters (``PipelineParams`` fields).
        generation: the train step's generation record.
        partitions: every partition's JSON document (collected from the fan-out).
        metrics: receives verify's metrics and the freshness percentiles.
        report: receives the HTML report (its metadata: the verify outcome).
    """
    import json

    from deltarec.orchestrate import steps
    from deltarec.orchestrate.params import PipelineParams

    outcome = steps.verify_gate(
        PipelineParams.from_arguments(params),
        steps.record_of(generation),
        [json.loads(p) if isinstance(p, str) else p for p in partitions],
        report_path=report.path,
    )
    steps.log_outcome(outcome, metrics, report)
    return outcome.verdict


@dsl.component(base_image=TOOLS_IMAGE)
def promote(params: dict, generation: dict) -> int:
    """Record the verified generation as serving's current one; returns it.

    Args:
        params: the pipeline's parameters (``PipelineParams`` fields).
        generation: the train step's generation record.
    """
    from deltarec.orchestrate import steps
    from deltarec.orchestrate.params import PipelineParams

    record = steps.record_of(generation)
    result = steps.promote(PipelineParams.from_arguments(params), record)
    return result.pointer.generation


@dsl.component(base_image=TOOLS_IMAGE)
def verify_failed(params: dict, report: Input[HTML]):
    """The FAIL branch: drop staging or roll back, call the webhook, then fail the run.

    Args:
        params: the pipeline's parameters (``PipelineParams`` fields).
        report: verify's report (its metadata carries the verify outcome).
    """
    from deltarec.orchestrate import steps
    from deltarec.orchestrate.params import PipelineParams

    outcome = steps.read_outcome(report)
    action = steps.on_verify_failed(PipelineParams.from_arguments(params), outcome)
    raise steps.VerifyFailedError(outcome, action)


@dsl.component(base_image=TOOLS_IMAGE)
def rollback(params: dict, to_generation: int) -> int:
    """Restore serving to an earlier promoted generation; returns it.

    Args:
        params: the pipeline's parameters (``PipelineParams`` fields).
        to_generation: the promoted generation to restore.
    """
    from deltarec.orchestrate import steps
    from deltarec.orchestrate.params import PipelineParams

    p = PipelineParams.from_arguments(params)
    result = steps.rollback(p, to_generation)
    return result.to_generation


@dsl.component(base_image=TOOLS_IMAGE)
def compact_plan(params: dict, generation: dict) -> NamedTuple(  # type: ignore[valid-type]
    "Outputs", [("decision", str), ("items", list), ("plan", str)]
):  # the functional form: KFP reads the outputs from it, the step's container evaluates it
    """Whether and how the trained generation is compacted: ``skip``, ``one-step`` or ``fan-out``.

    Reads manifests and BASE.json only. ``items`` (a fan-out's partitions, each with the
    ``params``, so the loop body takes the item alone) is empty unless ``decision`` is
    ``fan-out``; ``plan`` is the whole decision as JSON (for ``compact`` or ``compact_commit``).

    Args:
        params: the pipeline's parameters (``PipelineParams`` fields).
        generation: the train step's generation record.
    """
    import json
    from collections import namedtuple

    from deltarec.orchestrate import steps
    from deltarec.orchestrate.params import PipelineParams

    p = PipelineParams.from_arguments(params)
    plan = steps.compact_plan(p, steps.record_of(generation))
    print(f"compaction: {plan['decision']} ({plan['reason']})")
    items = [{"params": p.arguments(), **item} for item in plan["items"]]
    outputs = namedtuple("Outputs", ["decision", "items", "plan"])  # type: ignore[name-match]
    return outputs(plan["decision"], items, json.dumps({**plan, "items": []}))


@dsl.component(base_image=TOOLS_IMAGE)
def compact_partition(item: dict) -> str:
    """Write one partition (tables and key range) of the planned base; no BASE.json.

    Args:
        item: a work item of ``compact_plan`` (``params``, ``generation``, ``through_seq``,
            ``tables``, ``key_range``).
    """
    import json

    from deltarec.orchestrate import steps
    from deltarec.orchestrate.params import PipelineParams

    work = json.loads(item) if isinstance(item, str) else item
    params = PipelineParams.from_arguments(work["params"])
    return json.dumps(steps.compact_part(params, work))


@dsl.component(base_image=TOOLS_IMAGE)
def compact_commit(params: dict, plan: str, partitions: list) -> str:
    """Commit the fanned-out base (BASE.json) once every partition is in place; its summary.

    Fails naming the missing parts otherwise: the previous state stays valid, and a re-run
    completes it.

    Args:
        params: the pipeline's parameters (``PipelineParams`` fields).
        plan: ``compact_plan``'s plan (JSON).
        partitions: every partition's result (collected from the fan-out).
    """
    import json

    from deltarec.orchestrate import steps
    from deltarec.orchestrate.params import PipelineParams

    print(f"{len(partitions)} partitions done")
    out = steps.compact_apply(PipelineParams.from_arguments(params), json.loads(plan))
    return json.dumps(out)


@dsl.component(base_image=TOOLS_IMAGE)
def compact(params: dict, plan: str = "") -> str:
    """Compact in one task: ``compact_plan``'s ``skip`` or ``one-step`` plan; its summary (JSON).

    Without a plan (compiled on its own), folds the run's newest generation through its newest
    dump into a base (SPEC §3a).

    Args:
        params: the pipeline's parameters (``PipelineParams`` fields).
        plan: ``compact_plan``'s plan (JSON); empty: compact the newest generation.
    """
    import json

    from deltarec.orchestrate import steps
    from deltarec.orchestrate.params import PipelineParams

    p = PipelineParams.from_arguments(params)
    out = steps.compact_apply(p, json.loads(plan)) if plan else steps.compact_run(p)
    return json.dumps(out)


@dsl.component(base_image=TOOLS_IMAGE)
def gc(params: dict) -> int:
    """Retention after promote (``gc_mode``, ``gc_keep_promotions``); returns what it deleted.

    Prints every dump and base of the run with what was done and why.

    Args:
        params: the pipeline's parameters (``PipelineParams`` fields).
    """
    import json

    from deltarec.orchestrate import steps
    from deltarec.orchestrate.params import PipelineParams

    out = steps.retain(PipelineParams.from_arguments(params))
    for row in out.get("paths", []):
        print(json.dumps(row))
    print(f"retention {out['mode']}: deleted {out.get('deleted', 0)}")
    return int(out.get("deleted", 0))


COMPONENTS = {
    "params": params_component(),
    "provision": provision,
    "train": train,
    "train_launcher": train_launcher,
    "verify_plan": verify_plan,
    "verify_partition": verify_partition,
    "verify": verify,
    "promote": promote,
    "verify_failed": verify_failed,
    "rollback": rollback,
    "compact_plan": compact_plan,
    "compact_partition": compact_partition,
    "compact_commit": compact_commit,
    "compact": compact,
    "gc": gc,
}
"""Step name -> component, for compiling each one on its own."""
