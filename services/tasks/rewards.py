"""The built-in rewards: pure functions of a decoded response and the reference answer, each
scoring 1.0 (right) or 0.0. Their names are `runspec.BUILTIN_REWARDS`.

They do not time out on their own: `regex_match` runs a pattern from the run spec and
`boxed_match` runs sympy, so the coordinator runs those two in a reward process it can kill
(services/coordinator/scoring/rewards.py).
"""

import math
import re
from fractions import Fraction

# A number as people write it: sign, digits with thousands commas, decimals, a fraction.
NUMBER = re.compile(r"[-+]?(?:\d[\d,]*)?\.?\d+(?:[eE][-+]?\d+)?(?:/\d+)?")


def exact_match(response: str, answer: str) -> float:
    """1.0 when the response, stripped, is the answer, stripped."""
    return 1.0 if response.strip() == answer.strip() else 0.0


def parse_number(text: str) -> float | None:
    """`text` as a number (`1,234`, `-0.5`, `3/4`, `1e3`), or None."""
    text = text.strip().replace(",", "")
    try:
        if "/" in text:
            return float(Fraction(text))
        return float(text)
    except (ValueError, ZeroDivisionError, OverflowError):
        return None


def numeric_match(response: str, answer: str, tolerance: float) -> float:
    """1.0 when the last number in the response is within `tolerance` of the answer's."""
    want = parse_number(answer)
    if want is None:
        raise ValueError("the reference answer is not a number")
    found = NUMBER.findall(response)
    got = parse_number(found[-1]) if found else None
    if got is None or not math.isfinite(got):
        return 0.0
    return 1.0 if abs(got - want) <= tolerance else 0.0


def regex_match(response: str, answer: str, pattern: str) -> float:
    """1.0 when the last match of `pattern` in the response (its first group when it has
    groups) is the answer, both stripped."""
    matches = list(re.finditer(pattern, response))
    if not matches:
        return 0.0
    last = matches[-1]
    found = last.group(1) if last.re.groups else last.group(0)
    return exact_match(found or "", answer)


def boxed_match(response: str, answer: str) -> float:
    """1.0 when math_verify finds the answer's value in the response (a boxed expression,
    LaTeX, or the last number). Its own signal-based timeouts are off: they only work in a
    main thread; the caller bounds the time."""
    from math_verify import parse, verify

    gold = parse(answer, parsing_timeout=None) or parse(f"${answer}$", parsing_timeout=None)
    guess = parse(response, parsing_timeout=None)
    if not gold or not guess:
        return 0.0
    return 1.0 if verify(gold, guess, timeout_seconds=None) else 0.0
