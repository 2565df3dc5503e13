"""Entry point: `python -m services.trainer.main`."""

import os

from services.common.logs import setup_logging
from services.common.service import serve
from services.trainer.settings import TrainerSettings


def main() -> None:
    settings = TrainerSettings()
    os.environ.setdefault("OMP_NUM_THREADS", str(settings.torch_threads))
    setup_logging("trainer", settings.log_level)
    from services.trainer.app import build_app

    serve(build_app(settings), settings.host, settings.port, port_file=settings.port_file)


if __name__ == "__main__":
    main()
