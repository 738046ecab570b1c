"""The train step: run the training program on every rank and describe what it wrote.

The program is deltarec's example model (``deltarec train``) or a team's entry point
(``PipelineParams.entry_point``: ``package.module:function`` or a command), which gets the
dump, publish and store settings as ``DELTAREC_*`` environment variables
(:class:`deltarec.dump.env.TrainSettings`). One node: torchrun in this container. Several
nodes: a Kubeflow Trainer v2 TrainJob (:mod:`deltarec.orchestrate.trainjob`, the default) or a
Training Operator PyTorchJob (:mod:`deltarec.orchestrate.pytorchjob`); in a local pipeline run
the TrainJob runs through the Kubeflow SDK's local process backend
(:mod:`deltarec.orchestrate.trainjob_local`). The only step
that crosses a process boundary; :mod:`deltarec.orchestrate.steps` re-exports its functions.
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence

from deltarec.artifacts import ArtifactRoot
from deltarec.errors import BadInputError
from deltarec.orchestrate.params import PipelineParams, parse_entry_point
from deltarec.orchestrate.types import GenerationRecord, StepFailedError

log = logging.getLogger(__name__)


# ---- train -------------------------------------------------------------------------------------
def train_settings_env(params: PipelineParams) -> dict[str, str]:
    """The ``DELTAREC_*`` variables a training entry point gets (see docs/api.md)."""
    from deltarec.dump.env import TrainSettings

    settings = TrainSettings(
        artifacts=params.artifact_root,
        run=params.run_name,
        dump_every_steps=params.dump_every_steps or None,
        dump_every_minutes=params.dump_every_minutes or None,
        store=params.store_url or None,
        publish_mode=params.publish_mode,
        steps=params.steps,
        checkpoint_dir=params.checkpoint_dir or None,
        row_encodings=params.row_encodings or None,
        metrics_port=params.metrics_port or None,
        read_p99_ms=params.read_p99_ms or None,
        dense_every=params.dense_every or None,
    )
    return settings.to_env()


def train_args(params: PipelineParams) -> list[str]:
    """The ``deltarec train`` flags of the example model (no ``--device``/``--nproc``)."""
    args = ["--artifacts", params.artifact_root, "--run", params.run_name]
    args += ["--steps", str(params.steps)]
    if params.dump_every_steps > 0:
        args += ["--dump-every-steps", str(params.dump_every_steps)]
    if params.dump_every_minutes > 0:
        args += ["--dump-every-minutes", f"{params.dump_every_minutes:g}"]
    if params.store_url:
        args += ["--store", params.store_url, "--publish-mode", params.publish_mode.value]
        if params.read_p99_ms:
            args += ["--read-p99-ms", f"{params.read_p99_ms:g}"]
    if params.checkpoint_dir:
        args += ["--workdir", params.checkpoint_dir]
    if params.row_encodings:
        args += ["--row-encodings", params.row_encodings]
    if params.dense_every:
        args += ["--dense-every", str(params.dense_every)]
    if params.metrics_port:
        args += ["--metrics-port", str(params.metrics_port)]
    return [*args, *shlex.split(params.train_extra_args)]


def program(params: PipelineParams) -> tuple[list[str], list[str], dict[str, str]]:
    """What every training rank runs: ``(program, arguments, environment)``.

    The example model: ``deltarec train <flags>`` (``--device`` goes first, added by the
    launcher). An entry point
    ``module:function``: ``python -m deltarec.orchestrate.entry module:function <extra>``; a
    command: the command with ``<extra>`` appended. Entry points get the settings in the
    environment (:func:`train_settings_env`). With ``metrics_port`` set the ranks' metrics
    servers listen on every interface (the scraper reaches a pod by its address); elsewhere
    they listen on loopback only.
    """
    from deltarec.publish.metrics import METRICS_HOST_ENV

    device = "cuda" if params.gpus_per_node > 0 else "cpu"
    scraped = {METRICS_HOST_ENV: "0.0.0.0"} if params.metrics_port else {}
    if not params.entry_point.strip():
        return ["deltarec", "train"], train_args(params), scraped
    extra = shlex.split(params.train_extra_args)
    kind, *target = parse_entry_point(params.entry_point)
    env = {**train_settings_env(params), "DELTAREC_DEVICE": device, **scraped}
    if kind == "function":
        return ["python", "-m", "deltarec.orchestrate.entry", target[0]], extra, env
    return list(target), extra, env


def torchrun_command(params: PipelineParams) -> tuple[list[str], dict[str, str]]:
    """The one-node torchrun command line of the train step, and its extra environment."""
    prog, args, env = program(params)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd.append(f"--nproc-per-node={params.ranks_per_node}")
    if prog[:3] == ["python", "-m", "deltarec.orchestrate.entry"]:
        cmd += ["-m", "deltarec.orchestrate.entry", "--", *prog[3:], *args]
    elif prog == ["deltarec", "train"]:
        # "--" keeps torchrun's parser off the training flags (--run is its --run-path)
        device = "cuda" if params.gpus_per_node > 0 else "cpu"
        cmd += ["-m", "deltarec.train", "--", "--device", device, *args]
    else:
        cmd += ["--no-python", "--", *prog, *args]
    return cmd, env


def check_entry_point(params: PipelineParams) -> None:
    """Refuse an entry point this environment cannot run.

    Checked before any rank starts: one line naming it instead of one traceback per rank. A
    ``module:function`` must import; a command's program must be a file or on ``PATH``.

    Raises:
        BadInputError: the module cannot be imported or has no such callable; the command's
            program does not exist (for a dotted name, the line suggests ``module:function``).
    """
    if not params.entry_point.strip():
        return
    kind, *target = parse_entry_point(params.entry_point)
    if kind == "function":
        from deltarec.orchestrate.entry import load_entry_point

        load_entry_point(target[0])
    elif shutil.which(target[0]) is None and not os.path.isfile(target[0]):
        hint = (
            f"; a function is named package.module:function, e.g. {target[0]}:main"
            if re.fullmatch(r"[A-Za-z_][\w.]*", target[0])
            else ""
        )
        raise BadInputError(
            f"entry point {params.entry_point!r}: no program {target[0]!r} on PATH{hint}"
        )


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


def run_process(cmd: Sequence[str], env: Mapping[str, str]) -> int:
    """Run one training process tree to its end; returns its exit code."""
    from deltarec.train.launch import die_with_parent

    full = {**os.environ, **env}
    full.setdefault("OMP_NUM_THREADS", "1")
    log.info("train: %s", shlex.join(cmd))
    # torchrun dies with this step's process, and its ranks with torchrun (their watchdog)
    return subprocess.call(list(cmd), env=full, preexec_fn=die_with_parent)


def train(
    params: PipelineParams,
    *,
    job_id: str = "",
    secrets: Sequence[str] = (),
    runner: Callable[[Sequence[str], Mapping[str, str]], int] = run_process,
) -> GenerationRecord:
    """Train one generation with delta dumps (and publishing), then describe it.

    One node: torchrun with ``ranks_per_node`` ranks in this container. Several nodes: a
    Kubeflow Trainer TrainJob or a Training Operator PyTorchJob (``launcher``) named after the
    run and ``job_id``, followed until it ends. The generation is the one that appeared under
    the artifact root during the step.

    Args:
        params: the run's parameters (entry point, cadence, store, sizes).
        job_id: the pipeline run's id (names the TrainJob or PyTorchJob, so a retry follows it).
        secrets: Secret names whose keys become the job's pods' environment.
        runner: runs the one-node command (``(argv, extra environment) -> exit code``).

    Raises:
        StepFailedError: training failed or produced no generation.
        TrainJobFailedError: the TrainJob or PyTorchJob failed or timed out.
    """
    from deltarec.train.launch import LAUNCHER_PID_ENV, exit_with_parent

    if os.environ.get(LAUNCHER_PID_ENV):
        # a local pipeline run: this step ends with the command that started the run
        exit_with_parent()
    root = ArtifactRoot(params.artifact_root)
    before = set(root.list_generations(params.run_name))
    if params.nodes == 1:
        if runner is run_process:  # the ranks start here: refuse what they cannot import
            check_entry_point(params)
        cmd, env = torchrun_command(params)
        code = runner(cmd, env)
        if code != 0:
            raise StepFailedError("train", code, "the training program failed")
    else:
        _train_on_cluster(params, job_id, secrets)
    record = generation_record(
        root, params.run_name, _new_generation(root, params.run_name, before)
    )
    log.info("train: %s", record)
    return record


def _train_on_cluster(params: PipelineParams, job_id: str, secrets: Sequence[str]) -> None:
    from deltarec.orchestrate import pytorchjob, trainjob, trainjob_local
    from deltarec.orchestrate.images import TRAINER_IMAGE

    prog, args, env = program(params)
    spec = pytorchjob.TrainJobSpec(
        name=pytorchjob.job_name(params.run_name, job_id or params.run_name),
        namespace=pytorchjob.current_namespace(),
        image=TRAINER_IMAGE,
        nodes=params.nodes,
        procs_per_node=params.ranks_per_node,
        gpus_per_node=params.gpus_per_node,
        train_args=tuple(args),
        secrets=tuple(s.strip() for s in secrets if s.strip()),
        service_account=os.environ.get("DELTAREC_TRAIN_SERVICE_ACCOUNT") or None,
        program=tuple(prog),
        env=tuple(sorted(env.items())),
    )
    if trainjob_local.local_backend_requested():  # a local pipeline run: no cluster
        trainjob_local.check_launcher(params)
        check_entry_point(params)  # its ranks start here too
        trainjob_local.run_local_train_job(spec)
    elif params.launcher == "pytorchjob":
        pytorchjob.run_train_job(spec)
    else:
        trainjob.run_train_job(spec, trainjob.TrainJobSettings(runtime=params.training_runtime))
