"""Entry point: `python -m services.rollout.main`."""

import os

from services.common.logs import setup_logging
from services.common.service import pin_cpus, serve
from services.rollout.settings import RolloutSettings


def main() -> None:
    settings = RolloutSettings()
    os.environ.setdefault("OMP_NUM_THREADS", str(settings.torch_threads))
    pin_cpus(settings.cpus)
    setup_logging(f"rollout[{settings.worker_id}]", settings.log_level)
    from services.rollout.app import build_app

    serve(
        build_app(settings),
        settings.host,
        settings.port,
        settings.preempt_grace_s,
        settings.port_file,
    )


if __name__ == "__main__":
    main()
elif __name__ == "__mp_main__":  # a process vLLM spawned from this worker: its engine
    from services.rollout.lifeline import tie_to_parent

    tie_to_parent()
