"""argparse `type=` functions for numeric flags: a bad value is argparse's one-line error naming the flag
("argument --nodes: invalid positive_int value: '0'" reads poorly, so each raises ArgumentTypeError with the
reason), never a traceback and never a nonsense value accepted."""
from __future__ import annotations

import argparse
import math


def _number(text: str, kind):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
    if kind is float and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r}: must be a finite number")
    return value


def positive_int(text: str) -> int:
    value = _number(text, int)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be an integer >= 1")
    return value


def fraction(text: str) -> float:
    """A number in [0, 1] (e.g. offload_optimizer.ratio)."""
    value = _number(text, float)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be a number in [0, 1]")
    return value


def positive_float(text: str) -> float:
    value = _number(text, float)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be a number > 0")
    return value
