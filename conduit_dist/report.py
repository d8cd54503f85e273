"""``python -m conduit_dist.report RUN_DIR``: the command users and scripts type (the report
itself lives in :mod:`conduit_dist.tools.report`)."""

import sys

from conduit_dist.tools.report import main

if __name__ == "__main__":
    sys.exit(main())
