"""``python3 -m benchmarks.gpu_check [...]`` from the repository root (:mod:`benchmarks.gpu_check`)."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run from the working tree, not installed
    sys.path.insert(0, str(ROOT))

from benchmarks.gpu_check import main  # noqa: E402

raise SystemExit(main())
