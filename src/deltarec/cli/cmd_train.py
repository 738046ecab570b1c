"""``deltarec train``: train the example model on N ranks, with checkpoints, eval and export.

Run it under torchrun (``torchrun --nproc_per_node 2 .venv/bin/deltarec train ...``) or let it
start torchrun itself (``deltarec train --nproc-per-node 2 ...``). With ``--artifacts`` the
delta dumper is attached through ``deltarec.dump.make_train_hook``.
"""

from __future__ import annotations

import argparse
import json
import logging
import warnings
from pathlib import Path
from typing import Any

from deltarec.errors import ConfigError, validation_problems
from deltarec.publish.types import PublishMode

log = logging.getLogger("deltarec.train")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``train`` flags."""
    g = parser.add_argument_group("training")
    g.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="cpu (gloo) or cuda (nccl, one GPU per rank) (default: cpu)",
    )
    g.add_argument(
        "--steps",
        type=int,
        default=300,
        metavar="N",
        help="train until global step N; a resumed run continues up to N (default: 300)",
    )
    g.add_argument(
        "--batch-size",
        type=int,
        default=128,
        metavar="B",
        help="samples per rank per step, the same on every rank (default: 128)",
    )
    g.add_argument(
        "--seed", type=int, default=0, help="seed of the data and dense init (default: 0)"
    )
    g.add_argument(
        "--batches-per-rank",
        type=int,
        default=None,
        metavar="N",
        help="finite synthetic data: N batches per rank (default: endless)",
    )
    g.add_argument(
        "--model-config",
        default=None,
        metavar="FILE",
        help="JSON file with the model configuration (deltarec.model.ModelConfig)",
    )
    g.add_argument(
        "--eval-every",
        type=int,
        default=None,
        metavar="K",
        help="evaluate every K steps (no gradient, no MCH admission)",
    )
    g.add_argument(
        "--eval-batches",
        type=int,
        default=4,
        metavar="N",
        help="batches per evaluation per rank (default: 4)",
    )
    g.add_argument(
        "--log-every",
        type=int,
        default=50,
        metavar="N",
        help="log loss and steps/s on rank 0 every N steps (default: 50)",
    )
    g.add_argument(
        "--nproc-per-node",
        type=int,
        default=None,
        metavar="N",
        help="start torchrun with N local ranks (not needed under torchrun)",
    )
    c = parser.add_argument_group("checkpoints and export")
    c.add_argument(
        "--workdir",
        default=None,
        metavar="DIR",
        help="checkpoints go to DIR/checkpoints/step-<N>/; resume from the newest",
    )
    c.add_argument(
        "--checkpoint-every",
        type=int,
        default=None,
        metavar="C",
        help="save a checkpoint every C steps (needs --workdir)",
    )
    c.add_argument(
        "--no-final-checkpoint",
        action="store_true",
        help="do not save a checkpoint after the last step",
    )
    c.add_argument(
        "--no-resume",
        action="store_true",
        help="start fresh even if DIR/checkpoints holds a complete checkpoint",
    )
    c.add_argument(
        "--resume-step",
        type=int,
        default=None,
        metavar="N",
        help="resume from the checkpoint of step N instead of the newest",
    )
    c.add_argument(
        "--export-tables",
        default=None,
        metavar="DIR",
        help="at the end write every table as DIR/<table id>.parquet (key, embedding)",
    )
    d = parser.add_argument_group("delta dumps and publishing")
    d.add_argument(
        "--artifacts",
        default=None,
        metavar="ROOT",
        help="artifact root (local path or fsspec URI); enables delta dumps",
    )
    d.add_argument("--run", default=None, metavar="NAME", help="run name (needs --artifacts)")
    d.add_argument(
        "--dump-every-steps",
        type=int,
        default=None,
        metavar="N",
        help="dump the changed rows every N steps",
    )
    d.add_argument(
        "--dump-every-minutes",
        type=float,
        default=None,
        metavar="M",
        help="dump the changed rows every M minutes",
    )
    d.add_argument(
        "--no-snapshot",
        action="store_true",
        help="do not write the snapshot dump (seq 0) at the start of a generation",
    )
    d.add_argument(
        "--store",
        default=None,
        metavar="URL",
        help="publish every committed dump to this store while training",
    )
    d.add_argument(
        "--lease-ttl",
        type=float,
        default=None,
        metavar="S",
        help="the run's lease expires S seconds after its last renewal; a second trainer of "
        "the run refuses to start while it is held (default: 60)",
    )
    d.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        metavar="PORT",
        help="serve the dumper's and publisher's Prometheus metrics on PORT + local rank",
    )
    d.add_argument(
        "--row-encodings",
        default=None,
        metavar="SPEC",
        help="how dumped rows are encoded: a default and/or TABLE=ENCODING entries, comma "
        "separated, of float32 | float16 | int8_rowwise (e.g. 'int8_rowwise,"
        "sparse.ebc.geo=float16'; default: float32)",
    )
    d.add_argument(
        "--zch-misses",
        action="store_true",
        help="also dump ZCH ids looked up but never admitted (op 1, the fallback row), as "
        "TorchEasyRec publishes them; on by itself with a featurestore://...?contract=tzrec "
        "--store",
    )
    d.add_argument(
        "--publish-mode",
        choices=PublishMode.names(),
        default=PublishMode.DIRECT.value,
        help="publish into the live view (direct) or a per-generation staging view",
    )


_NOT_FORWARDED = frozenset({"--nproc-per-node"})
"""The flags of the launching process only; every other ``train`` flag reaches each rank."""


def forwarded_argv(args: argparse.Namespace) -> list[str]:
    """The ``train`` flags of ``args`` without ``--nproc-per-node`` (what each rank gets).

    Derived from :func:`add_arguments`: a flag that takes a value is passed when its value is
    set (not None), a switch when it is on, so a new flag is forwarded without an edit here.
    """
    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser)
    argv: list[str] = []
    for action in parser._actions:
        flag = action.option_strings[-1]
        if flag in _NOT_FORWARDED:
            continue
        value = getattr(args, action.dest)
        if action.nargs == 0:  # a switch: given only when it differs from its default
            if value != action.default:
                argv.append(flag)
        elif value is not None:
            argv += [flag, str(value)]
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
        return TrainConfig(
            model=model,
            data=DataConfig(batches_per_rank=args.batches_per_rank),
            steps=args.steps,
            batch_size=args.batch_size,
            seed=args.seed,
            device=args.device,
            workdir=args.workdir,
            checkpoint_every=args.checkpoint_every,
            checkpoint_at_end=not args.no_final_checkpoint,
            resume=not args.no_resume,
            resume_step=args.resume_step,
            eval_every=args.eval_every,
            eval_batches=args.eval_batches,
            export_tables=args.export_tables,
            log_every=args.log_every,
        )
    except ValidationError as e:
        raise ConfigError(f"invalid training configuration: {validation_problems(e)}") from e


def _check_dump_flags(args: argparse.Namespace) -> None:
    dump_flags = {
        "--run": args.run,
        "--dump-every-steps": args.dump_every_steps,
        "--dump-every-minutes": args.dump_every_minutes,
        "--store": args.store,
        "--no-snapshot": args.no_snapshot or None,
        "--lease-ttl": args.lease_ttl,
        "--metrics-port": args.metrics_port,
        "--row-encodings": args.row_encodings,
        "--zch-misses": args.zch_misses or None,
    }
    if args.artifacts is None:
        given = [flag for flag, value in dump_flags.items() if value is not None]
        if given:
            raise ConfigError(f"{', '.join(given)} need(s) --artifacts ROOT")
    elif not args.run:
        raise ConfigError("--artifacts needs --run NAME")
    if args.lease_ttl is not None and args.lease_ttl <= 0:
        raise ConfigError(f"--lease-ttl must be positive, got {args.lease_ttl}")
    from deltarec.publish.types import check_publish_mode
    from deltarec.stores.featurestore import require_sdk

    check_publish_mode(args.store, args.publish_mode)
    require_sdk(args.store)


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
    if args.artifacts is None:
        return []
    from deltarec.dump import make_train_hook  # type: ignore[attr-defined,unused-ignore]
    from deltarec.dump.config import parse_row_encodings

    options: dict[str, Any] = {}
    if args.lease_ttl is not None:
        options["lease_ttl_s"] = args.lease_ttl
    if args.zch_misses:
        options["zch_misses"] = True
    if args.row_encodings:
        default, tables = parse_row_encodings(args.row_encodings)
        options["table_dtypes"] = tables
        if default is not None:
            options["default_dtype"] = default
    return [
        make_train_hook(
            artifacts=args.artifacts,
            run=args.run,
            every_steps=args.dump_every_steps,
            every_minutes=args.dump_every_minutes,
            snapshot=not args.no_snapshot,
            store=args.store,
            publish_mode=args.publish_mode,
            metrics_port=args.metrics_port,
            **options,
        )
    ]


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


def run(args: argparse.Namespace) -> int:
    """Run ``deltarec train``; returns the exit code."""
    _quiet_libraries(bool(getattr(args, "verbose", False)))
    _check_dump_flags(args)
    config = build_config(args)
    _check_row_encodings(args, config)
    from deltarec.train.launch import init_distributed, launch_torchrun, under_torchrun

    if args.nproc_per_node is not None and not under_torchrun():
        if args.nproc_per_node < 1:
            raise ConfigError(f"--nproc-per-node must be >= 1, got {args.nproc_per_node}")
        _refuse_if_leased(args)
        return launch_torchrun(args.nproc_per_node, forwarded_argv(args))

    import torch.distributed as dist

    from deltarec.train.launch import exit_with_parent
    from deltarec.train.loop import run_training

    if under_torchrun():
        exit_with_parent()

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
    return 0
