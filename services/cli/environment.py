"""The environment the `spotrl` command reads: its home folder and the API token's variable.
Shared by the parser and the subcommands; nothing here does any work."""

import os
from pathlib import Path

from services.infra.settings import CommonSettings, env_name

DEFAULT_HOME = Path(os.environ.get("SPOTRL_HOME", ".spotrl"))
TOKEN_VARIABLE = env_name(CommonSettings, "api_token")
