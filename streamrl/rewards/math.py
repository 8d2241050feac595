"""`math` reward: 1.0 when the response's final answer equals the reference numerically or symbolically.

Uses `math-verify` (LaTeX/boxed/plain answers) when installed, else an exact match of the last
number in the response.
"""

from __future__ import annotations

import re
import threading

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:/\d+)?")


def _last_number_matches(response_text: str, answer: str) -> bool:
    numbers = _NUMBER.findall(response_text.replace(",", ""))
    if not numbers:
        return False
    try:
        return abs(_to_float(numbers[-1]) - _to_float(answer.strip())) < 1e-6
    except ValueError:
        return numbers[-1] == answer.strip()


def _to_float(text: str) -> float:
    if "/" in text:
        num, den = text.split("/", 1)
        return float(num) / float(den)
    return float(text)


MATH_VERIFY_TIMEOUT_S = 5  # math-verify's own bound on parsing and on verifying, where it can keep one


def math_reward(response_text: str, answer: str) -> float:
    try:
        from math_verify import parse, verify
    except ImportError:
        return float(_last_number_matches(response_text, answer))
    # math-verify's timeouts use SIGALRM, which works only on a main thread: on in the reward pool's worker
    # processes (the default for this task), off on threads, where the pool's per-call bound still holds.
    timeout = MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    gold, guess = parse(answer, parsing_timeout=timeout), parse(response_text, parsing_timeout=timeout)
    if gold and guess:
        return float(verify(gold, guess, timeout_seconds=timeout))
    return float(_last_number_matches(response_text, answer))
