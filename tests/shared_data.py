"""Where the project's real test data lives: ``../shared/data`` beside the repository (read-only).

CI lays a copy of ``shared/`` beside the clone; ``LOONGFORGE_SHARED_DATA`` points elsewhere.
"""

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("LOONGFORGE_SHARED_DATA", REPO_ROOT.parent / "shared" / "data"))
