"""Parsing of option values the way fio reads them.

Sizes take k/m/g/t/p suffixes, base 1024 (fio's default ``kb_base=1024``), with
an optional ``i``/``ib``/``b`` tail: ``4k``, ``4KiB``, ``2m``, ``1.5g``.
Times are seconds unless a unit says otherwise: ``us``, ``ms``, ``s``, ``m``,
``h``. Booleans are ``1``/``0``/``true``/``false``/``yes``/``no``/``on``/``off``,
and a bare option (``time_based``) means true. Every parser raises
:class:`UsageError` naming the option and the value it could not read.
"""
from __future__ import annotations

import re


class UsageError(ValueError):
    """A job file, option or gate that kvperf cannot accept (exit status 2)."""


_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmgtp]?)(i?b?)\s*$", re.IGNORECASE)
_SIZE_SCALE = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50}

_TIME_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(us|ms|s|m|h|d)?\s*$", re.IGNORECASE)
_TIME_SCALE_S = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}

_TRUE = {"1", "true", "yes", "on", ""}
_FALSE = {"0", "false", "no", "off"}


def parse_size(option: str, text: str) -> int:
    """``"2m"`` -> 2097152. A fraction must come out as whole bytes."""
    m = _SIZE_RE.match(text)
    if not m:
        raise UsageError(f"{option}={text!r}: not a size (use a number with an optional k/m/g/t suffix)")
    value = float(m.group(1)) * _SIZE_SCALE[m.group(2).lower()]
    if value != int(value):
        raise UsageError(f"{option}={text!r}: is not a whole number of bytes")
    return int(value)


def parse_time_s(option: str, text: str) -> float:
    """``"500ms"`` -> 0.5; a plain number is seconds, as in fio."""
    m = _TIME_RE.match(text)
    if not m:
        raise UsageError(f"{option}={text!r}: not a time (use a number with an optional us/ms/s/m/h suffix)")
    return float(m.group(1)) * _TIME_SCALE_S[(m.group(2) or "s").lower()]


def parse_bool(option: str, text: str) -> bool:
    low = text.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise UsageError(f"{option}={text!r}: not a boolean (use 1/0, true/false, yes/no, on/off)")


def parse_int(option: str, text: str, minimum: int | None = None, maximum: int | None = None) -> int:
    """An integer that may carry a size suffix (``iodepth=1k`` is fio-legal)."""
    value = parse_size(option, text)
    if minimum is not None and value < minimum:
        raise UsageError(f"{option}={text!r}: must be at least {minimum}")
    if maximum is not None and value > maximum:
        raise UsageError(f"{option}={text!r}: must be at most {maximum}")
    return value


def parse_float(option: str, text: str, minimum: float | None = None, maximum: float | None = None) -> float:
    try:
        value = float(text)
    except ValueError:
        raise UsageError(f"{option}={text!r}: not a number") from None
    if value != value:
        raise UsageError(f"{option}={text!r}: not a number")
    if minimum is not None and value < minimum:
        raise UsageError(f"{option}={text!r}: must be at least {minimum}")
    if maximum is not None and value > maximum:
        raise UsageError(f"{option}={text!r}: must be at most {maximum}")
    return value


def parse_int_list(option: str, text: str, minimum: int = 1) -> tuple[int, ...]:
    """``"1,8,16"`` -> (1, 8, 16); also accepts ``:`` as fio does for lists."""
    parts = [p for p in re.split(r"[,:]", text) if p.strip()]
    if not parts:
        raise UsageError(f"{option}={text!r}: needs at least one number")
    return tuple(parse_int(option, p.strip(), minimum=minimum) for p in parts)


def format_bytes_iec(n: float) -> str:
    """``52428800`` -> ``"50.0MiB"`` (fio's human output)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_bytes_si(n: float) -> str:
    """``52428800`` -> ``"52.4MB"``."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1000
    raise AssertionError("unreachable")
