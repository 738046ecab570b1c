"""The pipeline's KFP v2 components: one thin function per step.

Each component is a Python component on a pinned deltarec image
(:mod:`deltarec.orchestrate.images`) whose body imports :mod:`deltarec.orchestrate.steps` and
calls one entry point; the logic lives there. No ``packages_to_install``: the images carry
deltarec, and ``kfp.local``'s SubprocessRunner runs the bodies in the current environment.

Typed artifacts: ``train`` outputs ``generation`` (an ``Artifact`` whose metadata holds run,
generation, last_seq, last_step, dumps, rows and uri), which ``verify`` and ``promote`` consume;
``verify`` outputs ``Metrics``, an ``HTML`` report and its verdict (``"PASS"``/``"FAIL"``).

This module is not written with postponed annotations: KFP reads the parameter types of the
component functions at definition time.
"""

from kfp import dsl
from kfp.dsl import HTML, Artifact, Input, Metrics, Output

from deltarec.orchestrate.images import TOOLS_IMAGE, TRAINER_IMAGE


@dsl.component(base_image=TOOLS_IMAGE)
def provision(artifact_root: str, run_name: str, store_url: str):
    """Create the store views for the run's tables (idempotent)."""
    from deltarec.orchestrate import steps

    steps.provision(artifacts=artifact_root, run=run_name, store=store_url)


@dsl.component(base_image=TRAINER_IMAGE)
def train(
    artifact_root: str,
    run_name: str,
    store_url: str,
    steps: int,
    dump_every_steps: int,
    dump_every_minutes: float,
    publish_mode: str,
    ranks_per_node: int,
    nodes: int,
    gpus_per_node: int,
    checkpoint_dir: str,
    train_extra_args: str,
    credentials_secret: str,
    job_id: str,
    generation: Output[Artifact],
):
    """Train one generation with delta dumps and publishing (torchrun, or a PyTorchJob)."""
    import shlex

    from deltarec.orchestrate import steps as entry

    entry.train(
        artifacts=artifact_root,
        run=run_name,
        store=store_url,
        steps=steps,
        dump_every_steps=dump_every_steps,
        dump_every_minutes=dump_every_minutes,
        publish_mode=publish_mode,
        ranks_per_node=ranks_per_node,
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        checkpoint_dir=checkpoint_dir,
        extra_args=shlex.split(train_extra_args),
        job_id=job_id,
        secrets=credentials_secret,
        output=generation,
    )


@dsl.component(base_image=TOOLS_IMAGE)
def verify(
    artifact_root: str,
    store_url: str,
    sample_size: int,
    generation: Input[Artifact],
    metrics: Output[Metrics],
    report: Output[HTML],
) -> str:
    """Read the generation's rows back from the store; returns ``PASS`` or ``FAIL``."""
    from deltarec.orchestrate import steps

    return steps.verify(
        artifacts=artifact_root,
        store=store_url,
        generation=generation,
        sample_size=sample_size,
        metrics=metrics,
        report=report,
    )


@dsl.component(base_image=TOOLS_IMAGE)
def promote(artifact_root: str, store_url: str, generation: Input[Artifact]) -> int:
    """Record the verified generation as serving's current one; returns it."""
    from deltarec.orchestrate import steps

    return steps.promote(artifacts=artifact_root, store=store_url, generation=generation)


@dsl.component(base_image=TOOLS_IMAGE)
def rollback(artifact_root: str, run_name: str, store_url: str, to_generation: int) -> int:
    """Restore serving to an earlier promoted generation; returns it."""
    from deltarec.orchestrate import steps

    return steps.rollback(
        artifacts=artifact_root, run=run_name, store=store_url, to_generation=to_generation
    )


COMPONENTS = {
    "provision": provision,
    "train": train,
    "verify": verify,
    "promote": promote,
    "rollback": rollback,
}
"""Step name -> component, for compiling each one on its own."""
