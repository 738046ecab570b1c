"""``deltarec demo``: the whole pipeline on this machine with the embedded defaults (SPEC §9).

provision -> train -> verify -> promote, run by kfp.local (or with ``--engine airflow`` by
Airflow's ``dag.test()`` on SQLite) exactly as ``deltarec pipeline run --local`` runs it: the
example model (plain and ZCH tables) on two CPU ranks with synthetic Zipf traffic, delta
dumps every few dozen steps, publishing into a SQLite store, verify of every key, promote.
The console shows one line per step plus the training progress; the full log of the engine
and of every step goes to ``<workdir>/pipeline.log``. It ends with a summary table and the
path of verify's HTML report.
"""

from __future__ import annotations

import io
import os
import re
import shutil
import time
from dataclasses import dataclass
from typing import Any, TextIO, cast

from deltarec.errors import BadInputError
from deltarec.publish.types import PublishMode

DEMO_RUN = "demo"
DEMO_RANKS = 2
DEFAULT_WORKDIR = "demo-work"
DEFAULT_STEPS = 300
MARKER = ".deltarec-demo"
REPORT_NAME = "verify-report.html"
ENGINES = ("kfp", "airflow")
_OWNED = (
    "artifacts",
    "kfp",
    "airflow",
    "store.db",
    "store.db-wal",
    "store.db-shm",
    "pipeline.log",
    REPORT_NAME,
)
_TRAIN_STEP = re.compile(r"step (\d+)/(\d+)\s+loss ([0-9.]+)\s+([0-9.]+) steps/s")


@dataclass(frozen=True)
class DemoResult:
    """What one demo run produced (the numbers of the summary table)."""

    workdir: str
    store: str
    generation: int
    dumps: int
    rows: int
    evictions: int
    keys_checked: int
    freshness_p50_s: float | None
    freshness_p99_s: float | None
    verdict: str
    promoted: int | None
    report_path: str
    log_path: str
    seconds: float


def dump_cadence(steps: int) -> int:
    """Dump about six times per run (at least every 10 steps)."""
    return max(10, steps // 6)


def prepare_workdir(workdir: str) -> None:
    """Create ``workdir``, or clear what an earlier demo left in it.

    Raises:
        BadInputError: ``workdir`` is not empty and was not made by the demo (nothing is
            deleted then).
    """
    if os.path.isdir(workdir) and os.listdir(workdir):
        if not os.path.exists(os.path.join(workdir, MARKER)):
            raise BadInputError(
                f"demo workdir {workdir!r} is not empty and was not created by deltarec demo; "
                "pass an empty or new --workdir"
            )
        for name in _OWNED:
            path = os.path.join(workdir, name)
            if os.path.isdir(path):
                shutil.rmtree(path)
            elif os.path.exists(path):
                os.remove(path)
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, MARKER), "w", encoding="utf-8") as f:
        f.write("made by deltarec demo; its outputs here are replaced by the next demo run\n")


def count_evictions(artifacts: str, run: str, generation: int) -> int:
    """Rows published as evicted (``op = 1``) in the generation's ZCH tables."""
    import pyarrow.parquet as pq

    from deltarec.artifacts import ArtifactRoot, TableKind

    root = ArtifactRoot(artifacts)
    zch = {t for t, spec in root.read_generation(run, generation).tables.items()
           if spec.kind == TableKind.ZCH}  # fmt: skip
    total = 0
    for seq in root.list_dumps(run, generation):
        manifest = root.read_manifest(run, generation, seq)
        dump_dir = root.dump_dir(run, generation, seq)
        for shard in manifest.shards:
            if shard.table in zch and shard.rows:
                with root.open_listed(dump_dir, shard.path) as f:
                    ops = pq.read_table(f, columns=["op"]).column("op").to_numpy()
                total += int((ops == 1).sum())
    return total


class _ProgressTap(io.TextIOBase):
    """A text stream for kfp.local's output.

    Every line goes to the log file; the lines that mark a step's start or end, and the
    trainer's step lines, update the console's progress display.
    """

    def __init__(self, log: Any, progress: Any) -> None:
        self.log = log
        self.progress = progress
        self.tasks: dict[str, Any] = {}
        self.buffer = ""
        self.current: str | None = None

    def write(self, text: str) -> int:  # type: ignore[override]
        self.log.write(text)
        self.buffer += text
        while "\n" in self.buffer:
            line, self.buffer = self.buffer.split("\n", 1)
            self._line(line)
        return len(text)

    def flush(self) -> None:
        self.log.flush()

    def isatty(self) -> bool:
        return False

    def _line(self, line: str) -> None:
        plain = re.sub(r"\x1b\[[0-9;]*m", "", line)
        start = re.search(r"Executing task '(\w+)'", plain)
        done = re.search(r"Task '(\w+)' finished with status (\w+)", plain)
        step = _TRAIN_STEP.search(plain)
        if start:
            name = start.group(1)
            self.current = name
            self.tasks[name] = self.progress.add_task(f"{name}: running", total=None)
        elif done and done.group(1) in self.tasks:
            name, status = done.group(1), done.group(2)
            mark = "done" if status == "SUCCESS" else status.lower()
            task = self.tasks[name]
            total = self.progress.tasks[task].total or 1
            self.progress.update(task, description=f"{name}: {mark}", total=total, completed=total)
        elif step and "train" in self.tasks:
            done_steps, total_steps = int(step.group(1)), int(step.group(2))
            self.progress.update(
                self.tasks["train"],
                description=f"train: loss {float(step.group(3)):.4f}, {step.group(4)} steps/s",
                completed=done_steps,
                total=total_steps,
            )


