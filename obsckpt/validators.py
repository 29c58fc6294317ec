"""The argument checks shared across obsckpt: each returns the value it accepts.

One naming scheme: ``validate_<what>(value, ...)`` returns the value (normalised
where that helps) or raises ``ValueError``/``TypeError`` naming the value it got
and what to pass instead.
"""

from __future__ import annotations

import operator
import re
from urllib.parse import urlsplit

# Readers hold steps in an int64; a larger number in an iteration file is not a step.
MAX_STEP = 2**63 - 1
_SLOT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def non_negative_int(value: object) -> int | None:
    """``value`` as an int if it is a non-negative integer (numpy's too), else None.

    bool is refused: ``True`` is not a rank, a step or a byte count.
    """
    if isinstance(value, bool):
        return None
    try:
        number = operator.index(value)
    except TypeError:
        return None
    return number if number >= 0 else None


def positive_seconds(value: object) -> bool:
    """Whether ``value`` is a positive number of seconds (an int or float, not a bool)."""
    # bool is an int subclass; NaN fails every comparison, so "> 0" refuses it.
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 0


def validate_step(step: object, what: str = "global_step") -> int:
    """``step`` as an int if it is a non-negative integer, else raise a ValueError naming it.

    Any integer type counts (a NumPy or 0-dim integer tensor step, as hosts pass
    them: whatever ``operator.index`` takes); a bool does not.
    """
    # bool is an int subclass (NumPy's bool_ has its own type); True is not a step.
    try:
        if isinstance(step, bool) or type(step).__name__ == "bool_":
            raise TypeError
        step = operator.index(step)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(
            f"{what} must be a non-negative integer, got {step!r} ({type(step).__name__}); "
            "pass the training step as an int"
        ) from None
    if step < 0:
        raise ValueError(f"{what} must be a non-negative integer, got {step}")
    if step > MAX_STEP:
        raise ValueError(f"{what} must be at most 2**63 - 1, got {step}")
    return step


def validate_slot(name: object) -> str:
    """Return ``name`` if it is safe as a file-name component, else raise a ValueError."""
    if not isinstance(name, str) or not _SLOT_RE.match(name) or name in (".", ".."):
        raise ValueError(
            f"slot name {name!r} is not safe in file and thread names; use 1-128 characters "
            "from letters, digits, '.', '_' and '-', starting with a letter or digit"
        )
    return name


def validate_parts(part: object, parts: object) -> None:
    """Check a part index and part count (both None for a save that is not split)."""
    if part is None and parts is None:
        return
    if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1:
        raise ValueError(
            f"parts must be a positive integer (how many parts, e.g. ranks, make up the save), "
            f"got {parts!r}"
        )
    if isinstance(part, bool) or not isinstance(part, int) or not 0 <= part < parts:
        raise ValueError(
            f"part must be an integer in [0, parts={parts}) (this part's index, e.g. the rank), "
            f"got {part!r}"
        )


def validate_rpc_timeout(value: object) -> float:
    """``value`` as float seconds if it is a positive, finite number; a ValueError names it."""
    if not positive_seconds(value) or value == float("inf"):
        raise ValueError(
            f"rpc_timeout must be a positive, finite number of seconds, got {value!r} "
            "(the default is 300)"
        )
    return float(value)


def validate_rank(
    value: object,
    *,
    whose: str = "this process's rank",
    none: str = " to take it from RANK or torch.distributed",
) -> int | None:
    """``value`` if it is a rank (a non-negative integer, numpy's too) or None.

    ``whose`` and ``none`` say, in the error, whose rank it is and what None means.
    """
    if value is None:
        return None
    rank = non_negative_int(value)  # an int, or one numpy's integer types say is one
    if rank is None:
        raise ValueError(
            f"rank must be a non-negative integer ({whose}) or None{none}, got {value!r}"
        )
    return rank


def validate_url(
    value: object,
    what: str = "",
    *,
    schemes: tuple[str, ...] = ("http", "https"),
    bare: bool = False,
    example: str | None = None,
) -> str:
    """``value`` if it is a URL of one of ``schemes`` with a host (and a port 1-65535 where
    it names one); with ``bare``, ``HOST:PORT`` without a scheme too.

    The ValueError names ``what`` (a flag, a variable, a field; none for argparse, which
    names the flag itself), the value, what is wrong and an example of a good one:
    ``value`` with the first scheme put in front when it is ``HOST:PORT``, else ``example``.
    """
    problem = _url_problem(value, schemes, bare)
    if problem is None:
        return value  # type: ignore[return-value]
    if isinstance(value, str) and not bare and _url_problem(value, schemes, True) is None:
        example = f"{schemes[0]}://{value}"  # HOST:PORT, its scheme left out
    kind = f"a URL ({' or '.join(s + '://' for s in schemes)}){' or HOST:PORT' if bare else ''}"
    good = example or f"{schemes[0]}://HOST:PORT"
    head = f"{what} must be" if what else "must be"
    raise ValueError(f"{head} {kind}, got {value!r} ({problem}); give one like {good}")


def _url_problem(value: object, schemes: tuple[str, ...], bare: bool) -> str | None:
    """What is wrong with ``value`` as :func:`validate_url` takes it, or None."""
    if not isinstance(value, str) or not value:
        return "not a URL"
    if any(c.isspace() for c in value):
        return "whitespace in it"
    scheme, sep, _ = value.partition("://")
    if sep and scheme.lower() not in schemes:
        return f"scheme {scheme}://"
    if not sep and not bare:
        return "no scheme"
    try:
        parts = urlsplit(value if sep else "//" + value)
        host, port = parts.hostname, parts.port
    except ValueError:  # a port that is no number or out of range, a broken [IPv6]
        return "not a URL" if "[" in value else "port not in 1-65535"
    if not host:
        return "no host"
    if port == 0:
        return "port not in 1-65535"
    if port is None and (not sep or parts.netloc.endswith(":")):
        return "no port"  # HOST:PORT without a scheme needs its port
    return None
