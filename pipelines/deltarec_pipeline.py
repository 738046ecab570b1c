"""The deltarec pipeline: provision -> train -> verify -> promote (PASS) or verify_failed (FAIL).

The definition lives in :mod:`deltarec.orchestrate.pipeline` (so the installed
``deltarec pipeline`` command compiles the same thing); this file is the entry point for
working from a checkout:

    python pipelines/deltarec_pipeline.py [OUTPUT.yaml]   # default: deltarec-pipeline.yaml

Submitting and local runs: ``deltarec pipeline submit ...`` and ``deltarec pipeline run --local``.
"""

import sys

from deltarec.orchestrate.pipeline import DEFAULT_OUTPUT, build_pipeline, compile_pipeline

pipeline = build_pipeline()
"""The pipeline with the default credentials Secret mounted."""

__all__ = ["pipeline"]

if __name__ == "__main__":
    print(compile_pipeline(sys.argv[1] if len(sys.argv) > 1 else DEFAULT_OUTPUT))
