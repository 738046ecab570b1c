#!/bin/sh
# The peers' own virtual environment, bench/peers/.venv (git-ignored, never deltarec's .venv):
# Feast 0.67 with its PostgreSQL and Redis online stores, and py-spy for the profiles.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
python=${PYTHON:-python3}
test -x "$here/.venv/bin/python" || "$python" -m venv "$here/.venv"
"$here/.venv/bin/python" -m pip install --quiet --upgrade pip
"$here/.venv/bin/python" -m pip install --quiet 'feast[postgres,redis]==0.67.0' 'py-spy==0.4.*'
"$here/.venv/bin/python" -c 'import feast; print("feast", feast.__version__)'
