"""Where the tests find the repository and the read-only `../shared` folder beside the checkout."""

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"
PAIR_A = SHARED / "models" / "pair-a"
