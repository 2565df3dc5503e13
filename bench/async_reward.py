"""The reward of bench/async.py's `letters` task (`bench.async_reward:only_letters`, on the
coordinator's reward_modules allow list while the bench runs)."""


def only_letters(prompt: str, response: str, example: dict) -> float:
    """1.0 when the response is a non-empty run of the row's allowed letters, else 0.0."""
    text = response.strip()
    return 1.0 if text and set(text) <= set(example["letters"]) else 0.0
