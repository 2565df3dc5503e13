"""Entry point: `python -m services.coordinator.main`."""

from services.coordinator.settings import CoordinatorSettings
from services.infra.logs import setup_logging
from services.infra.service import serve


def main() -> None:
    settings = CoordinatorSettings()
    setup_logging("coordinator", settings.log_level)
    from services.coordinator.app import build_app

    serve(build_app(settings), settings, settings.port)


if __name__ == "__main__":
    main()
