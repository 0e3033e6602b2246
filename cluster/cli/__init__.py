"""The ``prefixserve`` command line (the console script is ``cluster.cli:main``).

    main.py   the parser and dispatch of every subcommand
    flags.py  flags generated from the config dataclasses; the strict parser
    up.py     ``prefixserve up``: the local cluster from flags and a config file
"""

from cluster.cli.main import build_parser, main
from cluster.cli.up import up_config

__all__ = ["build_parser", "main", "up_config"]
