"""The replay's inlined allocator (NOTE [ The replay's allocator, inlined ] in
memory/_allocator.py) against CachingAllocatorModel driven event by event: every number of
every replay the same, on random traces with workspaces, staging buffers, storages made before
the step, kept allocations, requests of 0 bytes and caps that fail, fit and release the cache."""

from __future__ import annotations

import random

import pytest
import torch

from batchwidgets.engine.memory._allocator import (
    MIB,
    STEADY_STEPS,
    CachingAllocatorModel,
    ReplayResult,
    event_bytes,
    replay,
    staging_kind,
)


def _by_the_model(events, cap, preallocated, fraction, steady) -> ReplayResult:
    """The replay as it ran before it was inlined: CachingAllocatorModel's own malloc, free and
    malloc_workspace, event by event."""
    kept = ({key for kind, key, _ in events if kind != "free"}
            - {key for kind, key, _ in events if kind == "free"})
    model, handles, index = CachingAllocatorModel(cap), {}, -1

    def run(kind: str, table: dict, key: int, nbytes: int) -> None:
        if kind == "free":
            model.free(table.pop(key, None))
        elif kind == "workspace":
            table[key] = model.malloc_workspace(nbytes, fraction)
        else:
            table[key] = model.malloc(event_bytes(kind, nbytes))

    try:
        for item in preallocated:
            key, nbytes = item if isinstance(item, tuple) else (None, item)
            handle = model.malloc(nbytes)
            if key is not None:
                handles[key] = handle
        # ``index`` is the event that ran out, for the OOM below (hence the noqa)
        for index, (kind, key, nbytes) in enumerate(events):  # noqa: B007
            run(kind, handles, key, nbytes)
        layout = (model.reserved_bytes, tuple(sorted(model._free)))
        for _ in range(1, STEADY_STEPS if steady else 1):
            mine = {}
            for index, (kind, key, nbytes) in enumerate(events):  # noqa: B007
                if key not in kept:
                    run(kind, mine if key < 0 else handles, key, nbytes)
            now = (model.reserved_bytes, tuple(sorted(model._free)))
            if now == layout:
                break
            layout = now
    except torch.OutOfMemoryError:
        return ReplayResult(model.peak_allocated_bytes, model.peak_reserved_bytes, False, index,
                            True)
    return ReplayResult(model.peak_allocated_bytes, model.peak_reserved_bytes, True, None,
                        model.met_cap)


def _trace(rng: random.Random, n: int) -> list:
    """Allocations of every pool's sizes (some of 0 bytes, some kept), frees in any order and of
    keys made before the step, convolution workspaces and reduction staging buffers; keys below
    zero, as scale_events names them."""
    events, live, key = [], [], 0
    for _ in range(n):
        roll = rng.random()
        if live and roll < 0.42:
            events.append(("free", live.pop(rng.randrange(len(live))), 0))
        elif roll < 0.45:
            events.append(("free", rng.choice([7, 8, 9]), 0))  # made before the step, or never
        else:
            key -= 1
            nbytes = rng.choice([0, rng.randrange(1, 2048), rng.randrange(1, MIB),
                                 rng.randrange(MIB, 12 * MIB), rng.randrange(1, 40 * MIB)])
            if roll < 0.5:
                events.append(("workspace", key, nbytes))
            elif roll < 0.53:
                kind = staging_kind(rng.choice([1, 64, 1000]), rng.random() < 0.5, 4, 108, 2048)
                events.append((kind, key, rng.randrange(1, 10**6)))
            else:
                events.append(("alloc", key, nbytes))
            if rng.random() < 0.9:
                live.append(key)  # the rest stay: made by the first step for the others
    return events


