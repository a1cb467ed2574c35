"""The caching-allocator model against hand-computed layouts, trace replay and scaling against
brute force, and the simulated CUDA device against the predictions made from two small sizes."""

from __future__ import annotations

import gc
import random

import pytest
import torch
from torch import nn

from batchwidgets.engine import memory
from batchwidgets.engine._state import TrainingState
from batchwidgets.engine.memory import Reading
from batchwidgets.engine.memory._allocator import (
    MIB,
    CachingAllocatorModel,
    fits_from,
    largest_batch_size,
    replay,
    scale_events,
)
from batchwidgets.engine.memory._simulated import (
    ProbeMeter,
    SimulatedCudaMeter,
    preallocated_sizes,
    record_events,
)
from batchwidgets.engine.memory._targets import CUDA_CONTEXT_BYTES, GPU_TARGETS, parse_target
from batchwidgets.engine.memory._workspaces import NO_WORKSPACES, Workspaces

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
    assert memory.is_oom(error.value)
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


@pytest.mark.parametrize(("cap_mib", "fraction", "peak_mib"), [
    (None, 0.5, 16), (40, 0.5, 14), (40, 1.0, 16), (28, 0.5, 0), (28, 1.0, 16)])
def test_replay_sizes_workspaces_by_the_free_memory(cap_mib, fraction, peak_mib):
    # After a 12 MiB tensor, a 16 MiB workspace gets min(16, fraction * (cap - 12)) MiB, or
    # nothing when that does not fit (under 28 MiB, 0.5 * 16 = 8 MiB needs a 20 MiB segment).
    cap = None if cap_mib is None else cap_mib * MIB
    events = [("alloc", 1, 12 * MIB), ("workspace", 2, 16 * MIB), ("free", 2, 0)]
    result = replay(events, cap, workspace_fraction=fraction)
    assert result.fits
    assert result.peak_allocated_bytes == (12 + peak_mib) * MIB
    model = CachingAllocatorModel(cap)
    model.malloc(12 * MIB)
    assert (model.malloc_workspace(16 * MIB, fraction) is None) == (peak_mib == 0)


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
    assert scale_events([("workspace", 1, 100)], 2, [("alloc", 1, 200)], 4, 8) is None
    assert scale_events([("workspace", 1, 100)], 2, [("workspace", 5, 200)], 4, 8) == [
        ("workspace", -1, 400)]
    with pytest.raises(ValueError, match="batch_b should differ"):
        scale_events(a, 2, a, 2, 8)


def _brute_force(a, b, cap, multiple_of=1, ceiling=400, preallocated=()):
    fitting = [k for k in range(multiple_of, ceiling + 1, multiple_of)
               if fits_from(scale_events(a, 2, b, 4, k), cap, preallocated=preallocated)]
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


def test_largest_batch_size_stays_exact_past_the_scan_limit_on_a_monotone_trace():
    # 5 MiB in a 20 MiB segment, then 3000 B a sample that the 15 MiB left cannot hold: the
    # rounded live bytes allow ~5,000 sizes more than the cap does, so the window is strided.
    def trace(batch_size):
        return [("alloc", 1, 5 * MIB), ("alloc", 2, 3000 * batch_size)]
    # 20 MiB + 3000 B rounded up to 2 MiB <= 1 GiB: 3000 B <= 1004 MiB.
    assert largest_batch_size(trace(2), 2, trace(4), 4, 2**30) == 1004 * MIB // 3000


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


# -- the simulated CUDA device ------------------------------------------------------------------
def _mlp():
    model = nn.Sequential(nn.Linear(128, 512), nn.ReLU(), nn.Linear(512, 10))
    return model, lambda b: (torch.randn(b, 128), torch.randint(0, 10, (b,)))


def _cnn():
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                          nn.MaxPool2d(2), nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32),
                          nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))
    return model, lambda b: (torch.randn(b, 3, 16, 16), torch.randint(0, 10, (b,)))


class _Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(64, 4, 128, batch_first=True)
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer(x).mean(1))


def _encoder():
    return _Encoder(), lambda b: (torch.randn(b, 16, 64), torch.randint(0, 10, (b,)))


def _training(build, meter=None):
    """Fresh weights and Adam; the tensors alive before a step, and the step itself."""
    torch.manual_seed(0)
    model, data = build()
    optimizer = torch.optim.Adam(model.parameters())

    def step(batch_size: int) -> None:
        inputs, targets = data(batch_size)
        nn.functional.cross_entropy(model(inputs), targets).backward()
        if meter is not None:
            meter.end_forward_backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return [*model.parameters(), *model.buffers()], step


