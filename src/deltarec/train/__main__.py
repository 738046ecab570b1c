"""``python -m deltarec.train ARGS`` is ``deltarec train ARGS`` (what torchrun runs per rank)."""

import sys

from deltarec.train.launch import exit_with_parent, under_torchrun

if under_torchrun():  # end with torchrun, however it ends (it starts ranks in own sessions)
    exit_with_parent()

from deltarec.cli import main

args = sys.argv[1:]
if args[:1] == ["--"]:  # torchrun passes its "--" separator on in some Python versions
    args = args[1:]
sys.exit(main(["train", *args]))
