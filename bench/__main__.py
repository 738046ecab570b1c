"""``python -m bench`` (``make bench``): list the benchmarks, or run one or all of them.

    python -m bench                 # list every benchmark, what it needs, and how to run it
    python -m bench NAME [ARGS...]  # run bench/bench_NAME.py (or peers) with ARGS
    python -m bench --all           # run every benchmark this machine can run, one by one

Each benchmark is a script in bench/ that prints its own table (date, machine, figures and
the baseline measured in the same run); results are copied into BENCHMARKS.md by hand, one
row per benchmark, and the run in full into bench/results/. The benchmarks are never part of
``make test``. ``--all`` skips those whose needs (a CUDA device, several GPUs under torchrun,
the peers' virtual environment) this machine does not meet, and says so;
it takes hours on a small machine.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

NEEDS: dict[str, str] = {
    "dump_gpu": "cuda",
    "gather_cuda": "cuda",
    "d2h_queue": "cuda",
    "dump_multigpu": "torchrun",
    "peers": "peers",
}
"""What a benchmark needs beyond deltarec's .venv (none: runs anywhere make test runs)."""

HOW: dict[str, str] = {
    "dump_multigpu": "torchrun --standalone --nproc-per-node N bench/bench_dump_multigpu.py",
    "peers": "bench/peers/setup.sh && python bench/peers/bench_peers.py",
}


def scripts() -> dict[str, str]:
    """Benchmark name -> script path: every bench/bench_*.py, and the peers' benchmark."""
    out = {
        name[len("bench_") : -len(".py")]: os.path.join(HERE, name)
        for name in sorted(os.listdir(HERE))
        if name.startswith("bench_") and name.endswith(".py")
    }
    out["peers"] = os.path.join(HERE, "peers", "bench_peers.py")
    return out


def summary(path: str) -> str:
    """The first line of the script's docstring."""
    with open(path) as f:
        doc = ast.get_docstring(ast.parse(f.read())) or ""
    return doc.strip().splitlines()[0] if doc.strip() else ""


def missing(name: str) -> str | None:
    """Why this machine cannot run benchmark ``name`` (None: it can)."""
    need = NEEDS.get(name)
    if need in ("cuda", "torchrun"):
        try:
            import torch
        except ImportError:
            return "needs torch with CUDA"
        if not torch.cuda.is_available():
            return "needs a CUDA device"
    if need == "torchrun" and shutil.which("torchrun") is None:
        return "needs torchrun"
    peer_python = os.path.join(HERE, "peers", ".venv", "bin", "python")
    if need == "peers" and not os.path.exists(peer_python):
        return "needs bench/peers/.venv (bench/peers/setup.sh installs Feast 0.67)"
    return None


def run(path: str, args: list[str]) -> int:
    return subprocess.call([sys.executable, path, *args])


def main(argv: list[str]) -> int:
    found = scripts()
    if not argv or argv[0] in ("-h", "--help", "--list"):
        print("benchmarks (python -m bench NAME [ARGS]; NAME --help for its options):\n")
        for name, path in found.items():
            need = NEEDS.get(name)
            how = HOW.get(name, f"python -m bench {name}")
            print(f"  {name:<18} {summary(path)}")
            print(f"  {'':<18} run: {how}" + (f"  [needs: {need}]" if need else ""))
        print("\npython -m bench --all runs every one this machine can run (hours on 2 cores).")
        return 0
    if argv[0] == "--all":
        failed = []
        for name, path in found.items():
            why = missing(name)
            if why:
                print(f"== {name}: skipped ({why})", flush=True)
                continue
            print(f"== {name}: {summary(path)}", flush=True)
            if run(path, []) != 0:
                failed.append(name)
        print(f"== done; failed: {', '.join(failed) or 'none'}")
        return 1 if failed else 0
    name = argv[0].removeprefix("bench_").removesuffix(".py")
    if name not in found:
        print(f"no benchmark {argv[0]!r}; python -m bench lists them", file=sys.stderr)
        return 2
    why = missing(name)
    if why:
        print(f"benchmark {name!r} {why}", file=sys.stderr)
        return 2
    return run(found[name], argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
