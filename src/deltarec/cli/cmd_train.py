"""``deltarec train``: train the example model on N ranks, with checkpoints, eval and export.

Run it under torchrun (``torchrun --nproc_per_node 2 .venv/bin/deltarec train ...``) or let it
start torchrun itself (``deltarec train --nproc-per-node 2 ...``). With ``--artifacts`` the
delta dumper is attached through ``deltarec.dump.make_train_hook``.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from deltarec.cli.common import require_resolvable_host
from deltarec.cli.fields import FieldFlag, add_flags
from deltarec.errors import ConfigError, validation_problems

RANK_STORE_ENV = "DELTAREC_RANK_STORE_URL"
"""The ``--store`` URL ``deltarec train --nproc-per-node`` hands its ranks (not their argv)."""

if TYPE_CHECKING:
    from pydantic import BaseModel

log = logging.getLogger("deltarec.train")


@functools.cache
def _groups() -> tuple[tuple[str, tuple[FieldFlag, ...]], ...]:
    """The flags derived from model fields, by ``--help`` group, in order.

    Training flags set :class:`~deltarec.train.config.TrainConfig` (and its ``data``); the dump
    flags set :class:`~deltarec.dump.config.DumperConfig` and the hook's
    :class:`~deltarec.dump.env.TrainSettings` fields, each by the keyword
    :func:`deltarec.dump.make_train_hook` takes. The dump flags but ``--publish-mode`` are
    ``optional``: they are passed on only when given, and need ``--artifacts``.
    """
    from deltarec.dump.config import DumperConfig
    from deltarec.dump.env import TrainSettings
    from deltarec.model.config import DataConfig
    from deltarec.train.config import TrainConfig

    def field(
        model: type[BaseModel],
        name: str,
        metavar: str | None = None,
        flag: str | None = None,
        optional: bool = False,
    ) -> FieldFlag:
        """The flag of field ``name`` of ``model``: ``flag``, else ``--name-with-dashes``."""
        return FieldFlag(flag or "--" + name.replace("_", "-"), model, name, metavar, optional)

    def dump(
        model: type[BaseModel], name: str, metavar: str | None = None, flag: str | None = None
    ) -> FieldFlag:
        return field(model, name, metavar, flag, optional=True)

    return (
        (
            "training",
            (
                field(TrainConfig, "device"),
                field(TrainConfig, "steps", "N"),
                field(TrainConfig, "batch_size", "B"),
                field(TrainConfig, "seed"),
                field(DataConfig, "batches_per_rank", "N"),
                field(TrainConfig, "model", "FILE", "--model-config"),
                field(TrainConfig, "eval_every", "K"),
                field(TrainConfig, "eval_batches", "N"),
                field(TrainConfig, "log_every", "N"),
            ),
        ),
        (
            "checkpoints and export",
            (
                field(TrainConfig, "workdir", "DIR"),
                field(TrainConfig, "checkpoint_every", "C"),
                field(TrainConfig, "checkpoint_at_end", flag="--no-final-checkpoint"),
                field(TrainConfig, "resume", flag="--no-resume"),
                field(TrainConfig, "resume_step", "N"),
                field(TrainConfig, "export_tables", "DIR"),
            ),
        ),
        (
            "delta dumps and publishing (with --artifacts)",
            (
                dump(DumperConfig, "artifacts", "ROOT"),
                dump(DumperConfig, "run", "NAME"),
                dump(DumperConfig, "every_steps", "N", "--dump-every-steps"),
                dump(DumperConfig, "every_minutes", "M", "--dump-every-minutes"),
                dump(DumperConfig, "snapshot", flag="--no-snapshot"),
                dump(TrainSettings, "store", "URL"),
                dump(DumperConfig, "lease_ttl_s", "S", "--lease-ttl"),
                dump(TrainSettings, "metrics_port", "PORT"),
                dump(TrainSettings, "row_encodings", "SPEC"),
                dump(TrainSettings, "dense_every", "N"),
                dump(DumperConfig, "zch_misses"),
                dump(DumperConfig, "read_p99_ms", "MS"),
                dump(DumperConfig, "spread_steps", "N"),
                field(TrainSettings, "publish_mode"),
            ),
        ),
    )


def _flags(model: type[BaseModel] | None = None) -> list[FieldFlag]:
    """Every flag derived from a field (of ``model`` only, if given), in ``--help`` order."""
    flags = [flag for _, group in _groups() for flag in group]
    return [f for f in flags if model is None or f.model is model]


def _dump_flags() -> tuple[FieldFlag, ...]:
    return _groups()[-1][1]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``train`` flags: one per :func:`_groups` entry, and ``--nproc-per-node``."""
    for title, flags in _groups():
        group = parser.add_argument_group(title)
        add_flags(group, flags)
        if title == "training":
            group.add_argument(
                "--nproc-per-node",
                type=int,
                default=None,
                metavar="N",
                help="start torchrun with N local ranks (not needed under torchrun)",
            )


