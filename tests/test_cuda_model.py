"""The caching-allocator model against hand-computed layouts, trace replay and scaling against
brute force, and the simulated CUDA device against the predictions made from two small sizes."""

from __future__ import annotations

import random

import pytest
import torch

from batchwidgets.engine import _memory
from batchwidgets.engine._cuda_model import (
    CUDA_CONTEXT_BYTES,
    GPU_TARGETS,
    MIB,
    CachingAllocatorModel,
    largest_batch_size,
    parse_target,
    replay,
    scale_events,
)
from batchwidgets.engine._cuda_sim import (
    NO_WORKSPACES,
    SimulatedCudaMeter,
    Workspaces,
    preallocated_sizes,
    record_events,
)
from batchwidgets.engine._meters import Reading

KIB = 1024


# -- the allocator model ----------------------------------------------------------------------
def test_requests_round_up_to_512_bytes_in_2_mib_small_segments():
    model = CachingAllocatorModel()
    assert model.malloc(0) is None
    assert model.reserved_bytes == 0
    model.malloc(1)
    assert (model.allocated_bytes, model.reserved_bytes) == (512, 2 * MIB)
    model.malloc(513)
    assert (model.allocated_bytes, model.reserved_bytes) == (512 + 1024, 2 * MIB)
    model.malloc(MIB)  # the largest small request still fits the same 2 MiB segment
    assert (model.allocated_bytes, model.reserved_bytes) == (1536 + MIB, 2 * MIB)
    model.malloc(MIB)  # 1 MiB - 1536 B left: a second small segment
    assert (model.reserved_bytes, model.n_segments) == (4 * MIB, 2)


@pytest.mark.parametrize(("request_bytes", "segment", "allocated"), [
    (MIB + 1, 20 * MIB, MIB + 512),  # just over 1 MiB: the large pool's 20 MiB segment
    (10 * MIB - 512, 20 * MIB, 10 * MIB - 512),  # still under 10 MiB
    (10 * MIB, 10 * MIB, 10 * MIB),  # from 10 MiB: its own size rounded up to 2 MiB
    (10 * MIB + 1, 12 * MIB, 10 * MIB + 512),  # rest of 2 MiB - 512 B > 1 MiB: split off
    (11 * MIB, 12 * MIB, 12 * MIB),  # rest of 1 MiB is not > 1 MiB: the whole block is handed out
])
def test_large_requests_get_20_mib_segments_under_10_mib_and_their_own_size_above(
        request_bytes, segment, allocated):
    model = CachingAllocatorModel()
    model.malloc(request_bytes)
    assert (model.reserved_bytes, model.allocated_bytes) == (segment, allocated)


def test_split_blocks_are_reused_and_freed_neighbours_merge():
    model = CachingAllocatorModel()
    a, b, c = model.malloc(3 * MIB), model.malloc(4 * MIB), model.malloc(5 * MIB)
    assert model.reserved_bytes == 20 * MIB  # all three split from one segment; 8 MiB left
    model.free(b)  # free: 4 MiB (b) and the 8 MiB tail
    model.malloc(6 * MIB)  # best fit is the tail; its 2 MiB rest is split off
    assert model.reserved_bytes == 20 * MIB
    model.free(a)  # merges with b's 4 MiB into 7 MiB at the start of the segment
    model.malloc(7 * MIB)
    assert (model.reserved_bytes, model.allocated_bytes) == (20 * MIB, 18 * MIB)
    model.free(c)
    model.empty_cache()  # the segment still holds two blocks: nothing to release
    assert model.reserved_bytes == 20 * MIB


def test_a_wholly_freed_segment_merges_back_and_empty_cache_releases_it():
    model = CachingAllocatorModel()
    blocks = [model.malloc(size * MIB) for size in (2, 3, 4, 5)]
    for block in blocks[::2] + blocks[1::2]:  # out of order: merging must close every gap
        model.free(block)
    assert (model.allocated_bytes, model.reserved_bytes) == (0, 20 * MIB)
    assert model.malloc(20 * MIB - 512) is not None  # one 20 MiB free block again
    assert model.reserved_bytes == 20 * MIB
    model = CachingAllocatorModel()
    model.free(model.malloc(5 * MIB))
    model.empty_cache()
    assert model.reserved_bytes == 0


