"""Checks the simulator's models against the one end-to-end record the paper's artifact
publishes (PolyRL REPRODUCE.md, Qwen3-8B on OpenR1, 128 x 8, responses up to 14,336 tokens):
veRL alone on one 8xH100 node ~10,000 tokens/s, and with 1/2/3/4 2xH100 rollout workers added
~12,000/14,000/16,000/18,000 tokens/s. Those count prompt and response tokens; so does this.

    .venv/bin/python bench/sim_calibration.py [--steps 10]

Prints a table, then as its LAST line a JSON object: tokens/s for reserved-only and for hybrid
and hybrid-plateau-reads with a fixed pool of k workers, beside the artifact's figures.
"""

import argparse
import json

from services.sim.scenario import artifact_8b
from services.sim.simulation import Simulation
from services.sim.systems import HYBRID_ALL_SPOT, HYBRID_PLATEAU_READS, RESERVED_ONLY

ARTIFACT = {0: 10_000, 1: 12_000, 2: 14_000, 3: 16_000, 4: 18_000}


def all_tokens_per_s(system, workers: int, steps: int) -> float:
    """Prompt + response tokens trained per second, as veRL's perf/throughput counts them."""
    sim = Simulation(artifact_8b(), system, [(0.0, workers)], 0, max_steps=steps).run()
    tokens = sum(r.tokens + r.prompt_tokens for r in sim.records)
    return tokens / sim.records[-1].end_s


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=10)
    steps = p.parse_args().steps
    rows = {
        "0": {"artifact": ARTIFACT[0], "reserved-only": all_tokens_per_s(RESERVED_ONLY, 0, steps)}
    }
    for k in range(1, 5):
        rows[str(k)] = {
            "artifact": ARTIFACT[k],
            "hybrid": all_tokens_per_s(HYBRID_ALL_SPOT, k, steps),  # holding all k workers
            "hybrid-plateau-reads": all_tokens_per_s(HYBRID_PLATEAU_READS, k, steps),
        }
    for k, row in rows.items():
        print(k, "  ".join(f"{name} {v:,.0f}" for name, v in row.items()))
    print(json.dumps({"workers": rows}))


if __name__ == "__main__":
    main()
