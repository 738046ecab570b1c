"""Compile one component of the deltarec pipeline from a checkout.

    python components/compile.py STEP [OUTPUT.yaml]     # default OUTPUT: STEP.yaml

STEP is one of the fifteen steps: ``params``, ``provision``, ``train``, ``train_launcher``,
``verify_plan``, ``verify_partition``, ``verify``, ``promote``, ``verify_failed``,
``rollback``, ``compact_plan``, ``compact_partition``, ``compact_commit``, ``compact``, ``gc``
(``deltarec.orchestrate.components.COMPONENTS``); the
folder of the same name beside this file documents it (README.md). The
definitions live in :mod:`deltarec.orchestrate.components`, so the installed ``deltarec
pipeline compile --components DIR`` writes the same YAML, and Python code takes a component
from there (``from deltarec.orchestrate.components import train``). Prints the path written;
exits 2 naming the problem on a wrong call.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from deltarec.orchestrate.components import COMPONENTS
from deltarec.orchestrate.pipeline import compile_component


def main(argv: Sequence[str]) -> int:
    """Compile ``argv[0]``'s component to ``argv[1]`` (default ``<step>.yaml``); exit code."""
    steps = " | ".join(COMPONENTS)
    if not 1 <= len(argv) <= 2:
        print(f"usage: python components/compile.py STEP [OUTPUT.yaml]; STEP: {steps}",
              file=sys.stderr)  # fmt: skip
        return 2
    step = argv[0]
    if step not in COMPONENTS:
        print(f"components/compile.py: no step {step!r}; STEP: {steps}", file=sys.stderr)
        return 2
    print(compile_component(step, argv[1] if len(argv) > 1 else f"{step}.yaml"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
