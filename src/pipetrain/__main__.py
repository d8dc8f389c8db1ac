"""``python -m pipetrain …`` (what torchrun's ``-m pipetrain train`` runs)."""

import sys

from pipetrain.cli import main

if __name__ == "__main__":
    sys.exit(main())