def forwarded_argv(args: argparse.Namespace) -> list[str]:
    """The ``train`` flags of ``args`` without ``--nproc-per-node`` (what each rank gets).

    Derived from :func:`_groups`: a flag that takes a value is passed when its value is set
    (not None), a switch when it is on, so a new flag is forwarded without an edit here.
    """
    argv: list[str] = []
    for flag in _flags():
        value = getattr(args, flag.dest)
        if flag.is_switch:
            if value:
                argv.append(flag.flag)
        elif value is not None:
            argv += [flag.flag, str(value)]
    return argv


def build_config(args: argparse.Namespace) -> Any:
    """The :class:`deltarec.train.TrainConfig` of the parsed flags.

    Raises:
        ConfigError: on an invalid flag combination or model configuration file.
    """
    from pydantic import ValidationError

    from deltarec.model.config import DataConfig, ModelConfig
    from deltarec.train.config import TrainConfig

    try:
        model = ModelConfig()
        if args.model_config:
            path = Path(args.model_config)
            try:
                model = ModelConfig.model_validate(json.loads(path.read_text()))
            except (OSError, json.JSONDecodeError) as e:
                raise ConfigError(f"--model-config {path}: {e}") from e
        values = {f.field: f.value(args) for f in _flags(TrainConfig) if not f.is_file}
        data = DataConfig(**{f.field: f.value(args) for f in _flags(DataConfig)})
        return TrainConfig(model=model, data=data, **values)
    except ValidationError as e:
        raise ConfigError(f"invalid training configuration: {validation_problems(e)}") from e


def _check_dump_flags(args: argparse.Namespace) -> None:
    if args.artifacts is None:
        given = [f.flag for f in _dump_flags() if f.optional and f.given(args)]
        if given:
            raise ConfigError(f"{', '.join(given)} need(s) --artifacts ROOT")
    elif not args.run:
        raise ConfigError("--artifacts needs --run NAME")
    if args.lease_ttl is not None and args.lease_ttl <= 0:
        raise ConfigError(f"--lease-ttl must be positive, got {args.lease_ttl}")
    if args.dense_every is not None and args.dense_every < 1:
        raise ConfigError(f"--dense-every must be >= 1 (dumps per dense state): {args.dense_every}")
    from deltarec.publish.budget import check_budget
    from deltarec.publish.types import check_publish_mode
    from deltarec.stores import require_sdk

    if check_budget(args.read_p99_ms, "--read-p99-ms") is not None and not args.store:
        raise ConfigError("--read-p99-ms is a budget for publishing: it needs --store URL")

    check_publish_mode(args.store, args.publish_mode)
    require_sdk(args.store)
    require_resolvable_host(args.store)


def _check_resume(config: Any) -> None:
    """Refuse a resume whose ``--steps`` ends before the checkpoint it resumes from.

    Such a run would restore the checkpoint, train nothing and exit 0 (checked before any rank
    starts; the newest complete checkpoint, or ``--resume-step``).
    """
    if not (config.workdir and config.resume and os.path.isdir(checkpoints_dir(config))):
        return
    from deltarec.train.checkpoint import CheckpointManager

    steps = CheckpointManager(config.workdir).complete_steps()
    step = config.resume_step if config.resume_step is not None else max(steps, default=None)
    if step is not None and step > config.steps:
        raise ConfigError(
            f"--steps {config.steps} is below step {step} of the checkpoint this run resumes "
            f"from ({checkpoints_dir(config)}): nothing would be trained; give --steps above "
            f"{step}, or --no-resume to start afresh"
        )


def checkpoints_dir(config: Any) -> str:
    """Where the checkpoints of ``config.workdir`` are (``CheckpointManager``'s root)."""
    return os.path.join(config.workdir, "checkpoints")


def _check_row_encodings(args: argparse.Namespace, config: Any) -> None:
    """Before starting ranks: the encodings parse, name the model's tables, fit their dims."""
    if not args.row_encodings:
        return
    from deltarec.dump.config import check_row_encoding, parse_row_encodings
    from deltarec.model.tables import model_tables

    default, dtypes = parse_row_encodings(args.row_encodings)
    tables = {t.table_id: t.dim for t in model_tables(config.model, 1)}
    unknown = sorted(set(dtypes) - set(tables))
    if unknown:
        raise ConfigError(
            f"--row-encodings names unknown tables {unknown}; tables: {sorted(tables)}"
        )
    for table, dim in tables.items():
        dtype = dtypes.get(table, default)
        if dtype is not None:
            check_row_encoding(table, dim, dtype)


