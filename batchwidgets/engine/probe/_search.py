"""The probe's search policy, apart from any model: which batch size to try next.

Usage:
    >>> from batchwidgets.results import Attempt
    >>> next_batch_size([], start=1, multiple_of=1, ceiling=1024, limit_bytes=None)
    1
    >>> next_batch_size([Attempt(1, True, None, 0.1)], start=1, multiple_of=1, ceiling=1024,
    ...                 limit_bytes=None)
    2
"""

from __future__ import annotations

from collections.abc import Sequence

from ...results import Attempt, MemoryModel
from ._after_miss import next_after_oom

# NOTE [ Predict, then verify ]
# With the per-op model (NOTE [ Every op's live bytes are affine in the batch size ] in
# memory/_trace.py) the search is: two small sizes (start, then twice start), the largest size the
# model says fits, and the next size to confirm it does not: four sizes and one out-of-memory
# error when the model is right. Each size that runs refits the model on the two largest sizes
# traced; a miss (a size that went the other way than predicted) hands the search to NOTE
# [ After a miss ], which tries the model once more at most; while there is no model (the op
# sequences of two sizes differ), the search below decides.
#
# Without the per-op model, peak memory of a training step is close to
# max(plateau, fixed + per_sample * batch_size): at
# small sizes a constant part (weight gradients, optimizer temporaries) hides the per-sample
# growth, so a line through two small sizes can be far off. The probe therefore gallops (x2 while
# memory does not move, x8 once it does) until the three largest sizes that ran agree on one line
# (slopes within SLOPE_AGREEMENT, and a growth that is not rounding noise). Then it jumps to the
# largest size the line says fits under the limit, and tries one step past it, so the boundary is
# confirmed by two sizes that ran: the one that fits and the next one that does not. A jump goes
# at most FIT_SPREAD x the largest size that ran: three small sizes can all lie on the plateau's
# own slope (the input batch's bytes, say), and that line, extrapolated a hundredfold, lands far
# past the boundary, where every try after it runs out of memory. Each new measurement refits on
# the sizes nearest the boundary. When memory is not linear (allocator rounding, workspaces) a
# prediction can miss; after MAX_SURPRISES misses, or while no line can be trusted, the search
# bisects the bracket (nudged toward the line, never past its middle half), so the bracket shrinks
# by a quarter or more each try and ends on the exact boundary.
GALLOP = 2
FIT_SPREAD = 8
SLOPE_AGREEMENT = 0.10  # relative difference of the two slopes
MIN_GROWTH = 0.02  # growth between the two largest sizes, relative to the larger peak
MAX_SURPRISES = 2
MAX_MISSES = 2  # of the fake search, which keeps predicting after a miss (its sizes run nothing)

# NOTE [ After a miss ]
# A real size P that went the other way than the per-op model predicted says the model is off
# near the boundary (allocator rounding, a meter that counts a little otherwise than the device,
# a workspace the trace cannot see, a device whose count no meter sees), by an amount nothing
# says: a sample, or a factor of a million. From then on the search keeps the bracket (lo, hi)
# of what ran and what failed, and tries each size once:
# - P ran out of memory: the sizes of NOTE [ What a miss may cost ] in _after_miss.py, which
#   come up from lo and down from P at once, each the one nearest the refitted model's edge
#   that keeps every truth T within min(ceil(log2(P - lo)) + 2, 2 ceil(log2(P - T + 1)) + 2)
#   sizes, at most half of them plus one out of memory: a far miss costs a bisection, a near
#   one a walk from P, whatever the model says;
# - P ran (the boundary lies above it): the pair, once: q, the first size the refitted model
#   says fails (its edge + m, where no size tried belies the edge), then q's neighbour across
#   the edge, q + m where q ran, q - m where q failed before any step; else steps out from A,
#   the largest size that ran when the first step is taken (P, or the pair where it ran):
#   A + m, 3m, 7m, ..., each doubling the distance proven, never past the bracket's middle,
#   until one fails; then bisection of what is left.
# The bound of the second. Let d be the distance from P to the nearest size that fails (in units of
# m), d' <= d the same from A. The steps at offsets 2^j - 1 first fail at j = t = ceil(log2(d' + 1))
# and leave 2^(t-1) - 1 sizes between offsets 2^(t-1) - 1 and 2^t - 1, which bisection settles in t
# - 1 tries: 2t - 1 sizes. Where the middle stops a step, less than twice the distance proven is
# left, which bisection settles within the same count. The pair costs 2 sizes at most, and leaves a
# narrower bracket or a step further out. So after P at most 2 ceil(log2(d + 1)) + 2 sizes, and the
# answer is exact: a size that ran next to one that failed. tests/engine/probe/test_search.py checks
# both for every size the model could choose. A fake size that misses costs no step: the fake search
# predicts on, up to MAX_MISSES misses.
WINDOW = 16  # after a miss the model refits on a real size at least P/16 below P


