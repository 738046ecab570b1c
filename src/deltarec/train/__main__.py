"""``python -m deltarec.train ARGS`` is ``deltarec train ARGS`` (what torchrun runs per rank)."""

import sys

from deltarec.cli import main

sys.exit(main(["train", *sys.argv[1:]]))
