"""``python -m cluster.cli``: the ``prefixserve`` command."""

import sys

from cluster.cli.main import main

sys.exit(main())