def misses(attempts: Sequence[Attempt]) -> int:
    """How many sizes went the other way than the per-op model predicted."""
    return sum(_missed(a) for a in attempts)


def first_miss(attempts: Sequence[Attempt]) -> int | None:
    """Index of the first real size that went the other way than predicted, None if none did
    (a fake size that misses costs no step: the fake search predicts on, NOTE [ After a miss ])."""
    return next((i for i, a in enumerate(attempts) if _missed(a) and not a.fake), None)


def _missed(attempt: Attempt) -> bool:
    return attempt.predicted_fits is not None and attempt.predicted_fits != attempt.fits


def _measured(attempts: Sequence[Attempt]) -> list[Attempt]:
    """Sizes that ran with memory measured, one per size, smallest first."""
    by_size = {a.batch_size: a for a in attempts if a.fits and _peak(a) is not None}
    return [by_size[size] for size in sorted(by_size)]


def _slope(small: Attempt, large: Attempt) -> float:
    return (_peak(large) - _peak(small)) / (large.batch_size - small.batch_size)


def fit_memory(attempts: Sequence[Attempt]) -> MemoryModel | None:
    """Line through the two largest sizes that ran with memory measured; None if under two."""
    measured = _measured(attempts)
    if len(measured) < 2:
        return None
    per_sample = _slope(measured[-2], measured[-1])
    return MemoryModel(fixed_bytes=_peak(measured[-1]) - per_sample * measured[-1].batch_size,
                       per_sample_bytes=per_sample)


def _line_is_trusted(attempts: Sequence[Attempt]) -> bool:
    """The three largest measured sizes lie on one rising line (NOTE [ Predict, then verify ])."""
    measured = _measured(attempts)
    if len(measured) < 3:
        return False
    a, b, c = measured[-3:]
    low, high = _slope(a, b), _slope(b, c)
    return (high > 0 and abs(high - low) <= SLOPE_AGREEMENT * high
            and _peak(c) - _peak(b) >= MIN_GROWTH * _peak(c))


def _memory_moves(attempts: Sequence[Attempt]) -> bool:
    measured = _measured(attempts)
    return len(measured) >= 2 and _peak(measured[-1]) > _peak(measured[0])


def _peak(attempt: Attempt) -> int | None:
    """The figure the line is fitted on: the forward+backward peak where the step was split in
    phases (NOTE [ Two phases ] in memory/_meters.py), else the reserved peak, else the tensor
    peak."""
    if attempt.activation_peak_bytes is not None:
        return attempt.activation_peak_bytes
    if attempt.peak_reserved_bytes is not None:
        return attempt.peak_reserved_bytes
    return attempt.peak_memory_bytes


def memory_stayed_flat(attempts: Sequence[Attempt]) -> bool:
    """True when the step's peak memory grew by less than one byte per extra sample between the
    smallest and the largest size that fit: the batch size never reached the model (a
    make_batch that ignores its argument, a step that allocates nothing)."""
    fitted = [a for a in attempts if a.fits]
    if len(fitted) < 2:
        return False
    small = min(fitted, key=lambda a: a.batch_size)
    large = max(fitted, key=lambda a: a.batch_size)
    grew = (large.peak_memory_bytes or 0) - (small.peak_memory_bytes or 0)
    return grew < large.batch_size - small.batch_size


def bracket(attempts: Sequence[Attempt]) -> tuple[int, int | None]:
    """(largest size that ran, smallest size that failed) so far; 0 and None when unknown."""
    ran = [a.batch_size for a in attempts if a.fits]
    failed = [a.batch_size for a in attempts if not a.fits]
    return max(ran, default=0), min(failed, default=None)


def _surprises(attempts: Sequence[Attempt], limit_bytes: int) -> int:
    """How many tries made on a trusted line went the other way than it predicted."""
    count = 0
    for i in range(3, len(attempts)):
        model = fit_memory(attempts[:i])
        if model is None or not _line_is_trusted(attempts[:i]):
            continue
        predicted_fit = model.predict_bytes(attempts[i].batch_size) <= limit_bytes
        count += predicted_fit != attempts[i].fits
    return count


