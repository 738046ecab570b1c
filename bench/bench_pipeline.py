"""What running the steps as a kfp.local pipeline costs over running them directly.

Measured: ``deltarec pipeline run --local`` (provision -> train -> verify -> promote, each step a
kfp.local subprocess) on the example model, 2 CPU ranks, SQLite. Baseline, in the same run and
on the same settings: the same four entry points of ``deltarec.orchestrate.steps`` called
directly in this process (train still under torchrun). The difference is the orchestration
overhead: step subprocesses, imports, executor input/output, artifact bookkeeping.

Run: ``.venv/bin/python bench/bench_pipeline.py [--steps N] [--dump-every N]``
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import tempfile
import time


class _Artifact:
    def __init__(self, path: str) -> None:
        self.path = path
        self.uri = path
        self.metadata: dict = {}

    def log_metric(self, name: str, value: float) -> None:
        self.metadata[name] = value


def direct(workdir: str, steps: int, every: int) -> tuple[float, str]:
    from deltarec.orchestrate import steps as entry

    art, store = os.path.join(workdir, "art"), f"sqlite:///{workdir}/store.db"
    t0 = time.perf_counter()
    entry.provision(artifacts=art, run="bench", store=store)
    gen = _Artifact(os.path.join(workdir, "generation.json"))
    entry.train(
        artifacts=art, run="bench", store=store, steps=steps, dump_every_steps=every,
        dump_every_minutes=0, publish_mode="direct", ranks_per_node=2, output=gen,
    )  # fmt: skip
    verdict = entry.verify(
        artifacts=art, store=store, generation=gen, sample_size=0,
        metrics=_Artifact(os.path.join(workdir, "m")),
        report=_Artifact(os.path.join(workdir, "r.html")),
    )  # fmt: skip
    if verdict == "PASS":
        entry.promote(artifacts=art, store=store, generation=gen)
    return time.perf_counter() - t0, verdict


def pipeline(workdir: str, steps: int, every: int) -> tuple[float, str]:
    from deltarec.orchestrate.local import run_local
    from deltarec.orchestrate.params import parse_params

    params = parse_params(
        run_name="bench", artifact_root=os.path.join(workdir, "art"),
        store_url=f"sqlite:///{workdir}/store.db", steps=steps, dump_every_steps=every,
        sample_size=0, ranks_per_node=2,
    )  # fmt: skip
    t0 = time.perf_counter()
    with open(os.path.join(workdir, "pipeline.log"), "w", encoding="utf-8") as log:
        result = run_local(params, pipeline_root=os.path.join(workdir, "kfp"), output=log)
    return time.perf_counter() - t0, result.verdict


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--dump-every", type=int, default=25)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        base_s, base_v = direct(a, args.steps, args.dump_every)
        pipe_s, pipe_v = pipeline(b, args.steps, args.dump_every)
    print(f"date     {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}")
    print(f"machine  {platform.node()}, {os.cpu_count()} cores, {platform.python_version()}")
    print(f"workload example model, 2 CPU ranks, {args.steps} steps, dump every "
          f"{args.dump_every}, SQLite, verify --all")  # fmt: skip
    print()
    print(f"{'what':<52} {'wall s':>8} {'verdict':>8}")
    print(f"{'baseline: the four steps called directly':<52} {base_s:8.1f} {base_v:>8}")
    print(f"{'measured: deltarec pipeline run --local (kfp.local)':<52} {pipe_s:8.1f} {pipe_v:>8}")
    print(f"{'ratio measured / baseline':<52} {pipe_s / base_s:8.2f}")
    print(f"{'orchestration overhead (s)':<52} {pipe_s - base_s:8.1f}")


if __name__ == "__main__":
    main()
