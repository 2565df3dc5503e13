"""The `spotrl` command line: the entry point. It parses the arguments (`services.cli.parser`),
sets up logging and runs the chosen subcommand's handler, returning its exit code."""

import os
import sys

from services.cli.parser import build_parser
from services.infra.settings import CommonSettings, env_name


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from services.infra.logs import setup_logging

    setup_logging("spotrl", os.environ.get(env_name(CommonSettings, "log_level"), "WARNING"))
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
