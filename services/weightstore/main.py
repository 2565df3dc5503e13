"""Entry point: `python -m services.weightstore.main`."""

from services.infra.logs import setup_logging
from services.infra.service import serve
from services.weightstore.settings import WeightStoreSettings


def main() -> None:
    settings = WeightStoreSettings()
    setup_logging("weightstore", settings.log_level)
    from services.weightstore.app import build_app

    serve(build_app(settings), settings, settings.port)


if __name__ == "__main__":
    main()
