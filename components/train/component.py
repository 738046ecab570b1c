"""The ``train`` step of the deltarec pipeline (see README.md beside this file).

The definition lives in :mod:`deltarec.orchestrate.components` so that the installed
``deltarec pipeline`` command compiles exactly this component; this file re-exports it and
compiles it on its own: ``python components/train/component.py [OUTPUT.yaml]``.
"""

import sys

from deltarec.orchestrate.components import train as component

__all__ = ["component"]

if __name__ == "__main__":
    from deltarec.orchestrate.pipeline import compile_component

    print(compile_component("train", sys.argv[1] if len(sys.argv) > 1 else "train.yaml"))
