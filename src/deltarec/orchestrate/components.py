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
from typing import Any

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
def train(params: dict, credentials_secret: str, job_id: str, generation: Output[Artifact]):
    """Train one generation with delta dumps and publishing (torchrun, or a PyTorchJob).

    Args:
        params: the pipeline's parameters (``PipelineParams`` fields).
        credentials_secret: comma-separated Secret names the PyTorchJob pods mount.
        job_id: the pipeline run's id (names the PyTorchJob, so a retry follows it).
        generation: receives the ``GenerationRecord`` of the generation trained.
    """
    from deltarec.orchestrate import steps
    from deltarec.orchestrate.params import PipelineParams

    record = steps.train(
        PipelineParams.from_arguments(params),
        job_id=job_id,
        secrets=credentials_secret.split(","),
    )
    steps.write_record(generation, record)


@dsl.component(base_image=TOOLS_IMAGE)
def verify(
    params: dict,
    generation: Input[Artifact],
    metrics: Output[Metrics],
    report: Output[HTML],
) -> str:
    """Read the generation's rows back from the store; returns ``PASS`` or ``FAIL``.

    Args:
        params: the pipeline's parameters (``PipelineParams`` fields).
        generation: the train step's generation record.
        metrics: receives verify's metrics and the freshness percentiles.
        report: receives the HTML report (its metadata: the verify outcome).
    """
    from deltarec.orchestrate import steps
    from deltarec.orchestrate.params import PipelineParams

    outcome = steps.verify(
        PipelineParams.from_arguments(params),
        steps.read_record(generation),
        report_path=report.path,
    )
    steps.log_outcome(outcome, metrics, report)
    return outcome.verdict


@dsl.component(base_image=TOOLS_IMAGE)
def promote(params: dict, generation: Input[Artifact]) -> int:
    """Record the verified generation as serving's current one; returns it.

    Args:
        params: the pipeline's parameters (``PipelineParams`` fields).
        generation: the train step's generation record.
    """
    from deltarec.orchestrate import steps
    from deltarec.orchestrate.params import PipelineParams

    result = steps.promote(PipelineParams.from_arguments(params), steps.read_record(generation))
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


COMPONENTS = {
    "params": params_component(),
    "provision": provision,
    "train": train,
    "verify": verify,
    "promote": promote,
    "verify_failed": verify_failed,
    "rollback": rollback,
}
"""Step name -> component, for compiling each one on its own."""