def _runs(build, batch_size, cap, workspaces=None):
    """Whether one training step at ``batch_size`` runs on a fresh simulated device."""
    meter = SimulatedCudaMeter("cpu", cap, workspaces=workspaces or Workspaces())
    tracked, step = _training(build)
    message = ""
    try:
        with meter.measure(tracked):
            step(batch_size)
    except torch.OutOfMemoryError as error:
        message = str(error)
    assert message == "" or message.startswith("CUDA out of memory (batchwidgets' simulated")
    return message == ""


def test_a_training_step_on_the_simulated_device_reads_like_cuda():
    meter = SimulatedCudaMeter("cpu", 64 * MIB)
    tracked, step = _training(_mlp, meter)
    with meter.capped(), meter.measure(tracked) as reading:
        step(256)
        meter.synchronize()
    assert isinstance(reading, Reading)
    assert meter.limit_bytes == 64 * MIB
    assert meter.baseline_bytes == sum(-(-n // 512) * 512 for n in preallocated_sizes(tracked))
    assert reading.peak_reserved_bytes >= reading.peak_bytes > meter.baseline_bytes
    assert reading.peak_reserved_bytes % (2 * MIB) == 0
    assert reading.peak_reserved_bytes >= reading.activation_peak_bytes > 0


def test_out_of_memory_is_raised_at_the_op_that_passes_the_cap():
    meter = SimulatedCudaMeter("cpu", 32 * MIB)
    with meter.measure([]):
        kept = torch.empty(6 * MIB // 4 * 4)  # 24 MiB: its own segment
        with pytest.raises(torch.OutOfMemoryError, match=r"Tried to allocate 12\.00 MiB"):
            torch.empty(3 * MIB)  # 24 + 12 > 32
        with pytest.raises(torch.OutOfMemoryError, match=r"Tried to allocate 20\.00 MiB"):
            torch.ones(2 * MIB)  # 8 MiB, but in a 20 MiB segment
        small = torch.ones(1000)  # a 2 MiB small segment still fits
    assert meter.allocator.reserved_bytes == 26 * MIB
    del kept, small


def test_memory_returns_to_the_baseline_and_the_cublas_workspace_stays():
    meter = SimulatedCudaMeter("cpu", 256 * MIB)
    model = nn.Linear(512, 512)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):  # the allocator lives across blocks, and one workspace serves both
        with meter.measure([*model.parameters()]) as reading:
            model(torch.randn(64, 512)).sum().backward()
            sgd.step()
            sgd.zero_grad(set_to_none=True)
        gc.collect()
        cublas = Workspaces().cublas_bytes
        assert meter.allocator.allocated_bytes == meter.baseline_bytes + cublas
    assert reading.peak_bytes > meter.baseline_bytes + cublas
    reserved = meter.allocator.reserved_bytes
    meter.empty_cache()
    assert meter.allocator.reserved_bytes < reserved
    assert meter.allocator.reserved_bytes == 2 * MIB + 20 * MIB  # weights, and the workspace


@pytest.mark.parametrize(("cap_mib", "workspace_mib"), [(1024, 16), (42, 12), (30, 0)])
def test_the_conv_workspace_follows_the_free_memory(cap_mib, workspace_mib):
    # A 16 MiB input wants a 16 MiB workspace. After the weights (a 2 MiB small segment) and
    # the 16 MiB output, 42 MiB leaves 24 MiB: half of it, 12 MiB. 30 MiB leaves 12: half is
    # 6 MiB, whose 20 MiB segment does not fit, and the convolution runs without one.
    conv = nn.Conv2d(1, 1, 3, padding=1)
    image = torch.randn(1, 1, 2048, 2048)
    meter = SimulatedCudaMeter("cpu", cap_mib * MIB)
    with meter.measure([*conv.parameters()]) as reading:
        output = conv(image)
    assert reading.peak_bytes - meter.baseline_bytes == 16 * MIB + workspace_mib * MIB
    del output


def test_the_simulated_device_runs_on_the_cpu_only():
    with pytest.raises(ValueError, match="device should be 'cpu'"):
        SimulatedCudaMeter("meta", None)


@pytest.mark.parametrize(("build", "cap_mib"), [(_mlp, 48), (_cnn, 64), (_encoder, 48)],
                         ids=["mlp", "cnn-batchnorm", "transformer-encoder"])
def test_the_boundary_predicted_from_two_small_sizes_is_the_simulated_devices(build, cap_mib):
    """The key property: two traces (sizes 2 and 4) replayed through the allocator model give
    the largest batch the simulated device runs, workspaces and all, to the sample."""
    cap = cap_mib * MIB

    def trace(batch_size, workspaces=None):
        step = _training(build)[1]  # fresh weights and optimizer, made outside the recording
        return record_events(lambda: step(batch_size), workspaces=workspaces or Workspaces())

    preallocated = preallocated_sizes(_training(build)[0])
    predicted = largest_batch_size(trace(2), 2, trace(4), 4, cap, preallocated=preallocated)
    assert _runs(build, predicted, cap)
    assert not _runs(build, predicted + 1, cap)
    lo, hi = 1, 2 * predicted  # and no larger size runs: bisect the device itself
    assert not _runs(build, hi, cap)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if _runs(build, mid, cap) else (lo, mid)
    assert lo == predicted
    # Without the workspaces the device would fit more: they are part of what is predicted.
    bare = largest_batch_size(trace(2, NO_WORKSPACES), 2, trace(4, NO_WORKSPACES), 4, cap,
                              preallocated=preallocated)
    assert bare > predicted
    assert _runs(build, bare, cap, NO_WORKSPACES)


def test_the_meter_keeps_the_trace_of_its_last_block_for_replay():
    meter = SimulatedCudaMeter("cpu", 64 * MIB)
    tracked, step = _training(_cnn, meter)
    with meter.measure(tracked) as reading:
        step(32)
    kinds = {kind for kind, _, _ in meter.events}
    assert kinds == {"alloc", "free", "workspace"}
    assert [nbytes for _, nbytes in meter.preallocated] == preallocated_sizes(tracked)
    result = replay(meter.events, 64 * MIB, preallocated=meter.preallocated)
    assert (result.peak_allocated_bytes, result.peak_reserved_bytes) == (
        reading.peak_bytes, reading.peak_reserved_bytes)


def test_the_prediction_holds_through_trials_on_one_meter_as_the_probe_runs_them():
    """Trials as find_batch runs them: one meter, two steps a trial, the state restored and the
    cache emptied after each; the traces of two small trials predict the boundary of the rest.
    The first trial makes the cuBLAS workspace, which later blocks find allocated: its trace is
    not comparable, so the traces come from the second and third."""
    cap = 64 * MIB
    torch.manual_seed(0)
    model, data = _cnn()
    optimizer = torch.optim.Adam(model.parameters())
    state = TrainingState(model, optimizer, ())
    meter = SimulatedCudaMeter("cpu", cap)

    def trial(batch_size: int) -> bool:
        tracked = [*model.parameters(), *model.buffers(),
                   *(s for v in optimizer.state.values() for s in v.values())]
        fits = True
        try:
            with meter.measure(tracked):
                for _ in range(2):
                    inputs, targets = data(batch_size)
                    nn.functional.cross_entropy(model(inputs), targets).backward()
                    meter.end_forward_backward()
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
        except torch.OutOfMemoryError:
            fits = False
        state.restore()
        gc.collect()
        meter.empty_cache()
        return fits

    assert trial(2)
    assert trial(2)
    events_2 = meter.events
    assert trial(4)
    events_4, preallocated = meter.events, [nbytes for _, nbytes in meter.preallocated]
    predicted = largest_batch_size(events_2, 2, events_4, 4, cap, preallocated=preallocated)
    assert trial(predicted)
    assert not trial(predicted + 1)
    assert not trial(2 * predicted)
    assert not trial(predicted + 9)
    assert trial(predicted - 7)


def test_a_storage_grown_from_no_bytes_keeps_its_kind_in_the_trace():
    # A storage made empty then grown in place (an out= op's result, resize_) was an allocation
    # event of 0 bytes that the tracker never saw born, and the events' kinds are matched to
    # births storage by storage: the empty event took the grown storage's kind, which then had
    # none (an optimizer's state counted whole on every rank of a ZeRO plan)
    meter = ProbeMeter("cpu", None)
    kept = []
    with meter.measure(lambda: []) as reading:
        for _ in range(3):
            state = torch.empty(0)
            torch.add(torch.ones(256), 1, out=state)
            meter.mark(state, "optimizer")
            kept.append(state)
    trace = reading.trace
    kinds = [(nbytes, kind) for (event, _, nbytes), kind in zip(trace.events, trace.event_kinds)
             if event == "alloc"]
    # torch.ones' own storage, then the state (NOTE [ A storage of no bytes ])
    assert kinds == [(1024, "temporary"), (1024, "optimizer")] * 3