def _hooks(args: argparse.Namespace) -> list[Any]:
    """The dump hook of the dump flags given: each sets the keyword of its field."""
    if args.artifacts is None:
        return []
    from deltarec.dump import make_train_hook  # type: ignore[attr-defined,unused-ignore]
    from deltarec.dump.config import parse_row_encodings

    options = {f.field: f.value(args) for f in _dump_flags() if f.given(args)}
    if "row_encodings" in options:
        default, tables = parse_row_encodings(options.pop("row_encodings"))
        options["table_dtypes"] = tables
        if default is not None:
            options["default_dtype"] = default
    return [make_train_hook(**options)]


def _refuse_if_leased(args: argparse.Namespace) -> None:
    """Before starting ranks: refuse an unwritable artifact root or a run another trainer holds.

    Only a fast path for a clear message; rank 0 acquires the lease itself atomically.

    Raises:
        BadInputError: the artifact root is not writable (names it), or the lease is held.
    """
    if args.artifacts is None:
        return
    from deltarec.artifacts.lease import check_free
    from deltarec.artifacts.root import ArtifactRoot
    from deltarec.errors import BadInputError

    root = ArtifactRoot(args.artifacts)
    try:
        root.makedirs(root.run_dir(args.run))  # a no-op on object stores
    except OSError as e:
        raise BadInputError(
            f"artifact root {root.url(root.path)} is not writable: {type(e).__name__}: {e}"
        ) from e
    check_free(root, args.run)


def _quiet_libraries(verbose: bool) -> None:
    """Keep torch/torchrec/fbgemm chatter (deprecations, per-eviction info) off the console."""
    if verbose:
        return
    # fbgemm logs every TBE's arguments at INFO on the root logger: keep only deltarec's INFO.
    logging.getLogger().setLevel(logging.WARNING)
    logging.getLogger("deltarec").setLevel(logging.INFO)
    for name in ("torch", "torchrec", "fbgemm_gpu"):
        logging.getLogger(name).setLevel(logging.ERROR)
        warnings.filterwarnings("ignore", module=rf"{name}(\..*)?$")
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)


def rank_argv_and_env(args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    """What torchrun hands each rank: its arguments and its extra environment.

    The arguments are :func:`forwarded_argv` without ``--store``: the URL (it may carry a
    password) travels in :data:`RANK_STORE_ENV`, out of every command line (``ps``).
    """
    argv = forwarded_argv(args)
    if args.store is None:
        return argv, {}
    at = argv.index("--store")
    return argv[:at] + argv[at + 2 :], {RANK_STORE_ENV: args.store}


def _store_from_launcher(args: argparse.Namespace) -> None:
    from deltarec.train.launch import under_torchrun

    if args.store is None and under_torchrun() and os.environ.get(RANK_STORE_ENV):
        args.store = os.environ[RANK_STORE_ENV]


def run(args: argparse.Namespace) -> int:
    """Run ``deltarec train``; returns the exit code."""
    _store_from_launcher(args)
    _quiet_libraries(bool(getattr(args, "verbose", False)))
    _check_dump_flags(args)
    config = build_config(args)
    _check_row_encodings(args, config)
    _check_resume(config)
    from deltarec.train.launch import (
        RENDEZVOUS_ENV,
        init_distributed,
        launch_torchrun,
        under_torchrun,
    )

    if args.nproc_per_node is not None and not under_torchrun():
        if args.nproc_per_node < 1:
            raise ConfigError(f"--nproc-per-node must be >= 1, got {args.nproc_per_node}")
        _refuse_if_leased(args)
        argv, env = rank_argv_and_env(args)
        return launch_torchrun(args.nproc_per_node, argv, env)

    import torch.distributed as dist

    from deltarec.train.launch import exit_with_parent
    from deltarec.train.loop import run_training

    if under_torchrun():
        exit_with_parent()

    rank_env = {k: os.environ.get(k) for k in RENDEZVOUS_ENV}
    created = init_distributed(config.device)
    try:
        result = run_training(config, hooks=_hooks(args))
        if dist.get_rank() == 0:
            print(
                f"trained steps {result.start_step}..{result.step} in {result.seconds:.1f} s "
                f"({result.steps_per_s:.1f} steps/s), last loss {result.last_loss}"
                + (f", exported {len(result.exported)} tables" if result.exported else "")
            )
    finally:
        if created and dist.is_initialized():
            dist.destroy_process_group()
        if created:  # the variables init_distributed set for a process of its own
            for k, v in rank_env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    return 0