def test_best_fit_takes_the_smallest_free_block_that_is_large_enough():
    model = CachingAllocatorModel()
    a1 = model.malloc(3 * MIB)
    model.malloc(17 * MIB)  # takes the rest of segment A exactly
    b1 = model.malloc(6 * MIB)  # segment B
    model.malloc(14 * MIB)
    model.free(a1)
    model.free(b1)  # free blocks: 3 MiB in A, 6 MiB in B
    allocated = model.allocated_bytes
    model.malloc(5 * MIB // 2)  # best fit is A's 3 MiB, and its 0.5 MiB rest stays with it
    assert model.allocated_bytes - allocated == 3 * MIB
    model.malloc(4 * MIB)  # B's 6 MiB, split: 2 MiB > 1 MiB
    assert model.allocated_bytes - allocated == 7 * MIB
    assert model.reserved_bytes == 40 * MIB


def test_out_of_memory_only_after_cached_segments_are_released():
    model = CachingAllocatorModel(cap_bytes=40 * MIB)
    model.free(model.malloc(12 * MIB))  # a cached 12 MiB segment
    model.malloc(15 * MIB)  # a 16 MiB segment, handed out whole (1 MiB rest is not > 1 MiB)
    assert (model.reserved_bytes, model.allocated_bytes) == (28 * MIB, 16 * MIB)
    model.malloc(13 * MIB)  # 28 + 14 > 40: the cached segment goes back, then it fits
    assert (model.reserved_bytes, model.allocated_bytes) == (30 * MIB, 30 * MIB)
    with pytest.raises(torch.OutOfMemoryError) as error:
        model.malloc(4 * MIB)  # needs a 20 MiB segment: 30 + 20 > 40, nothing cached to release
    message = str(error.value)
    assert message.startswith("CUDA out of memory (batchwidgets' simulated device)")
    assert "Tried to allocate 20.00 MiB" in message
    assert "cap 40.00 MiB" in message
    assert _memory.is_oom(error.value)
    assert (model.reserved_bytes, model.allocated_bytes) == (30 * MIB, 30 * MIB)
    model.malloc(10 * MIB)  # a larger request fits: its segment is its own 10 MiB
    assert model.reserved_bytes == 40 * MIB


def test_peaks_follow_the_high_water_mark_until_reset():
    model = CachingAllocatorModel()
    big = model.malloc(30 * MIB)
    small = model.malloc(KIB)
    model.free(big)
    assert (model.peak_allocated_bytes, model.peak_reserved_bytes) == (30 * MIB + KIB, 32 * MIB)
    model.reset_peaks()
    assert (model.peak_allocated_bytes, model.peak_reserved_bytes) == (KIB, 32 * MIB)
    model.free(small)
    model.empty_cache()
    model.reset_peaks()
    assert (model.peak_allocated_bytes, model.peak_reserved_bytes) == (0, 0)


# -- traces -------------------------------------------------------------------------------------
def _random_trace(rng: random.Random, n: int, scale: int = 4 * MIB) -> list:
    events, live, key = [], [], 100
    for _ in range(n):
        if live and rng.random() < 0.45:
            events.append(("free", live.pop(rng.randrange(len(live))), 0))
        else:
            key += 1
            live.append(key)
            events.append(("alloc", key, rng.choice([rng.randrange(1, 2048),
                                                     rng.randrange(1, scale), 0])))
    return events


@pytest.mark.parametrize("seed", range(4))
def test_replay_equals_driving_the_model_by_hand(seed):
    rng = random.Random(seed)
    events = _random_trace(rng, 400)
    preallocated = [3 * MIB, 700]
    for cap in (None, 64 * MIB, 30 * MIB):
        model, handles, failed_at = CachingAllocatorModel(cap), {}, None
        for size in preallocated:
            model.malloc(size)
        for index, (kind, key, nbytes) in enumerate(events):
            try:
                if kind == "alloc":
                    handles[key] = model.malloc(nbytes)
                else:
                    model.free(handles.pop(key))
            except torch.OutOfMemoryError:
                failed_at = index
                break
        result = replay(events, cap, preallocated=preallocated)
        assert (result.peak_allocated_bytes, result.peak_reserved_bytes, result.fits,
                result.failed_at) == (model.peak_allocated_bytes, model.peak_reserved_bytes,
                                      failed_at is None, failed_at)
    assert not replay(events, 30 * MIB).fits  # the case above that runs out does run out


def test_replay_frees_preallocated_storages_given_with_their_keys():
    events = [("free", 7, 0), ("alloc", 1, 15 * MIB)]
    assert replay(events, 20 * MIB, preallocated=[(7, 8 * MIB)]).fits
    assert replay(events, 20 * MIB, preallocated=[8 * MIB]).failed_at == 1  # 8 MiB stays
    assert replay(events, 10 * MIB, preallocated=[(7, 8 * MIB)]).failed_at == -1


def _affine_trace(batch_size: int, seed: int, n: int = 300) -> list:
    """A trace whose i-th allocation is a_i + b_i * batch_size, keys drawn anew at every size."""
    rng = random.Random(seed)
    keys = random.Random(batch_size).sample(range(10**6), n)
    shape = _random_trace(rng, n)
    sizes = {key: (rng.randrange(0, 4 * MIB), rng.choice([0, 0, 512, rng.randrange(1, 64 * KIB)]))
             for kind, key, _ in shape if kind == "alloc"}
    rename = {}
    events = []
    for kind, key, _ in shape:
        if kind == "alloc":
            rename[key] = keys.pop()
            a, b = sizes[key]
            events.append(("alloc", rename[key], a + b * batch_size))
        else:
            events.append(("free", rename[key], 0))
    return events


def _canonical(events: list) -> list:
    """Keys renamed by the position of their allocation, so traces compare as sequences."""
    where, out = {}, []
    for position, (kind, key, nbytes) in enumerate(events):
        if kind == "alloc":
            where[key] = position
            out.append(("alloc", position, nbytes))
        else:
            out.append(("free", where.pop(key), 0))
    return out


@pytest.mark.parametrize("seed", range(3))
def test_scale_events_is_exact_on_affine_traces(seed):
    a, b = _affine_trace(2, seed), _affine_trace(4, seed)
    for batch_size in (1, 3, 37, 1000):
        scaled = scale_events(a, 2, b, 4, batch_size)
        assert _canonical(scaled) == _canonical(_affine_trace(batch_size, seed))
    assert _canonical(scale_events(b, 4, a, 2, 37)) == _canonical(_affine_trace(37, seed))


def test_scale_events_refuses_traces_that_do_not_correspond():
    a = [("alloc", 1, 100), ("alloc", 2, 50), ("free", 1, 0)]
    assert scale_events(a, 2, a[:2], 4, 8) is None  # another length
    assert scale_events(a, 2, [("alloc", 1, 200), ("free", 1, 0), ("alloc", 2, 100)], 4,
                        8) is None  # another kind at a position
    assert scale_events(a, 2, [("alloc", 1, 200), ("alloc", 2, 100), ("free", 2, 0)], 4,
                        8) is None  # frees another allocation
    assert scale_events(a, 2, [("alloc", 9, 200), ("alloc", 8, 100), ("free", 9, 0)], 4,
                        8) == [("alloc", -1, 400), ("alloc", -2, 200), ("free", -1, 0)]
    with pytest.raises(ValueError, match="batch_b should differ"):
        scale_events(a, 2, a, 2, 8)


def _brute_force(a, b, cap, multiple_of=1, ceiling=400, preallocated=()):
    fitting = [k for k in range(multiple_of, ceiling + 1, multiple_of)
               if replay(scale_events(a, 2, b, 4, k), cap, preallocated=preallocated).fits]
    return max(fitting, default=0)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("multiple_of", [1, 8])
def test_largest_batch_size_matches_brute_force(seed, multiple_of):
    a, b = _affine_trace(2, seed, n=120), _affine_trace(4, seed, n=120)
    for cap in (24 * MIB, 100 * MIB, 400 * MIB):
        found = largest_batch_size(a, 2, b, 4, cap, multiple_of=multiple_of, ceiling=400,
                                   preallocated=[5 * MIB])
        assert found == _brute_force(a, b, cap, multiple_of, preallocated=[5 * MIB])
    assert largest_batch_size(a, 2, b, 4, MIB) == 0


def test_largest_batch_size_finds_sizes_past_the_10_mib_rule():
    # x = 64 KiB per sample next to a constant 12 MiB, under a 30 MiB cap: x up to 1 MiB fits
    # in a small segment, from 1 to 10 MiB its 20 MiB segment does not, from 10 MiB to 18 MiB
    # its own segment does again. Bisection alone would stop at 16.
    def trace(batch_size):
        return [("alloc", 1, 12 * MIB), ("alloc", 2, 64 * KIB * batch_size), ("free", 2, 0)]
    found = largest_batch_size(trace(2), 2, trace(4), 4, 30 * MIB, ceiling=1000)
    assert found == _brute_force(trace(2), trace(4), 30 * MIB, ceiling=1000) == 288
    assert largest_batch_size(trace(2), 2, trace(4), 4, 30 * MIB, overhead_bytes=MIB,
                              ceiling=1000) == 256


def test_largest_batch_size_refuses_traces_that_do_not_correspond():
    with pytest.raises(ValueError, match="same ops"):
        largest_batch_size([("alloc", 1, 10)], 2, [], 4, MIB)


# -- targets ------------------------------------------------------------------------------------
@pytest.mark.parametrize(("value", "name"), [
    ("a100", "A100-40GB"), ("A100-40GB", "A100-40GB"), ("a100 40gb", "A100-40GB"),
    ("NVIDIA A100 80GB", "A100-80GB"), ("t4", "T4"), ("Tesla V100", "V100-16GB"),
    ("v100_32g", "V100-32GB"), ("h100", "H100-80GB"), ("H200", "H200"), ("a10g", "A10G"),
])
def test_parse_target_reads_gpu_names(value, name):
    assert parse_target(value) == (name, GPU_TARGETS[name] - CUDA_CONTEXT_BYTES)


def test_parse_target_reads_sizes_and_names_the_known_gpus_otherwise():
    assert parse_target("24GiB") == ("24GiB", 24 * 2**30)
    assert parse_target("16GB") == ("16GB", 16 * 10**9)
    assert parse_target("512M") == ("512M", 512 * MIB)
    assert parse_target(2**30) == ("1073741824 bytes", 2**30)
    with pytest.raises(ValueError, match=r"T4, L4, A10G.*H200.*but got target='rtx 4090'"):
        parse_target("rtx 4090")
    assert all(12 * 2**30 < total < 150 * 2**30 for total in GPU_TARGETS.values())
