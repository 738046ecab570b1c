"""Freeze the public API of a training program (deltarec.api, docs/api.md): its names, the
signatures of its functions, the settings' fields and variables, and the table-source
protocol. Changing any of them is a decision, made here and in docs/api.md."""

import inspect
import typing

import deltarec.api as api

NAMES = [
    "DType", "DumpHook", "DumperConfig", "ENV_PREFIX", "ManualTracker", "RowShardSource",
    "TableKind", "TableSource", "TableSpec", "TouchedRows", "TrackerHub", "TrainHook",
    "TrainSettings", "discover_sources", "hook_from_env", "make_train_hook",
]  # fmt: skip

SIGNATURES = {
    "hook_from_env": "(*, sources: 'SourceFactory | None' = None, environ: "
    "'Mapping[str, str] | None' = None, **options: 'Any') -> 'DumpHook'",
    "make_train_hook": "(*, artifacts: 'str', run: 'str', every_steps: 'int | None' = None, "
    "every_minutes: 'float | None' = None, snapshot: 'bool' = True, store: 'str | None' = "
    "None, publish_mode: 'PublishMode | str' = <PublishMode.DIRECT: 'direct'>, "
    "metrics_port: 'int | None' = None, dense_every: 'int | None' = None, "
    "**options: 'Any') -> 'DumpHook'",
    "discover_sources": "(model: 'nn.Module') -> 'list[TableSource]'",
}

HOOK_METHODS = {
    "on_start": "(self, model: 'torch.nn.Module', step: 'int', restored_from: 'int | None') "
    "-> 'None'",
    "after_step": "(self, step: 'int') -> 'None'",
    "before_eval": "(self) -> 'None'",
    "after_eval": "(self) -> 'None'",
    "on_end": "(self, step: 'int') -> 'None'",
    "before_checkpoint": "(self) -> 'None'",
    "close": "(self) -> 'None'",
    "state_dict": "(self) -> 'dict[str, Any]'",
    "load_state_dict": "(self, state: 'dict[str, Any]') -> 'None'",
}

SETTINGS = {
    "artifacts": ("DELTAREC_ARTIFACTS", "str"),
    "run": ("DELTAREC_RUN", "str"),
    "dump_every_steps": ("DELTAREC_DUMP_EVERY_STEPS", "int | None"),
    "dump_every_minutes": ("DELTAREC_DUMP_EVERY_MINUTES", "float | None"),
    "store": ("DELTAREC_STORE", "str | None"),
    "publish_mode": ("DELTAREC_PUBLISH_MODE", "deltarec.publish.types.PublishMode"),
    "steps": ("DELTAREC_STEPS", "int | None"),
    "checkpoint_dir": ("DELTAREC_CHECKPOINT_DIR", "str | None"),
    "row_encodings": ("DELTAREC_ROW_ENCODINGS", "str | None"),
    "read_p99_ms": ("DELTAREC_READ_P99_MS", "float | None"),
    "spread_steps": ("DELTAREC_SPREAD_STEPS", "int | None"),
    "dense_every": ("DELTAREC_DENSE_EVERY", "int | None"),
    "metrics_port": ("DELTAREC_METRICS_PORT", "int | None"),
}


def test_the_public_api_lists_exactly_these_names():
    assert sorted(api.__all__) == sorted(NAMES)
    assert all(hasattr(api, name) for name in api.__all__)


def test_the_hook_factories_keep_their_signatures():
    for name, signature in SIGNATURES.items():
        assert str(inspect.signature(getattr(api, name))) == signature, name


def test_the_hook_keeps_every_method_a_training_loop_calls():
    for name, signature in HOOK_METHODS.items():
        assert str(inspect.signature(getattr(api.DumpHook, name))) == signature, name
        assert hasattr(api.TrainHook, name)


