"""The ``verify_failed`` step (the FAIL branch) of the deltarec pipeline (see README.md).

The definition lives in :mod:`deltarec.orchestrate.components` so that the installed
``deltarec pipeline`` command compiles exactly this component; this file re-exports it and
compiles it on its own: ``python components/verify_failed/component.py [OUTPUT.yaml]``.
"""

import sys

from deltarec.orchestrate.components import verify_failed as component

__all__ = ["component"]

if __name__ == "__main__":
    from deltarec.orchestrate.pipeline import compile_component

    print(
        compile_component(
            "verify_failed", sys.argv[1] if len(sys.argv) > 1 else "verify_failed.yaml"
        )
    )
