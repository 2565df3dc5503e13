"""Entry point: `python -m services.rollout.main`."""

import os

from services.infra.logs import setup_logging
from services.infra.service import pin_cpus, serve
from services.rollout.settings import RolloutSettings

HTTP_CLOSE_SHARE, HTTP_CLOSE_MAX_S = 0.05, 0.5  # of the grace period, before the leaving starts


def main() -> None:
    settings = RolloutSettings()
    os.environ.setdefault("OMP_NUM_THREADS", str(settings.torch_threads))
    pin_cpus(settings.cpus)
    setup_logging(f"rollout[{settings.worker_id}]", settings.log_level)
    from services.rollout.app import build_app

    serve(
        build_app(settings),
        settings,
        settings.port,
        # open HTTP requests (status, metrics) get little: the lifespan's leaving, which must
        # fit in the grace period (services.rollout.grace), starts only once they are done
        min(HTTP_CLOSE_MAX_S, HTTP_CLOSE_SHARE * settings.preempt_grace_s),
    )


if __name__ == "__main__":
    main()
elif __name__ == "__mp_main__":  # a process vLLM spawned from this worker: its engine
    from services.rollout.lifeline import tie_to_parent

    tie_to_parent()
