"""``python -m ringcomm ...`` is ``ringcomm-run ...``: the launcher, for environments without the console script."""

import sys

from .launch.launcher import main

sys.exit(main())
