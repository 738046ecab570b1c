"""The ``rollback`` step of the deltarec pipeline (see README.md beside this file).

The definition lives in :mod:`deltarec.orchestrate.components` so that the installed
``deltarec pipeline`` command compiles exactly this component; this file re-exports it and
compiles it on its own: ``python components/rollback/component.py [OUTPUT.yaml]``.
"""

import sys

from deltarec.orchestrate.components import rollback as component

__all__ = ["component"]

if __name__ == "__main__":
    from deltarec.orchestrate.pipeline import compile_component

    print(compile_component("rollback", sys.argv[1] if len(sys.argv) > 1 else "rollback.yaml"))
