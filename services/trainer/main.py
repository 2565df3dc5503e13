"""Entry point: `python -m services.trainer.main`; with `SPOTRL_TRAINER_RANKS=N` (or under
torchrun) the trainer runs as N ranks: rank 0 the service, the others its followers
(ranks.py)."""

import os
import sys

from services.infra.logs import setup_logging
from services.infra.service import pin_cpus, serve
from services.trainer.settings import TrainerSettings


def main() -> None:
    settings = TrainerSettings()
    os.environ.setdefault("OMP_NUM_THREADS", str(settings.torch_threads))
    pin_cpus(settings.cpus)
    if settings.trainer_ranks > 1 and "RANK" not in os.environ:
        # this process becomes torchrun's agent, which starts the ranks (this module, again)
        args = [
            "--standalone",
            f"--nproc-per-node={settings.trainer_ranks}",
            "-m",
            "services.trainer.main",
        ]
        os.execv(sys.executable, [sys.executable, "-m", "torch.distributed.run", *args])
    from services.trainer import ranks

    if ranks.world_size() == 1:
        setup_logging("trainer", settings.log_level)
        from services.trainer.app import build_app

        serve(build_app(settings), settings, settings.port)
        return
    ranks.init(settings.device)
    if ranks.rank() != 0:
        setup_logging(f"trainer-rank{ranks.rank()}", settings.log_level)
        ranks.follow()
        return
    setup_logging("trainer", settings.log_level)
    from services.trainer.app import build_app

    serve(build_app(settings), settings, settings.port)


if __name__ == "__main__":
    main()