def test_the_settings_keep_their_fields_types_and_variables():
    fields = api.TrainSettings.model_fields
    assert list(fields) == list(SETTINGS)
    for name, (env, annotation) in SETTINGS.items():
        assert api.TrainSettings.env_name(name) == env
        shown = typing._type_repr(fields[name].annotation).replace("typing.", "")
        assert shown == annotation, name
    assert api.ENV_PREFIX == "DELTAREC_"


def test_settings_round_trip_through_the_environment_and_reach_the_hook(tmp_path):
    settings = api.TrainSettings(
        artifacts=str(tmp_path), run="r", dump_every_steps=5, store="sqlite:///s.db",
        publish_mode="staged", steps=40,
    )  # fmt: skip
    env = settings.to_env()
    assert env == {
        "DELTAREC_ARTIFACTS": str(tmp_path), "DELTAREC_RUN": "r",
        "DELTAREC_DUMP_EVERY_STEPS": "5", "DELTAREC_STORE": "sqlite:///s.db",
        "DELTAREC_PUBLISH_MODE": "staged", "DELTAREC_STEPS": "40",
    }  # fmt: skip
    assert api.TrainSettings.from_env(env) == settings
    hook = api.hook_from_env(environ=env, queue_bytes=1 << 20)
    assert (hook.config.artifacts, hook.config.every_steps, hook.store, hook.publish_mode) == (
        str(tmp_path), 5, "sqlite:///s.db", "staged",
    )  # fmt: skip
    assert hook.config.queue_bytes == 1 << 20


def test_hook_from_env_builds_its_tables_with_the_given_source_factory(tmp_path):
    import pytest
    import torch

    class Asked(Exception):
        pass

    def sources(model):
        raise Asked(model)

    env = api.TrainSettings(artifacts=str(tmp_path), run="r", dump_every_steps=5).to_env()
    hook = api.hook_from_env(environ=env, sources=sources)
    model = torch.nn.Linear(1, 1)
    with pytest.raises(Asked) as asked:
        hook.on_start(model, 0, None)
    assert asked.value.args == (model,)


def test_bad_settings_name_the_variable():
    import pytest

    from deltarec.errors import ConfigError

    with pytest.raises(ConfigError, match="DELTAREC_RUN"):
        api.TrainSettings.from_env({"DELTAREC_ARTIFACTS": "/a"})
    with pytest.raises(ConfigError, match="DELTAREC_DUMP_EVERY_STEPS"):
        api.TrainSettings.from_env({"DELTAREC_ARTIFACTS": "/a", "DELTAREC_RUN": "r",
                                    "DELTAREC_DUMP_EVERY_STEPS": "often"})  # fmt: skip


def test_the_table_source_protocol_keeps_its_methods_and_attributes():
    abstract = sorted(api.TableSource.__abstractmethods__)
    assert abstract == ["collect", "read_keys", "snapshot"]
    assert {"table_id", "spec", "writes"} <= set(typing.get_type_hints(api.TableSource))
    assert [f for f in api.TouchedRows.__dataclass_fields__] == ["keys", "rows", "ops"]
    assert [f for f in api.TableSpec.__dataclass_fields__][:3] == ["dim", "dtype", "kind"]


def test_row_encodings_reach_the_hook_as_dumper_dtypes():
    settings = api.TrainSettings(artifacts="/a", run="r", row_encodings="float16,t.x=int8_rowwise")
    assert settings.to_env()["DELTAREC_ROW_ENCODINGS"] == "float16,t.x=int8_rowwise"
    args = settings.hook_arguments()
    assert args["default_dtype"] is api.DType.FLOAT16
    assert args["table_dtypes"] == {"t.x": api.DType.INT8_ROWWISE}


