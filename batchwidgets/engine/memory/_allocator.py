"""A model of PyTorch's CUDA caching allocator, the replay of a step's allocation trace through
it, and the batch size a cap allows.
One object, one module: the replay, what a step needs and the largest batch are the model's
uses, each read against its rules.

Usage:
    >>> from batchwidgets.engine.memory._allocator import CachingAllocatorModel
    >>> model = CachingAllocatorModel()
    >>> handle = model.malloc(1000)
    >>> model.allocated_bytes, model.reserved_bytes
    (1024, 2097152)
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

# NOTE [ Which allocator rules the model follows ]
# From c10/cuda/CUDACachingAllocator.cpp (DeviceCachingAllocator; defaults of
# PYTORCH_CUDA_ALLOC_CONF), rewritten here:
# - round_size: a request is rounded up to a multiple of 512 B, at least 512 B.
# - get_pool: rounded sizes <= 1 MiB go to the small pool, larger ones to the large pool.
# - get_allocation_size: a new segment is 2 MiB for the small pool, 20 MiB for sizes below
#   10 MiB, else the size rounded up to 2 MiB.
# - get_free_block: best fit, the smallest free block of the pool that is large enough, ties
#   broken by address (the pool is a set ordered by size, then address).
# - should_split: the rest of a block is split off when it is >= 512 B (small pool) or > 1 MiB
#   (large pool); otherwise the whole block is handed out, and "allocated" counts it whole.
# - free_block: a freed block merges with its free neighbours of the same segment, then goes
#   back to its pool. Nothing goes back to the driver.
# - malloc: search the pool; else allocate a segment; if that would pass the cap
#   (set_per_process_memory_fraction), release every cached segment that is wholly free
#   (release_cached_blocks) and try once more; then raise OutOfMemoryError.
# - a request of 0 bytes takes no block (the allocator returns a null pointer).
# Left out: streams and cross-stream events (one stream), expandable segments, max_split_size
# and its oversize-block rules (the default is unlimited, so they are off), roundup_power2
# divisions, garbage_collection_threshold, CUDA graph pools, and a real driver's own limits
# (only the cap can fail). Segment addresses are a counter, so ties in best fit go to the
# older segment, where the driver's addresses could order them otherwise.

KIB, MIB = 2**10, 2**20
_ADDRESS_BITS = 60  # a free block's key: its size above its address (addresses stay below 2**60)
MIN_BLOCK_BYTES = 512  # kMinBlockSize
SMALL_SIZE_BYTES = 1 * MIB  # kSmallSize: the largest request of the small pool
SMALL_SEGMENT_BYTES = 2 * MIB  # kSmallBuffer
LARGE_SEGMENT_BYTES = 20 * MIB  # kLargeBuffer
MIN_LARGE_ALLOC_BYTES = 10 * MIB  # kMinLargeAlloc
ROUND_LARGE_BYTES = 2 * MIB  # kRoundLarge


def round_size(nbytes: int) -> int:
    """The block size the allocator hands out for a request of ``nbytes`` (``round_size``)."""
    if nbytes < MIN_BLOCK_BYTES:
        return MIN_BLOCK_BYTES
    return -(-nbytes // MIN_BLOCK_BYTES) * MIN_BLOCK_BYTES


def segment_size(size: int) -> int:
    """The segment ``cudaMalloc``-ed for a rounded block size (``get_allocation_size``)."""
    if size <= SMALL_SIZE_BYTES:
        return SMALL_SEGMENT_BYTES
    if size < MIN_LARGE_ALLOC_BYTES:
        return LARGE_SEGMENT_BYTES
    return -(-size // ROUND_LARGE_BYTES) * ROUND_LARGE_BYTES


def format_bytes(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", MIB), ("KiB", KIB)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} bytes"


class _Block:
    __slots__ = ("address", "allocated", "next", "prev", "size", "small")

    def __init__(self, address: int, size: int, small: bool) -> None:
        self.address, self.size, self.small = address, size, small
        self.allocated = False
        self.prev: _Block | None = None
        self.next: _Block | None = None

    def key(self) -> int:
        """(size, address) as one int, ordered as the pair is: best fit by size, then address."""
        return (self.size << _ADDRESS_BITS) | self.address


class CachingAllocatorModel:
    """PyTorch's CUDA caching allocator in bytes only (NOTE [ Which allocator rules the model
    follows ]): blocks, segments, pools, and ``torch.OutOfMemoryError`` at ``cap_bytes`` of
    reserved memory, as ``torch.cuda.set_per_process_memory_fraction`` caps a process."""

    def __init__(self, cap_bytes: int | None = None) -> None:
        self.cap_bytes = cap_bytes
        self.allocated_bytes = 0
        self.reserved_bytes = 0
        self.peak_allocated_bytes = 0
        self.peak_reserved_bytes = 0
        self.n_segments = 0
        self.met_cap = False  # a segment would have passed the cap: the cache was released
        self._pools: dict[bool, list[int]] = {True: [], False: []}  # sorted keys
        self._free: dict[int, _Block] = {}  # _Block.key() -> free block
        self._next_address = 0

    # -- public API --------------------------------------------------------------------------
    def layout(self) -> tuple:
        """The reserved bytes and every free block: a step that starts from an equal layout
        runs alike (NOTE [ A size holds when the allocator's layout repeats ] in
        probe/_trials.py)."""
        return self.reserved_bytes, tuple(self._pools[True]), tuple(self._pools[False])

    def malloc(self, nbytes: int) -> _Block | None:
        """Allocate ``nbytes``; the handle goes to ``free``. ``None`` for 0 bytes."""
        if nbytes <= 0:
            return None
        size = round_size(nbytes)
        small = size <= SMALL_SIZE_BYTES
        pool = self._pools[small]  # best fit: the first key of at least (size, address 0)
        index = bisect.bisect_left(pool, size << _ADDRESS_BITS)
        if index < len(pool):
            block = self._free.pop(pool.pop(index))
        else:
            block = self._new_segment(size, small)
        remaining = block.size - size
        if (remaining >= MIN_BLOCK_BYTES) if small else (remaining > SMALL_SIZE_BYTES):
            rest = _Block(block.address + size, remaining, small)
            rest.prev, rest.next = block, block.next
            if block.next is not None:
                block.next.prev = rest
            block.next, block.size = rest, size
            self._insert(rest)
        block.allocated = True
        self.allocated_bytes += block.size
        if self.allocated_bytes > self.peak_allocated_bytes:
            self.peak_allocated_bytes = self.allocated_bytes
        return block

    def free(self, handle: _Block | None) -> None:
        """Return a block to its pool, merged with its free neighbours in the segment."""
        if handle is None:
            return
        if not handle.allocated:
            raise RuntimeError("CachingAllocatorModel.free got a block that is not allocated; "
                               "this is a bug in batchwidgets; please report it.")
        handle.allocated = False
        self.allocated_bytes -= handle.size
        before, after = handle.prev, handle.next
        if before is not None and not before.allocated:
            self._remove(before)
            handle.address, handle.prev = before.address, before.prev
            if handle.prev is not None:
                handle.prev.next = handle
            handle.size += before.size
        if after is not None and not after.allocated:
            self._remove(after)
            handle.next = after.next
            if handle.next is not None:
                handle.next.prev = handle
            handle.size += after.size
        self._insert(handle)

    def empty_cache(self) -> None:
        """Release every cached segment that is wholly free (``release_cached_blocks``)."""
        for key in [k for k, b in self._free.items() if b.prev is None and b.next is None]:
            block = self._free[key]
            self._remove(block)
            self.reserved_bytes -= block.size
            self.n_segments -= 1

    def reset_peaks(self) -> None:
        self.peak_allocated_bytes = self.allocated_bytes
        self.peak_reserved_bytes = self.reserved_bytes

    def largest_free_bytes(self) -> int:
        """What cuDNN may ask for without an error: the larger of the room left under the cap
        and the largest cached free block (``cacheInfo``). Unbounded without a cap."""
        cached = max((block.size for block in self._free.values()), default=0)
        if self.cap_bytes is None:
            return 2**62
        return max(cached, self.cap_bytes - self.reserved_bytes)

    def malloc_workspace(self, wanted_bytes: int, free_fraction: float) -> _Block | None:
        """A convolution workspace as cuDNN's algorithm choice gets it: ``wanted_bytes``, at
        most ``free_fraction`` of ``largest_free_bytes()``, and none (``None``) when even that
        cannot be allocated; it never raises."""
        nbytes = min(wanted_bytes, int(free_fraction * self.largest_free_bytes()))
        try:
            return self.malloc(nbytes)
        except torch.OutOfMemoryError:
            return None  # cuDNN falls back to an algorithm without a workspace

    # -- internals ---------------------------------------------------------------------------
    def _insert(self, block: _Block) -> None:
        key = block.key()
        self._free[key] = block
        bisect.insort(self._pools[block.small], key)

    def _remove(self, block: _Block) -> None:
        key = block.key()
        del self._free[key]
        pool = self._pools[block.small]
        del pool[bisect.bisect_left(pool, key)]

    def _new_segment(self, size: int, small: bool) -> _Block:
        nbytes = segment_size(size)
        if self.cap_bytes is not None and self.reserved_bytes + nbytes > self.cap_bytes:
            self.met_cap = True
            self.empty_cache()  # what the real allocator does before it gives up
            if self.reserved_bytes + nbytes > self.cap_bytes:
                raise torch.OutOfMemoryError(
                    f"CUDA out of memory (batchwidgets' simulated device). Tried to allocate "
                    f"{format_bytes(nbytes)} (a segment for a {format_bytes(size)} block); "
                    f"{format_bytes(self.reserved_bytes)} reserved, "
                    f"{format_bytes(self.allocated_bytes)} allocated, cap "
                    f"{format_bytes(self.cap_bytes)} ({self.cap_bytes} bytes).")
        block = _Block(self._next_address, nbytes, small)
        self._next_address += nbytes
        self.reserved_bytes += nbytes
        self.n_segments += 1
        self.peak_reserved_bytes = max(self.peak_reserved_bytes, self.reserved_bytes)
        return block


# -- traces ---------------------------------------------------------------------------------
Event = tuple[str, int, int]  # ("alloc", key, nbytes), ("free", key, 0), ("workspace", key,
# wanted_bytes): a convolution workspace, allocated as CachingAllocatorModel.malloc_workspace
# does and freed by a "free" event; or (staging_kind(...), key, rows): a reduction's staging
# buffer, sized from the rows it reduces (``event_bytes``; NOTE [ A reduction's staging buffer ]
# in _workspaces.py). Traces of tensor storages need only the first two kinds.
WORKSPACE_FREE_FRACTION = 0.5  # default share of the largest free block a workspace may take
_STAGING = "staging:"


def staging_kind(outputs: int, fastest: bool, acc: int, sms: int, threads_per_sm: int) -> str:
    """The kind of a reduction's staging event, whose third element is the rows it reduces
    (NOTE [ A reduction's staging buffer ] in _workspaces.py)."""
    return f"{_STAGING}{outputs}:{int(fastest)}:{acc}:{sms}:{threads_per_sm}"


def _floor_pow2(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def staging_bytes(outputs: int, rows: int, fastest: bool, acc: int, sms: int,
                  threads_per_sm: int) -> int:
    """The staging buffer of a CUDA reduction of ``rows`` values into each of ``outputs``, as
    PyTorch's setReduceConfig sizes it (Reduce.cuh; 0 when it does not split the inputs across
    thread blocks)."""
    vec = 1
    if fastest:
        dim0, dim1 = rows // 4 if rows >= 128 else rows, outputs
    else:
        vec = 4 if outputs % 4 == 0 else 2 if outputs % 2 == 0 else 1
        dim0, dim1 = outputs // vec, rows
    most = 512 // vec
    d0 = most if dim0 >= most else _floor_pow2(dim0)
    d1 = most if dim1 >= most else _floor_pow2(dim1)
    width = min(d0, 32)
    height = min(d1, most // width)
    width = min(d0, most // height)
    step_in, step_out = (width, 1) if fastest else (1, width)
    if -(-rows // step_in) < min(height * 16, 256):
        return 0  # one warp per output: no split across warps, nor across blocks
    step_in *= height
    target = sms * (threads_per_sm // (width * height))
    grid = -(-(outputs // vec) // step_out)
    per_thread = -(-rows // step_in)
    if per_thread < 256 or grid > target:
        return 0
    ctas = max(min(-(-target // grid), -(-per_thread // 16)), -(-per_thread // 256))
    return 0 if ctas <= 1 else acc * outputs * (1 if fastest else width * vec) * ctas


def event_bytes(kind: str, nbytes: int) -> int:
    """The bytes an allocation event takes: its own, or a staging event's buffer."""
    if not kind.startswith(_STAGING):
        return nbytes
    outputs, fastest, acc, sms, threads = (int(x) for x in kind[len(_STAGING):].split(":"))
    return staging_bytes(outputs, nbytes, bool(fastest), acc, sms, threads)


@dataclass(frozen=True)
class ReplayResult:
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    fits: bool
    failed_at: int | None  # index of the event that ran out; -1: the preallocated storages
    met_cap: bool = False  # a segment would have passed the cap (the cache was released)


# NOTE [ The allocator's steady state ]
# A training loop's step does not start from an empty cache: it starts where the last step left
# the allocator's segments, split and partly filled by that step's blocks, and a step laid out
# there can need more reserved memory than the same step in fresh segments. ``replay`` with
# ``steady=True`` runs the step again and again until the free blocks at a step's start repeat
# (at most STEADY_STEPS times) and counts every step: the step as a loop runs it. What a step
# allocates and never frees (optimizer state made by a first step) is made once: the later
# steps find it there. On the encoder
# the truth kit recorded on an H200 capped at 8 GiB (true boundary 784), the step replayed once
# fit 804, twice 789, from the third step on 784; the wide CNN 642, 642, then 641 (true 641).
STEADY_STEPS = 3


def replay(events: Iterable[Event], cap_bytes: int | None = None, *,
           preallocated: Iterable[int | tuple[int, int]] = (),
           workspace_fraction: float = WORKSPACE_FREE_FRACTION,
           steady: bool = False) -> ReplayResult:
    """Run a step's allocation trace through a fresh ``CachingAllocatorModel(cap_bytes)``.

    ``preallocated`` are the storages alive before the step (weights, gradients, optimizer
    state), allocated first in their order: a size, or a ``(key, nbytes)`` pair that a
    ``("free", key, 0)`` event of the trace may free. Frees of unknown keys are ignored.
    ``("workspace", key, wanted)`` events take ``min(wanted, workspace_fraction *`` the largest
    free block``)``, or nothing when that fails (``CachingAllocatorModel.malloc_workspace``).
    ``steady=True`` runs the step until the allocator's layout repeats (NOTE [ The allocator's
    steady state ]); the peaks are those of every step run.
    """
    return _Replay(events).run(cap_bytes, list(preallocated), workspace_fraction, steady)


_ALLOC, _WORKSPACE, _FREE, _NULL = 0, 1, 2, 3  # _NULL: a request of 0 bytes, no block


class _Replay:
    """A trace read once for the many replays of a search into _Player's actions (NOTE [ The
    replay's allocator, inlined ]): each event's action, key and bytes (an allocation's rounded
    once, a staging event's buffer sized), for the first step and for a later one, which runs
    what the first did not make for it (what it freed), each allocation its own (key < 0)."""

    def __init__(self, events: Iterable[Event]) -> None:
        events = list(events)
        freed = {key for kind, key, _ in events if kind == "free"}  # the rest made stays made
        self.workspaces = False
        actions = []
        for index, (kind, key, nbytes) in enumerate(events):
            if kind == "free":
                actions.append((index, _FREE, key, 0))
            elif kind == "alloc" or kind.startswith(_STAGING):
                if kind != "alloc":
                    nbytes = event_bytes(kind, nbytes)
                actions.append((index, _ALLOC, key, round_size(nbytes)) if nbytes > 0
                               else (index, _NULL, key, 0))
            elif kind == "workspace":
                actions.append((index, _WORKSPACE, key, nbytes))
                self.workspaces = True
            else:
                raise ValueError(f"events should hold ('alloc', key, nbytes), ('free', key, "
                                 f"0) and ('workspace', key, nbytes) tuples, but got "
                                 f"events[{index}]={(kind, key, nbytes)!r}.")
        self.first_ops = [(index, action, key, size, False)
                          for index, action, key, size in actions]
        self.later_ops = [(index, action, key, size, key < 0)
                          for index, action, key, size in actions
                          if action == _FREE or key in freed]

    def run(self, cap_bytes: int | None, preallocated: Sequence[int | tuple[int, int]],
            workspace_fraction: float, steady: bool) -> ReplayResult:
        """The trace through a fresh ``CachingAllocatorModel(cap_bytes)``, as ``replay`` says,
        by ``_Player`` (NOTE [ The replay's allocator, inlined ])."""
        return self.run_alike(cap_bytes, preallocated, workspace_fraction, steady)[0]

    def run_alike(self, cap_bytes: int | None, preallocated: Sequence[int | tuple[int, int]],
                  workspace_fraction: float, steady: bool) -> tuple[ReplayResult, int]:
        """``run``, and the least capacity above ``cap_bytes`` that would not run alike: the
        least reserved bytes that a segment would have made over the cap (NOTE [ Caps that run
        alike ]); _NO_CAP where none passed it."""
        player = _Player(cap_bytes, workspace_fraction)
        handles: dict[object, object] = {}
        failed = player.play(_preallocated_ops(preallocated), handles, {})
        if failed is None:
            failed = player.play(self.first_ops, handles, handles)
        if failed is None:
            layout = player.layout()
            for _ in range(1, STEADY_STEPS if steady else 1):
                # a later step's own allocations have keys of their own; what the first step
                # made and kept is there for it (not in ``later``)
                failed = player.play(self.later_ops, handles, {})
                if failed is not None:
                    break
                now = player.layout()
                if now == layout:
                    break
                layout = now
        if failed is not None:
            return ReplayResult(player.peak_allocated_bytes, player.peak_reserved_bytes, False,
                                failed, True), player.refused_bytes
        return ReplayResult(player.peak_allocated_bytes, player.peak_reserved_bytes, True, None,
                            player.met_cap), player.refused_bytes


# NOTE [ The replay's allocator, inlined ]
# A search replays a trace of tens of thousands of events a few hundred times, so ``_Player``
# runs CachingAllocatorModel's malloc and free inlined in one loop over the trace's actions,
# each with its rounded size worked out once (``_Replay``): its blocks are lists
# [size, address, allocated, prev, next, small] in place of ``_Block``s, its pools the same
# sorted keys (size << _ADDRESS_BITS | address) with the same free-block map, its segments,
# cap, cache release, workspaces and peaks those of the model, rule for rule and in the same
# order, so a replay's every number is the model's (tests/engine/memory/
# test_allocator_replay.py drives both side by side). Actions, each a tuple (index, action,
# key, size, own):
# _ALLOC a rounded size, _NULL a request of 0 bytes (no block), _WORKSPACE the wanted bytes,
# _FREE; ``own``: the handle goes to the table of the step's own allocations.
_SIZE, _ADDRESS, _ALLOCATED, _PREV, _NEXT, _SMALL = range(6)  # a _Player block's fields


def _preallocated_ops(preallocated: Sequence[int | tuple[int, int]]) -> list[tuple]:
    """The storages alive before the step as actions: a keyed one to the table of handles, a
    size alone to a table thrown away (nothing frees it)."""
    ops = []
    for item in preallocated:
        key, nbytes = item if isinstance(item, tuple) else (None, item)
        ops.append((-1, _ALLOC, key, round_size(nbytes), key is None) if nbytes > 0
                   else (-1, _NULL, key, 0, key is None))
    return ops


def _release_cached(free_blocks: dict, small_pool: list[int], large_pool: list[int]) -> int:
    """CachingAllocatorModel.empty_cache on a _Player's blocks: the bytes released."""
    released = 0
    for key in [k for k, b in free_blocks.items() if b[_PREV] is None and b[_NEXT] is None]:
        block = free_blocks.pop(key)
        pool = small_pool if block[_SMALL] else large_pool
        del pool[bisect.bisect_left(pool, key)]
        released += block[_SIZE]
    return released


class _Player:
    """CachingAllocatorModel's state, played over a trace's actions by ``play`` (NOTE [ The
    replay's allocator, inlined ])."""

    def __init__(self, cap_bytes: int | None, workspace_fraction: float) -> None:
        self.cap_bytes, self.workspace_fraction = cap_bytes, workspace_fraction
        self.small_pool: list[int] = []
        self.large_pool: list[int] = []
        self.free_blocks: dict[int, list] = {}
        self.allocated_bytes = self.reserved_bytes = 0
        self.peak_allocated_bytes = self.peak_reserved_bytes = 0
        self.next_address = 0
        self.met_cap = False
        self.refused_bytes = _NO_CAP  # the least reserved a segment would have made, over the cap

    def layout(self) -> tuple:
        return self.reserved_bytes, tuple(sorted(self.free_blocks))

    def play(self, ops: Sequence[tuple], handles: dict, mine: dict) -> int | None:
        """Run ``ops``, each handle to ``mine`` if the action is the step's own, else to
        ``handles``; the index of the action that ran out of memory, or None."""
        cap, fraction = self.cap_bytes, self.workspace_fraction
        small_pool, large_pool, free_blocks = self.small_pool, self.large_pool, self.free_blocks
        allocated, reserved = self.allocated_bytes, self.reserved_bytes
        peak_allocated, peak_reserved = self.peak_allocated_bytes, self.peak_reserved_bytes
        next_address, met_cap, refused = self.next_address, self.met_cap, self.refused_bytes
        bisect_left, insort = bisect.bisect_left, bisect.insort
        failed = None
        for index, action, key, size, own in ops:
            table = mine if own else handles
            if action == _FREE:  # CachingAllocatorModel.free
                block = table.pop(key, None)  # a key the trace never made: nothing
                if block is None:
                    continue
                if not block[2]:
                    raise RuntimeError("CachingAllocatorModel.free got a block that is not "
                                       "allocated; this is a bug in batchwidgets; please "
                                       "report it.")
                block[2] = False
                allocated -= block[0]
                pool = small_pool if block[5] else large_pool
                before, after = block[3], block[4]
                if before is not None and not before[2]:
                    gone = (before[0] << _ADDRESS_BITS) | before[1]
                    del free_blocks[gone]
                    del pool[bisect_left(pool, gone)]
                    block[1], block[3] = before[1], before[3]
                    if block[3] is not None:
                        block[3][4] = block
                    block[0] += before[0]
                if after is not None and not after[2]:
                    gone = (after[0] << _ADDRESS_BITS) | after[1]
                    del free_blocks[gone]
                    del pool[bisect_left(pool, gone)]
                    block[4] = after[4]
                    if block[4] is not None:
                        block[4][3] = block
                    block[0] += after[0]
                gone = (block[0] << _ADDRESS_BITS) | block[1]
                free_blocks[gone] = block
                insort(pool, gone)
                continue
            if action == _NULL:
                table[key] = None
                continue
            if action == _WORKSPACE:  # CachingAllocatorModel.malloc_workspace
                if cap is None:
                    largest = 2**62
                else:
                    largest = max(small_pool[-1] >> _ADDRESS_BITS if small_pool else 0,
                                  large_pool[-1] >> _ADDRESS_BITS if large_pool else 0,
                                  cap - reserved)
                nbytes = min(size, int(fraction * largest))
                if nbytes <= 0:
                    table[key] = None
                    continue
                size = round_size(nbytes)
            # CachingAllocatorModel.malloc of a rounded size
            small = size <= SMALL_SIZE_BYTES
            pool = small_pool if small else large_pool
            at = bisect_left(pool, size << _ADDRESS_BITS)
            if at < len(pool):
                block = free_blocks.pop(pool.pop(at))
            else:  # CachingAllocatorModel._new_segment
                nbytes = segment_size(size)
                if cap is not None and reserved + nbytes > cap:
                    met_cap = True
                    refused = min(refused, reserved + nbytes)
                    reserved -= _release_cached(free_blocks, small_pool, large_pool)
                    if reserved + nbytes > cap:
                        refused = min(refused, reserved + nbytes)
                        if action == _WORKSPACE:  # cuDNN runs without a workspace
                            table[key] = None
                            continue
                        failed = index
                        break
                block = [nbytes, next_address, False, None, None, small]
                next_address += nbytes
                reserved += nbytes
                if reserved > peak_reserved:
                    peak_reserved = reserved
            remaining = block[0] - size
            if (remaining >= MIN_BLOCK_BYTES) if small else (remaining > SMALL_SIZE_BYTES):
                rest = [remaining, block[1] + size, False, block, block[4], small]
                if block[4] is not None:
                    block[4][3] = rest
                block[4], block[0] = rest, size
                gone = (remaining << _ADDRESS_BITS) | rest[1]
                free_blocks[gone] = rest
                insort(pool, gone)
            block[2] = True
            allocated += block[0]
            if allocated > peak_allocated:
                peak_allocated = allocated
            table[key] = block
        self.allocated_bytes, self.reserved_bytes = allocated, reserved
        self.peak_allocated_bytes, self.peak_reserved_bytes = peak_allocated, peak_reserved
        self.next_address, self.met_cap, self.refused_bytes = next_address, met_cap, refused
        return failed


# NOTE [ What a step needs ]
# The capped replay is not monotone in the capacity: under a cap the
# allocator releases its cached segments and retries, so a step can fit at C and fail at a larger
# C' whose cap it meets too late to release what it must (the 5 GiB MLP's largest batch fit at 5.00
# GiB, failed at 4.95 and at 5.05-5.90, fit again at 5.92). What a step needs is the least capacity
# C on which it fits with room to spare: it fits at C and at each step of the 2 MiB grid (segments
# and their caps live on it: an outcome changes only where a cap crosses a multiple of 2 MiB) up to
# NEED_WINDOW above C (a 64th of C on a small device: two GPUs sold as the same model differ by a
# few MiB, not by a fixed share). The search: bisection between the peak of the live blocks (below
# it nothing fits) and a capacity that fits (the uncapped peak of the step's tensors), then up the
# grid past any failure in the window. A batch size fits a device when its need is at most the
# device's memory, so a plan's answer never sits on a knife edge of the replay; a failure further
# above the window, where the uncapped allocator's cache outgrows the cap, is not looked for (each
# look is a replay of the whole step), and the curve of needs is monotone once a running maximum
# over the sizes is taken (a larger batch holds no fewer bytes). A replay that never met its cap
# ran as without one, so it runs so on every larger capacity too: where no workspace takes a
# share of the room left, that capacity's window is not replayed (``_Fitter.above``).
GRID_BYTES = 2 * MIB
NEED_WINDOW = 16 * MIB


def _top(events: Sequence[Event], preallocated: Sequence[int | tuple[int, int]],
         fits: _Fitter) -> tuple[int, int]:
    """(a capacity below which nothing fits, one the step fits on): the steady peak of its live
    blocks, and the uncapped reserved peak of its tensors (a convolution's workspace takes what
    the free memory allows, so it grows with the capacity and never fails), raised by the grid
    until the whole step fits there."""
    if fits.step.workspaces:
        tensors = [e for e in events if e[0] != "workspace"]
        uncapped = replay(tensors, None, preallocated=preallocated, steady=True)
    else:
        uncapped = fits.uncapped()
    low = uncapped.peak_allocated_bytes // GRID_BYTES * GRID_BYTES
    top = -(-uncapped.peak_reserved_bytes // GRID_BYTES) * GRID_BYTES
    for _ in range(64):
        if fits(top):
            break
        top += GRID_BYTES
    return low, top


def _window_fails(fits: _Fitter, cap_bytes: int) -> int | None:
    """The highest capacity of the grid within the window above ``cap_bytes`` that fails."""
    if fits.above(cap_bytes):
        return None
    start = cap_bytes // GRID_BYTES * GRID_BYTES
    window = min(NEED_WINDOW, cap_bytes // 64) // GRID_BYTES * GRID_BYTES
    for cap in range(start + window, start, -GRID_BYTES):
        if not fits(cap):
            return cap
    return None


# NOTE [ Caps that run alike ]
# Without workspaces, a replay reads its cap at one place only: where a segment would be
# allocated, it asks whether the reserved bytes with it, R, pass the cap (and, where they do,
# once more after the cache is released). So a replay under a cap C that peaked at P reserved
# and whose least R over C was Q (none: Q infinite) runs event for event alike under every cap
# C' in [P, Q): each R that stayed under C made the reserved bytes, so is at most P <= C', and
# each over C is at least Q > C'; where it met C (the cache released, then the segment
# allocated or the step out of memory) it meets C' at the same event and does the same. So its
# result, fit or out of memory, is every such cap's, and a search over the capacities replays
# only caps outside the spans of those it ran; the uncapped replay's span is every cap above its
# peak. Not so with convolution workspaces, which take a share of the room left under the cap,
# so differ from C to C'.
_NO_CAP = 2**62  # above any device's memory: the key of the replay without a cap


class _Fitter:
    """Whether a step fits a capacity, in the allocator's steady state, each capacity replayed
    once. ``above(cap)``: it fits there and on every larger capacity, because its replay never
    met the cap, so it ran as without one (no workspace takes a share of the room left)."""

    def __init__(self, events: Sequence[Event], preallocated: Sequence[int | tuple[int, int]],
                 workspace_fraction: float) -> None:
        self.step, self.preallocated = _Replay(events), list(preallocated)
        self.workspace_fraction = workspace_fraction
        self._results: dict[int, ReplayResult] = {}
        self._spans: list[tuple[int, int, ReplayResult]] = []  # (from, below, result) replayed

    def result(self, cap: int) -> ReplayResult:
        if cap not in self._results:
            self._results[cap] = self._same_run(cap) or self._run(cap)
        return self._results[cap]

    def uncapped(self) -> ReplayResult:
        """The replay without a cap, kept as the run of every cap above its peak."""
        if _NO_CAP not in self._results:
            self._results[_NO_CAP] = self._run(None)
        return self._results[_NO_CAP]

    def _run(self, cap: int | None) -> ReplayResult:
        result, refused = self.step.run_alike(cap, self.preallocated, self.workspace_fraction,
                                              steady=True)
        self._spans.append((result.peak_reserved_bytes, refused, result))
        return result

    def _same_run(self, cap: int) -> ReplayResult | None:
        """A replay already run that ``cap``'s would repeat event for event (NOTE [ Caps that
        run alike ]), or None."""
        if self.step.workspaces:
            return None
        return next((result for low, below, result in self._spans if low <= cap < below), None)

    def __call__(self, cap: int) -> bool:
        return self.result(cap).fits

    def above(self, cap: int) -> bool:
        result = self.result(cap)
        return result.fits and not result.met_cap and not self.step.workspaces


def needed_bytes(events: Sequence[Event], *, preallocated: Sequence[int | tuple[int, int]] = (),
                 workspace_fraction: float = WORKSPACE_FREE_FRACTION,
                 exact: bool = True) -> int:
    """The least capacity on which the step fits with NEED_WINDOW to spare (NOTE [ What a step
    needs ]), in the allocator's steady state; ``exact=False``: a capacity it surely fits on
    (the uncapped peak of its tensors), for sizes far from any cap."""
    fits = _Fitter(events, preallocated, workspace_fraction)
    low, top = _top(events, preallocated, fits)
    if not exact:
        return top
    low, high = max(GRID_BYTES, low), top  # fits at high; below low nothing does
    while high - low > GRID_BYTES:
        middle = (low + high) // 2 // GRID_BYTES * GRID_BYTES
        low, high = (low, middle) if fits(middle) else (middle, high)
    need = high
    failed = _window_fails(fits, need)
    while failed is not None and failed < top:
        need = failed + GRID_BYTES
        failed = _window_fails(fits, need) if fits(need) else need
    return min(need, top) if failed is None else top


def fits_from(events: Sequence[Event], cap_bytes: int, *,
              preallocated: Sequence[int | tuple[int, int]] = (),
              workspace_fraction: float = WORKSPACE_FREE_FRACTION) -> bool:
    """Whether the step needs at most ``cap_bytes`` (NOTE [ What a step needs ]): it fits at
    the cap and on the grid up to NEED_WINDOW above it, in the allocator's steady state."""
    fits = _Fitter(events, preallocated, workspace_fraction)
    return fits(cap_bytes) and _window_fails(fits, cap_bytes) is None


def _affine(n_a: int, batch_a: int, n_b: int, batch_b: int, batch_size: int) -> int:
    """The line through (batch_a, n_a) and (batch_b, n_b) at batch_size, rounded half up,
    in integers so a trace of a million events scales without float error."""
    numerator = n_a * (batch_b - batch_size) + n_b * (batch_size - batch_a)
    span = batch_b - batch_a
    if span < 0:
        numerator, span = -numerator, -span
    return max(0, (2 * numerator + span) // (2 * span))


def scale_events(events_a: Sequence[Event], batch_a: int, events_b: Sequence[Event],
                 batch_b: int, batch_size: int) -> list[Event] | None:
    """The trace at ``batch_size``: each allocation's size on the line through the two traces.

    The traces correspond event by event (same length, same kinds, each free releasing the
    allocation at the same position), else the answer is ``None``. Allocations get the key
    ``-1 - position``; a free of a storage allocated before the trace keeps ``events_a``'s key.
    """
    if batch_a == batch_b:
        raise ValueError(f"batch_b should differ from batch_a ({batch_a}), but got "
                         f"batch_b={batch_b!r}; trace two different batch sizes.")
    if len(events_a) != len(events_b):
        return None
    where_a: dict[int, int] = {}
    where_b: dict[int, int] = {}
    scaled: list[Event] = []
    append = scaled.append
    # _affine inline: (2 * (n_a * to_a + n_b * to_b) + span) // (2 * span), span > 0
    to_a, to_b, span = batch_b - batch_size, batch_size - batch_a, batch_b - batch_a
    if span < 0:
        to_a, to_b, span = -to_a, -to_b, -span
    to_a, to_b, twice = 2 * to_a, 2 * to_b, 2 * span
    for position, ((kind, key_a, n_a), (kind_b, key_b, n_b)) in enumerate(
            zip(events_a, events_b)):
        if kind != kind_b:
            kind = _scale_staging(kind, kind_b, batch_a, batch_b, batch_size)
            if kind is None:
                return None
        if kind != "free":
            where_a[key_a] = where_b[key_b] = position
            nbytes = (n_a * to_a + n_b * to_b + span) // twice
            append((kind, -1 - position, nbytes if nbytes > 0 else 0))
        else:
            at_a, at_b = where_a.pop(key_a, None), where_b.pop(key_b, None)
            if at_a != at_b:
                return None
            append(("free", key_a if at_a is None else -1 - at_a, 0))
    return scaled


def _scale_staging(kind_a: str, kind_b: str, batch_a: int, batch_b: int,
                   batch_size: int) -> str | None:
    """The staging kind at ``batch_size`` of a reduction whose outputs grow with the batch (a
    mean over each sample's positions), or None when the two kinds are not one reduction's."""
    if not (kind_a.startswith(_STAGING) and kind_b.startswith(_STAGING)):
        return None
    (n_a, *rest_a), (n_b, *rest_b) = (k[len(_STAGING):].split(":") for k in (kind_a, kind_b))
    if rest_a != rest_b:
        return None
    outputs = _affine(int(n_a), batch_a, int(n_b), batch_b, batch_size)
    return f"{_STAGING}{outputs}:{':'.join(rest_a)}"


SCAN_REPLAYS = 512  # the most sizes tried one by one above the bisection's boundary


def _live_peak(events: Iterable[Event], preallocated: Sequence[int | tuple[int, int]]) -> int:
    """The peak of the rounded live bytes: a lower bound of the allocated, so of the reserved,
    peak that costs no allocator."""
    sizes = {}
    for item in preallocated:
        key, nbytes = item if isinstance(item, tuple) else (object(), item)
        sizes[key] = round_size(nbytes) if nbytes > 0 else 0
    live = peak = sum(sizes.values())
    for kind, key, nbytes in events:
        if kind != "free":  # a workspace may get nothing: it counts for nothing here
            nbytes = event_bytes(kind, nbytes)
            counted = kind == "alloc" or kind.startswith(_STAGING)
            sizes[key] = round_size(nbytes) if nbytes > 0 and counted else 0
            live += sizes[key]
            peak = max(peak, live)
        else:
            live -= sizes.pop(key, 0)
    return peak


def _last_true(predicate: Callable[[int], bool], lo: int, top: int) -> int:
    """From ``lo`` (where ``predicate`` holds), double, then bisect to the last k <= top where it
    holds with the next one failing."""
    step, hi = 1, lo + 1
    while hi <= top and predicate(hi):
        lo, step = hi, step * 2
        hi = lo + step
    hi = min(hi, top + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if predicate(mid) else (lo, mid)
    return lo


def largest_batch_size(events_a: Sequence[Event], batch_a: int, events_b: Sequence[Event],
                       batch_b: int, cap_bytes: int, *, multiple_of: int = 1,
                       ceiling: int = 2**24, preallocated: Iterable[int | tuple[int, int]] = (),
                       overhead_bytes: int = 0,
                       workspace_fraction: float = WORKSPACE_FREE_FRACTION) -> int:
    """The largest multiple of ``multiple_of`` (up to ``ceiling``) whose scaled trace replays
    under ``cap_bytes - overhead_bytes``; 0 when none does.

    See NOTE [ Searching a reserved peak that is not monotone ].
    """
    if multiple_of < 1:
        raise ValueError(f"multiple_of should be a positive int, but got "
                         f"multiple_of={multiple_of!r}.")
    if scale_events(events_a, batch_a, events_b, batch_b, batch_a) is None:
        raise ValueError("events_a and events_b should be traces of the same ops (same length, "
                         "same kinds, frees in the same places), but they differ; check "
                         "scale_events(...) is not None before predicting.")
    preallocated = list(preallocated)
    limit = cap_bytes - overhead_bytes
    top = ceiling // multiple_of

    @functools.lru_cache(maxsize=2)  # a size's may_fit, then its fits
    def scaled(k: int) -> list[Event]:
        return scale_events(events_a, batch_a, events_b, batch_b, k * multiple_of)

    @functools.cache  # the scan down may ask a size the bisection asked
    def fits(k: int) -> bool:
        return fits_from(scaled(k), limit, preallocated=preallocated,
                         workspace_fraction=workspace_fraction)

    def may_fit(k: int) -> bool:
        return k == 0 or _live_peak(scaled(k), preallocated) <= limit

    possible = _last_true(may_fit, 0, top)  # no size above has room for its tensors alone
    if possible == 0:
        return 0
    found = _last_true(fits, 1, possible) if fits(1) else 0
    stride = max(1, -(-(possible - found) // SCAN_REPLAYS))
    for k in range(possible, found, -stride):
        if fits(k):
            return _last_true(fits, k, min(k + stride - 1, possible)) * multiple_of
    return found * multiple_of


# NOTE [ Searching a reserved peak that is not monotone ]
# The reserved peak grows with the batch size almost everywhere, so the search doubles, then
# bisects to a size that fits next to one that does not. It is not monotone everywhere: a request
# under 10 MiB gets a 20 MiB segment and one of 10 MiB only its own 10 MiB, and best fit packs
# the blocks of one size better than those of the next. So the sizes from that boundary up to
# the last one whose rounded live bytes alone stay under the cap (a lower bound of the reserved
# peak, monotone when no allocation shrinks with the batch) are tried from the top down, and
# the first that fits is the answer: the largest that fits, as a scan of every size would find.
# That costs a replay per size of the window (measured: 4-28% of the batch size, 0.1-0.8 s for
# traces of 60-250 events); a window wider than SCAN_REPLAYS sizes is scanned at a stride, each
# hit extended upward by bisection, so a size that fits alone between strides can be missed.
