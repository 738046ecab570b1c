"""Suite-wide test configuration. Area fixtures live in each tests/<area>/conftest.py."""

import os

# Keep torch from oversubscribing the CI machine's two cores in multi-rank tests.
os.environ.setdefault("OMP_NUM_THREADS", "1")
