"""A scenario that mirrors a local deployment of the services on one machine, for checking the
simulator against the real processes (bench/sim_vs_real.py).

The rollout workers there run the transformers engine on a tiny model with an emulated cost:
after each decode step they sleep `step_delay_ms + step_delay_per_request_ms x batch`
(SPOTRL_STEP_DELAY_MS, SPOTRL_STEP_DELAY_PER_REQUEST_MS). The engine profile is that sleep plus
the engine's own compute by batch, measured beforehand on the engine alone. Responses have a
fixed length (`ignore_eos`), so the workload is exact. The trainer's speed, the weight pulls and
the publication are figures measured on the real run; the seeding controller starts where the
coordinator's does (`SeedingController()`).

It measures nothing itself: every figure comes in a `DeploymentFigures`. It has no node switch
cost (one CPU machine: the reserved worker needs no resharding); `switch_s` is the trainer's
poll of the end of seeding.
"""

from dataclasses import dataclass
from itertools import pairwise

from services.core.seeding import SeedingController
from services.sim.profile import EngineProfile, ModelShape
from services.sim.scenario import CloudModel, Scenario, TrainerModel, TransferModel
from services.sim.workload import ResponseLengthModel

PROFILE_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128)
PROFILE_CONTEXTS = (16, 4096)  # the tiny engine's compute does not grow with context here
TRAINER_POLL_S = 0.02  # the trainer looks for the end of seeding this often (trainer/loop.py)


@dataclass(frozen=True)
class DeploymentFigures:
    """What the simulator needs to know about one local deployment and its run."""

    # the emulated engine cost (settings) and the engine's own compute (measured)
    step_delay_ms: float
    step_delay_per_request_ms: float
    compute_ms: dict[int, float]  # one decode step's compute by batch size, engine alone
    prefill_tokens_per_s: float  # engine alone
    slots: int  # worker_slots
    flush_tokens: int
    heartbeat_ttl_s: float
    # the run spec
    prompts_per_step: int
    group_size: int
    response_tokens: int  # max_new_tokens, with ignore_eos: every response has this length
    prompt_tokens: int  # mean prompt length (tokens)
    # measured on the real run
    train_s: float  # trainer compute of a step: micro-batches + optimizer (no waits, no publish)
    publish_s: float  # export + commit of a version to the weight store
    reserved_pull_s: float  # the reserved worker: new version announced -> loaded
    pool_pull_s: float  # a preemptible worker, the same

    @property
    def tokens_per_step(self) -> int:
        """Tokens the simulated trainer counts: responses plus their prompts, once each."""
        return self.prompts_per_step * self.group_size * (self.response_tokens + self.prompt_tokens)


def compute_at(figures: DeploymentFigures, batch: int) -> float:
    """The measured compute at `batch`, interpolated (flat past the ends)."""
    points = sorted(figures.compute_ms.items())
    if batch <= points[0][0]:
        return points[0][1]
    for (b0, m0), (b1, m1) in pairwise(points):
        if batch <= b1:
            return m0 + (m1 - m0) * (batch - b0) / (b1 - b0)
    return points[-1][1]


def engine_profile(figures: DeploymentFigures) -> EngineProfile:
    def step_ms(batch: int) -> float:
        emulated = figures.step_delay_ms + figures.step_delay_per_request_ms * batch
        return emulated + compute_at(figures, batch)

    return EngineProfile(
        name="emulated-local",
        batch=PROFILE_BATCHES,
        context=PROFILE_CONTEXTS,
        step_ms=tuple(tuple(step_ms(b) for _ in PROFILE_CONTEXTS) for b in PROFILE_BATCHES),
        prefill_tokens_per_s=figures.prefill_tokens_per_s,
        kv_capacity_tokens=10**9,  # a tiny model's cache never fills
        max_seqs=figures.slots,
    )


def scenario(figures: DeploymentFigures) -> Scenario:
    """One reserved engine and preemptible instances with the same engine; a pull is the
    measured pull time whatever the number pulling (the weights are small)."""
    profile = engine_profile(figures)
    controller = SeedingController()
    tokens_per_s = figures.tokens_per_step / max(figures.train_s, 1e-6)
    return Scenario(
        name="local-mirror",
        model=ModelShape("tiny", params=0.0, layers=0, kv_heads=0, head_dim=0),  # unused
        spot_engine=profile,
        reserved_engine=profile,
        reserved_engines=1,
        workload=ResponseLengthModel(
            prompts_per_step=figures.prompts_per_step,
            group_size=figures.group_size,
            median_response_tokens=figures.response_tokens,
            sigma_prompt=0.0,
            sigma_sample=0.0,
            max_response_tokens=figures.response_tokens,
            min_prompt_tokens=figures.prompt_tokens,
            max_prompt_tokens=figures.prompt_tokens,
        ),
        # tokens_per_s = gpus x gpu_flops x mfu / (12 x params): the measured rate
        trainer=TrainerModel(
            params=1.0,
            gpus=1,
            gpu_flops=12 * tokens_per_s,
            mfu=1.0,
            optimizer_s=0.0,  # inside train_s (the step row does not split it out)
            publish_s=figures.publish_s,
        ),
        transfer=TransferModel(weight_bytes=0.0, load_s=figures.pool_pull_s),
        cloud=CloudModel(startup_s=0.0, heartbeat_ttl_s=figures.heartbeat_ttl_s),
        resume_s=figures.reserved_pull_s,  # the reserved worker serves once it loaded the version
        switch_s=TRAINER_POLL_S,
        flush_tokens=figures.flush_tokens,
        initial_t_seed_s=controller.t_seed_s,
        seeding_eta=controller.eta,
    )
