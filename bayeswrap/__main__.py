"""``python -m bayeswrap ...`` (and ``torchrun --nproc_per_node=N -m bayeswrap fit ...``): the command line."""

import sys

from bayeswrap.app.cli import main

if __name__ == "__main__":
    sys.exit(main())
