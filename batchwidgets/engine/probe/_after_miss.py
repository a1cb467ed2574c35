"""The search after a size ran out of memory where the per-op model said it fits: which size next,
so that what it costs is paid for the meter's error, not for the miss's distance (pure, no model).

Usage:
    >>> from batchwidgets.results import Attempt
    >>> miss = Attempt(1500, False, None, None, predicted_fits=True)
    >>> next_after_oom([Attempt(4, True, 0, 0.1), miss], 1, multiple_of=1, guess=1499)
    993
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from ...results import Attempt

# NOTE [ What a miss may cost ]
# A size P ran out of memory where the model said it fits; lo is the largest size that ran, T the
# true edge (the largest size that runs), all in units of multiple_of, so T is one of the
# B = P - lo candidates lo, ..., P - 1. After P the search may try at most
#     min(ceil(log2(B)) + 2, 2 ceil(log2(P - T + 1)) + 2)
# sizes, at most half of them plus one out of memory (fits f, failures o: o - f <= 2). The first
# term is a bisection's cost (a miss far off, the meter wrong by any factor), the second a walk
# down from P by 1, 3, 7, ... and a bisection of the last step (a miss near), and the OOM share
# asks the search to come up from lo too: a truth at lo + e is reached with at most e + 2
# failures, since only sizes up to T run.
# No fixed order of steps meets the three at once (a walk down from P fails its way to a far
# truth; a bisection takes log2(B) sizes for a truth next to P), so the search keeps a count
# instead. cap(A, k, s, g) is the largest number of candidates whose top one lies g below P that
# a search can still settle after k sizes with s more failures than fits allowed, each candidate
# within its own bound (A = ceil(log2(B)) + 2 the first term): a size x splits them into those
# above x (x runs: k + 1, s + 1) and those below (x fails: k + 1, s - 1, and the top moves down).
# The most candidates go to the side where x runs (the most a search settles grows with g), so
#     cap(k, s, g) = r + cap(k + 1, s - 1, g + r),   r = cap(k + 1, s + 1, g),
# and a single candidate needs no size (k within its bound, s >= 0). Each size the search tries is
# one that leaves both sides within their cap: an interval of sizes, inside which it takes the one
# just past the model's refitted edge g (g + 1 fails, g runs: the edge confirmed) where g is still
# inside the interval after g + 1 failed, else g itself first (g runs, g + 1 fails: one failure, not
# two, where the share has no room for a second: after lo = 4, P = 1500 and 993, g + 1 first cost 6
# sizes for a truth 2 below P, g first 3), nearest the interval if g is outside it, else the size
# next to the miss. So whatever the model says, every truth ends within its bound, with the exact
# edge: a size that ran next to one that failed. cap(0, 2, 0) >= B holds for every B up to 2^18
# (262,144 units); past that the allowed excess of failures is the least s that covers B (3 up to
# 2^31: 1.5 failures past half on the paths that need them), and the sizes stay within the bound.
# tests/engine/probe/test_search.py checks both on every truth for many (lo, P) and whatever the
# model says.
STRICT_EXCESS = 2  # failures past fits: "half of them, plus one"


def allowed_sizes(lo: int, miss: int, truth: int, unit: int = 1) -> int:
    """The bound of NOTE [ What a miss may cost ], for a truth ``truth`` (sizes)."""
    m = unit  # multiple_of
    spread, distance = (miss - lo) // m, (miss - truth) // m
    return min(_ceil_log2(spread) + 2, 2 * _ceil_log2(distance + 1) + 2)


def _ceil_log2(value: int) -> int:
    return (value - 1).bit_length()


def _limit(depth: int, distance: int) -> int:
    """The sizes allowed for a candidate ``distance`` below the miss (A = ``depth``)."""
    return min(depth, 2 * _ceil_log2(distance + 1) + 2)


@functools.cache
def _uniform(depth: int, excess: int) -> int:
    """Candidates settled with ``depth`` sizes left and ``excess`` failures allowed, none with a
    tighter bound of its own."""
    leaf = 1 if excess >= 0 else 0
    if depth <= 0:
        return leaf
    fails, runs = _uniform(depth - 1, excess - 1), _uniform(depth - 1, excess + 1)
    return fails + runs if fails and runs else leaf


@functools.lru_cache(maxsize=1 << 16)
def cap(depth: int, tried: int, excess: int, gap: int) -> int:
    """The most candidates, the top one ``gap`` below the miss, that ``depth - tried`` sizes can
    settle with ``excess`` failures past fits allowed (NOTE [ What a miss may cost ])."""
    if _limit(depth, gap + 1) == depth:  # every candidate below has the first term as its bound
        return _uniform(depth - tried, excess)
    leaf = 1 if excess >= 0 and tried <= _limit(depth, gap + 1) else 0
    if tried >= depth:
        return leaf
    runs = cap(depth, tried + 1, excess + 1, gap)
    fails = cap(depth, tried + 1, excess - 1, gap + runs) if runs else 0
    return runs + fails if runs and fails else leaf


def start_excess(depth: int, spread: int) -> int:
    """The failures past fits a search over ``spread`` candidates is allowed: 2 where it can."""
    return next(s for s in range(STRICT_EXCESS, depth + 3) if cap(depth, 0, s, 0) >= spread)


def next_after_oom(attempts: Sequence[Attempt], miss: int, *, multiple_of: int,
                   guess: int | None) -> int | None:
    """The next size after ``attempts[miss]`` ran out of memory against the prediction, None
    when the edge is known; ``guess``: the model's refitted edge, or None."""
    m = multiple_of
    lo0 = max((a.batch_size for a in attempts[:miss] if a.fits), default=0) // m
    top = attempts[miss].batch_size // m
    after = attempts[miss + 1:]
    lo = max([lo0, *(a.batch_size // m for a in after if a.fits)])
    hi = min([top, *(a.batch_size // m for a in after if not a.fits)])
    if hi - lo <= 1:
        return None
    depth = _ceil_log2(top - lo0) + 2
    fits = sum(a.fits for a in after)
    excess = start_excess(depth, top - lo0) - (len(after) - fits) + fits
    low, high = _window(depth, len(after), excess, lo, hi, top)
    edge = hi - 1 if guess is None else guess // m
    if low <= edge < high:  # past the edge first where the edge may still confirm it: NOTE
        below, above = _window(depth, len(after) + 1, excess - 1, lo, edge + 1, top)
        return (edge + 1 if below <= edge <= above else edge) * m
    return min(max(edge + 1, low), high) * m


def _window(depth: int, tried: int, excess: int, lo: int, hi: int, top: int) -> tuple[int, int]:
    """The sizes that leave both sides within their cap (NOTE [ What a miss may cost ])."""
    gap, spread = top - hi, hi - lo
    most = min(cap(depth, tried + 1, excess + 1, gap), spread - 1)  # above the size: it runs
    least, upper = 1, most
    while least < upper:  # the fewest above, so that those below fit in their cap
        middle = (least + upper) // 2
        if spread - middle <= cap(depth, tried + 1, excess - 1, gap + middle):
            upper = middle
        else:
            least = middle + 1
    if most < 1 or spread - least > cap(depth, tried + 1, excess - 1, gap + least):
        return lo + 1, hi - 1  # outside the count (sizes another policy chose): bisect on
    return hi - most, hi - least