def run_demo(
    workdir: str = DEFAULT_WORKDIR,
    steps: int = DEFAULT_STEPS,
    store: str | None = None,
    console: Any = None,
    engine: str = "kfp",
) -> DemoResult:
    """Run the whole pipeline locally on the example model and summarize it.

    Args:
        workdir: where artifacts, the engine's outputs, the SQLite store and the log go.
        steps: training steps (two CPU ranks).
        store: store URL; default ``sqlite:///<workdir>/store.db``.
        console: a rich Console for progress; None for a default one.
        engine: ``kfp`` (kfp.local) or ``airflow`` (``dag.test()`` on SQLite).

    Raises:
        BadInputError: bad workdir, steps or store.
        StepFailedError: a step failed (the log file names it).
    """
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn

    from deltarec.orchestrate.params import parse_params

    if steps < 1:
        raise BadInputError(f"demo: --steps must be >= 1, got {steps}")
    if engine not in ENGINES:
        raise BadInputError(f"demo: --engine must be one of {ENGINES}, got {engine!r}")
    console = console or Console()
    workdir = os.path.abspath(workdir)
    prepare_workdir(workdir)
    store = store or f"sqlite:///{os.path.join(workdir, 'store.db')}"
    artifacts = os.path.join(workdir, "artifacts")
    params = parse_params(
        run_name=DEMO_RUN,
        artifact_root=artifacts,
        store_url=store,
        steps=steps,
        dump_every_steps=dump_cadence(steps),
        publish_mode=PublishMode.DIRECT,
        sample_size=0,
        ranks_per_node=DEMO_RANKS,
        nodes=1,
        gpus_per_node=0,
        train_extra_args=f"--log-every {max(1, steps // 20)}",
    )
    log_path = os.path.join(workdir, "pipeline.log")
    console.print(
        f"deltarec demo ({engine}): example model, {DEMO_RANKS} CPU ranks, {steps} steps, "
        f"dump every {params.dump_every_steps} steps, store {store}",
        highlight=False,
    )
    t0 = time.perf_counter()
    progress = Progress(
        SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
        console=console,
    )  # fmt: skip
    with open(log_path, "w", encoding="utf-8") as log, progress:
        tap = cast(TextIO, _ProgressTap(log, progress))
        if engine == "airflow":
            from deltarec.orchestrate.airflow_local import run_airflow_local

            result = run_airflow_local(params, workdir=os.path.join(workdir, "airflow"), output=tap)
        else:
            from deltarec.orchestrate.local import run_local

            result = run_local(params, pipeline_root=os.path.join(workdir, "kfp"), output=tap)
    record = result.generation
    metrics = result.metrics
    report_path = os.path.join(workdir, REPORT_NAME)  # kfp names it without an extension
    shutil.copyfile(result.report_path.removeprefix("file://"), report_path)
    return DemoResult(
        workdir=workdir,
        store=store,
        generation=record.generation,
        dumps=record.dumps,
        rows=record.rows,
        evictions=count_evictions(artifacts, DEMO_RUN, record.generation),
        keys_checked=int(metrics.get("keys_checked", 0)),
        freshness_p50_s=metrics.get("freshness_p50_s"),
        freshness_p99_s=metrics.get("freshness_p99_s"),
        verdict=result.verdict,
        promoted=result.promoted,
        report_path=report_path,
        log_path=log_path,
        seconds=time.perf_counter() - t0,
    )


def log_tail(path: str, lines: int = 25) -> str:
    """The last ``lines`` non-empty lines of the demo's log, colour codes removed."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError as e:
        return f"(cannot read {path}: {e})"
    kept = [re.sub(r"\x1b\[[0-9;]*m", "", x) for x in text.splitlines() if x.strip()]
    return "\n".join(kept[-lines:])


def summary_table(result: DemoResult) -> Any:
    """The demo's closing summary as a rich Table."""
    from rich.table import Table

    def secs(x: float | None) -> str:
        return "n/a (no freshness record)" if x is None else f"{x:.2f} s"

    table = Table(title="deltarec demo", show_header=False, title_justify="left")
    table.add_column("what", style="bold")
    table.add_column("value")
    verdict_style = "green" if result.verdict == "PASS" else "red"
    rows = [
        ("generation", str(result.generation)),
        ("dumps", str(result.dumps)),
        ("rows published", f"{result.rows:,}"),
        ("ZCH evictions published", f"{result.evictions:,}"),
        ("freshness p50 (training step → visible)", secs(result.freshness_p50_s)),
        ("freshness p99", secs(result.freshness_p99_s)),
        ("keys verified", f"{result.keys_checked:,}"),
        ("verify", f"[{verdict_style}]{result.verdict}[/{verdict_style}]"),
        ("promoted generation", "-" if result.promoted is None else str(result.promoted)),
        ("store", result.store),
        ("wall time", f"{result.seconds:.1f} s"),
    ]
    for what, value in rows:
        table.add_row(what, value)
    return table