TORCH_FREE = """
import sys

import deltarec.dump, deltarec.model, deltarec.stores, deltarec.train
from deltarec.cli import COMMANDS, build_parser
from deltarec.cli import cmd_train
from deltarec.model import ModelConfig, model_tables
from deltarec.train import TrainError

for command in COMMANDS:
    build_parser(command)
args = build_parser("train").parse_args([
    "train", "--nproc-per-node", "2", "--artifacts", "a", "--run", "r",
    "--row-encodings", "float16",
])
cmd_train._check_dump_flags(args)
cmd_train._check_row_encodings(args, cmd_train.build_config(args))
assert cmd_train.forwarded_argv(args)
assert model_tables(ModelConfig(), 2)
loaded = sorted({m.split(".")[0] for m in sys.modules} & {"torch", "torchrec", "fbgemm_gpu"})
print(",".join(loaded) or "none")
"""


def test_the_store_side_and_every_command_parser_import_no_torch():
    """The stores, the lazy packages' torch-free parts, every command's flags and what
    ``deltarec train --nproc-per-node`` checks before it starts torchrun need no torch."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", TORCH_FREE], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "none"


def test_the_lazy_exports_resolve_to_their_modules_and_refuse_other_names():
    import importlib

    import pytest

    for name in ("deltarec.dump", "deltarec.model", "deltarec.train"):
        package = importlib.import_module(name)
        for export, module in package._LAZY.items():
            assert export in package.__all__, f"{name}.{export} is not in __all__"
            assert getattr(package, export) is getattr(importlib.import_module(module), export)
        with pytest.raises(AttributeError, match=f"module '{name}' has no attribute 'nothing'"):
            package.nothing  # noqa: B018


PLAIN_TABLE_SIGNATURES = {
    "RowShardSource": "(table_id: 'str', spec: 'TableSpec', hub: 'TrackerHub | None', fqn: "
    "'str', weight: 'torch.Tensor | None', row_offset: 'int') -> 'None'",
    "TrackerHub": "(tracker: 'Any', fqns: 'set[str]', *, recorders: 'Iterable[Any]' = (), "
    "tracker_fqns: 'Iterable[str] | None' = None, ignored: 'Iterable[str]' = (), explain: "
    "'Callable[[str], list[str]] | None' = None, checks: 'Iterable[Callable[[], None]]' = ()) "
    "-> 'None'",
}


def test_a_plain_torch_table_is_dumped_through_the_public_api_as_docs_api_md_shows(tmp_path):
    import numpy as np
    import torch

    from deltarec.artifacts import ArtifactRoot, read_shard

    for name, signature in PLAIN_TABLE_SIGNATURES.items():
        assert str(inspect.signature(getattr(api, name).__init__))[7:] == signature[1:], name
    assert str(inspect.signature(api.ManualTracker.record)) == (
        "(self, fqn: 'str', ids: 'torch.Tensor') -> 'None'"
    )
    table = torch.nn.Parameter(torch.randn(1000, 8))
    tracker = api.ManualTracker()
    hub = api.TrackerHub(tracker, {"user"})
    spec = api.TableSpec(dim=8, kind=api.TableKind.PLAIN, num_embeddings=1000)
    env = api.TrainSettings(artifacts=str(tmp_path), run="r", dump_every_steps=2).to_env()
    hook = api.hook_from_env(
        environ=env,
        sources=lambda model: [api.RowShardSource("model.user", spec, hub, "user", table, 0)],
    )
    hook.on_start(torch.nn.Module(), step=0, restored_from=None)
    touched: set[int] = set()
    try:
        for step in range(1, 3):
            ids = torch.randint(0, 1000, (64,))
            tracker.record("user", ids)  # after each lookup
            with torch.no_grad():
                table.index_add_(0, ids, torch.ones(64, 8))
            touched |= set(ids.tolist())
            hook.after_step(step)
        hook.on_end(2)
    finally:
        hook.close()
    root = ArtifactRoot(str(tmp_path))
    manifest = root.read_manifest("r", 1, 1)
    (shard,) = manifest.shards
    rows = read_shard(root, root.dump_dir("r", 1, 1), shard, api.DType.FLOAT32)
    assert sorted(rows.keys.tolist()) == sorted(touched)
    assert np.array_equal(rows.embedding, table.detach()[torch.from_numpy(rows.keys)].numpy())