@pytest.mark.parametrize("seed", range(12))
def test_the_inlined_replay_is_the_models_number_for_number(seed):
    rng = random.Random(seed)
    events = _trace(rng, rng.choice([60, 300, 800]))
    preallocated = rng.choice([(), [3 * MIB, 700], [(7, 5 * MIB), 0, (8, 0), 2 * MIB + 1]])
    uncapped = _by_the_model(events, None, preallocated, 0.5, True)
    top = 3 * uncapped.peak_reserved_bytes // 2
    caps = {None, uncapped.peak_reserved_bytes, uncapped.peak_allocated_bytes}
    caps |= {2 * MIB + i * top // 40 for i in range(40)}  # a grid, and caps between
    caps |= {rng.randrange(2 * MIB, top) for _ in range(8)}
    outcomes = set()
    for cap in sorted(caps, key=lambda c: -1 if c is None else c):
        for fraction in (0.5, 1.0):
            for steady in (False, True):
                expected = _by_the_model(events, cap, preallocated, fraction, steady)
                got = replay(events, cap, preallocated=preallocated,
                             workspace_fraction=fraction, steady=steady)
                assert got == expected, (cap, fraction, steady)
                outcomes.add((expected.fits, expected.met_cap))
    assert (True, False) in outcomes  # both ways, on each trace
    assert (False, True) in outcomes


def test_a_step_that_releases_the_cache_and_fits_replays_as_the_model():
    # a 20 MiB segment for 12 MiB, freed; 22 MiB more passes the 30 MiB cap until it goes
    events = [("alloc", -1, 12 * MIB), ("free", -1, 0), ("alloc", -2, 22 * MIB),
              ("workspace", -3, 9 * MIB), ("free", -3, 0), ("free", -2, 0)]
    for steady in (False, True):
        expected = _by_the_model(events, 30 * MIB, [], 0.5, steady)
        assert expected.fits
        assert expected.met_cap
        assert replay(events, 30 * MIB, steady=steady) == expected


@pytest.mark.parametrize("seed", range(6))
def test_a_search_reads_each_cap_as_its_own_replay_would(seed):
    """NOTE [ Caps that run alike ]: whatever the order a search asks its caps in, each answer,
    read from another cap's replay or replayed, is that cap's own replay."""
    from batchwidgets.engine.memory._allocator import _Fitter

    rng = random.Random(seed)
    events = [e for e in _trace(rng, 600) if e[0] != "workspace"]  # caps differ with those
    preallocated = [(7, 5 * MIB), 3 * MIB]
    fits = _Fitter(events, preallocated, 0.5)
    top = fits.uncapped().peak_reserved_bytes + 8 * MIB
    caps = list(range(2 * MIB, top, MIB // 2)) + [rng.randrange(top) for _ in range(40)]
    rng.shuffle(caps)
    for cap in caps:
        assert fits.result(cap) == replay(events, cap, preallocated=preallocated, steady=True)
    assert len(fits._spans) < len(set(caps)) / 2  # most read from another cap's replay


@pytest.mark.parametrize(("batch_a", "batch_b"), [(2, 4), (4, 2), (3, 10), (8, 1)])
def test_scale_events_puts_each_size_on_the_line_rounded_half_up(batch_a, batch_b):
    from batchwidgets.engine.memory._allocator import _affine, scale_events

    rng = random.Random(batch_a * 100 + batch_b)
    shape = [e for e in _trace(rng, 400) if e[0] in ("alloc", "free")]
    a = [(kind, key, rng.randrange(0, 10**9)) if kind == "alloc" else (kind, key, 0)
         for kind, key, _ in shape]
    b = [(kind, key, rng.choice([n, rng.randrange(0, 10**9)])) if kind == "alloc" else
         (kind, key, 0) for (kind, key, _), (_, _, n) in zip(shape, a)]
    for size in (0, 1, batch_a, batch_b, 5, 17, 1000, 2**24):
        scaled = scale_events(a, batch_a, b, batch_b, size)
        assert [n for _, _, n in scaled] == [
            _affine(n_a, batch_a, n_b, batch_b, size) if kind == "alloc" else 0
            for (kind, _, n_a), (_, _, n_b) in zip(a, b)]