def next_batch_size(attempts: Sequence[Attempt], *, start: int, multiple_of: int, ceiling: int,
                    limit_bytes: int | None, predicted: int | None = None) -> int | None:
    """The next size to try, or None when the boundary is known (see NOTE [ Predict, then verify ]).

    The first size is ``start``; sizes are multiples of ``multiple_of`` and at most ``ceiling``;
    ``limit_bytes`` is the memory the step may use, or None to search by out-of-memory alone;
    ``predicted`` is the largest size the per-op model says fits, None without a model.
    """
    m = multiple_of
    if not attempts:  # a fake search's answer, when there was one (NOTE [ A free first guess ])
        return start if predicted is None else min(max(predicted // m * m, m), ceiling)
    lo, hi = bracket(attempts)
    miss = first_miss(attempts)
    if miss is not None:
        return _after_miss(attempts, miss, predicted, m, ceiling)
    if lo == 0:  # nothing ran yet: halve down to multiple_of, then give up
        return None if hi <= m else max(m, hi // 2 // m * m)
    top = _top(hi, m, ceiling)
    if lo >= top:
        return None
    if predicted is not None and misses(attempts) < MAX_MISSES and (hi is None or predicted < hi):
        guess = lo + m if predicted <= lo else predicted // m * m
        return min(max(guess, lo + m), top)
    model = fit_memory(attempts)
    line = (None if model is None or limit_bytes is None
            else model.largest_batch_size(limit_bytes, m))
    if line is not None and _line_is_trusted(attempts) \
            and _surprises(attempts, limit_bytes) < MAX_SURPRISES:
        # lo is the boundary? confirm with the next size. Jump at most FIT_SPREAD x lo (see the
        # NOTE): three small sizes can agree on the plateau's slope, not the per-sample line.
        guess = lo + m if line == lo else min(line, FIT_SPREAD * lo)
    elif hi is None and not _memory_moves(attempts):
        guess = GALLOP * lo  # nothing to measure: gallop
    elif hi is None:  # an untrusted line still says how far to go: between x2 and x8
        guess = min(max(line or 0, GALLOP * lo), FIT_SPREAD * lo)
    else:  # bisect, moved toward the line but keeping a quarter of the bracket on each side
        quarter = (hi - lo) // 4
        guess = (lo + hi) // 2 if line is None else min(max(line, lo + quarter), hi - quarter)
        guess = guess // m * m
    return min(max(guess, lo + m), top)


def _top(hi: int | None, multiple_of: int, ceiling: int) -> int:
    """The largest size still worth a try: below the smallest failure, at most the ceiling."""
    return min(ceiling, hi - multiple_of) if hi is not None else ceiling


def _after_miss(attempts: Sequence[Attempt], miss: int, predicted: int | None, m: int,
                ceiling: int) -> int | None:
    """After an OOM the model did not predict, NOTE [ What a miss may cost ]; after a size that
    ran against the prediction, the pair or a step out, then bisection (NOTE [ After a miss ])."""
    lo, hi = bracket(attempts)
    top = _top(hi, m, ceiling)
    if lo >= top:
        return None
    edge = None if predicted is None else predicted // m * m
    if not attempts[miss].fits:
        return next_after_oom(attempts, miss, multiple_of=m, guess=edge)
    kinds, anchor = _after_miss_so_far(attempts, miss, m, ceiling)
    if kinds.count("pair") == 1 and kinds[-1] == "pair" and (attempts[-1].fits or anchor is None):
        second = attempts[-1].batch_size + (m if attempts[-1].fits else -m)  # across the edge
        if lo < second <= top:
            return second
    if "pair" not in kinds and edge is not None and lo <= edge and (hi is None or edge < hi):
        return min(edge + m, top)  # the first size the model says fails, where nothing belies it
    return _step_or_bisect(attempts, anchor, m, ceiling)


def _step_or_bisect(attempts: Sequence[Attempt], anchor: int | None, m: int,
                    ceiling: int) -> int:
    """Up from ``anchor`` (None: the largest size that ran) by m, 3m, 7m, ..., never past the
    bracket's middle, until a step fails; then the middle."""
    lo, hi = bracket(attempts)
    top = _top(hi, m, ceiling)
    step = lo + (lo - (lo if anchor is None else anchor)) + m  # twice as far from the anchor
    if hi is None:
        return min(step, top)
    return min(step, min(max((lo + hi) // 2 // m * m, lo + m), top))


def _after_miss_so_far(attempts: Sequence[Attempt], miss: int, m: int,
                       ceiling: int) -> tuple[list[str], int | None]:
    """What each size after a miss that ran was: "pair" or "step" (a step or a bisection; a
    size a step would have been too counts as one), and where the steps started from (None:
    none yet), the largest size that ran when the first step was taken."""
    kinds: list[str] = []
    anchor = None
    for i in range(miss + 1, len(attempts)):
        before = attempts[:i]
        if attempts[i].batch_size == _step_or_bisect(before, anchor, m, ceiling):
            kinds.append("step")
            anchor = bracket(before)[0] if anchor is None else anchor
        else:
            kinds.append("pair")
    return kinds, anchor
