"""Reward functions of the user-task tests (`tests.data.user_reward:...`, importable from the
repository root, where the tests start the coordinator): what an operator would put on the
coordinator's allow list (SPOTRL_REWARD_MODULES)."""

import math
import os
import time


def sum_is_right(prompt: str, response: str, example: dict) -> float:
    """1.0 when the response is the row's `total`: the rows are sums the tiny model knows."""
    return 1.0 if response.strip() == str(example["total"]) else 0.0


def misbehaves(prompt: str, response: str, example: dict) -> float:
    """Fails the way the row's `kind` says: raise, hang, nan, text, exit; secret: 0.0 when it
    sees a SPOTRL_ variable; else 1.0."""
    kind = example.get("kind")
    if kind == "raise":
        raise ValueError("the reward raised on purpose")
    if kind == "hang":
        time.sleep(3600)
    if kind == "nan":
        return math.nan
    if kind == "text":
        return "1"  # type: ignore[return-value]
    if kind == "exit":
        os._exit(3)
    if kind == "secret":  # 1.0 only when it holds none of the service's credentials
        return 0.0 if any(k.startswith("SPOTRL_") for k in os.environ) else 1.0
    return 1.0


def always_raises(prompt: str, response: str, example: dict) -> float:
    """Raises on every call: a run scored by it would train on zero rewards only."""
    return 1.0 / len(example.get("missing", ""))
