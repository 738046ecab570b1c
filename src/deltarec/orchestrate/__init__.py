"""Orchestration: one step library, run by a Kubeflow pipeline or an Airflow DAG.

Modules:

* ``steps``: the steps as library functions with typed inputs and outputs (provision, train,
  verify, promote, the FAIL branch ``on_verify_failed``, rollback); the KFP components, the
  Airflow tasks and the ``deltarec`` commands call these. Plain Python, tested without KFP.
* ``train_step``: the train step (torchrun, or a PyTorchJob), for the example model or a
  team's entry point; ``entry``: runs a ``module:function`` entry point on each rank.
* ``params``: ``PipelineParams``, the one declaration of the pipeline's parameters.
* ``components``: the KFP v2 components (thin bodies that call ``steps``); imports kfp.
* ``pipeline``: ``build_pipeline``, ``compile_pipeline``, ``compile_component``, ``submit``.
* ``local``: ``run_local`` (kfp.local SubprocessRunner, no network).
* ``airflow_dag``: the Airflow 3 DAG (imports Airflow: the ``airflow`` extra);
  ``airflow_task``: its task functions and pod entry point (no Airflow import);
  ``airflow_local``: ``run_airflow_local`` (``dag.test()`` on SQLite, no network).
* ``pytorchjob``: the Training Operator PyTorchJob manifest and its create/wait logic.
* ``images``: the pinned container images (``TRAINER_IMAGE``, ``TOOLS_IMAGE``).
* ``types``: ``GenerationRecord``, ``SecretEnv``, ``StepFailedError``, ``TrainJobFailedError``.

Importing this package does not import kfp, kubernetes, Airflow or torch.
"""

from deltarec.orchestrate.params import PipelineParams, parse_params
from deltarec.orchestrate.types import (
    GenerationRecord,
    SecretEnv,
    StepFailedError,
    TrainJobFailedError,
    default_secrets,
)

__all__ = [
    "GenerationRecord",
    "PipelineParams",
    "SecretEnv",
    "StepFailedError",
    "TrainJobFailedError",
    "default_secrets",
    "parse_params",
]
