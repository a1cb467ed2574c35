"""Out-of-memory errors are data: which errors count as OOM, the CPU budget tracker, budget strings,
and memory handed back after an OOM."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import batchwidgets as bw
from batchwidgets.engine.memory import BudgetExceededError, is_oom, parse_bytes, track_tensor_memory

# Real messages, one per backend (copied from the allocators' error strings).
OOM_MESSAGES = {
    "cuda caching allocator": (
        "CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of "
        "79.15 GiB of which 3.94 MiB is free. Including non-PyTorch memory, this process has "
        "79.14 GiB memory in use."),
    "cuda raw cudaMalloc": "CUDA error: out of memory\nCUDA kernel errors might be asynchronously "
                           "reported at some other API call",
    "cublas": "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
    "cudnn": "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a "
             "non-contiguous input.",
    "cudnn workspace": "cuDNN error: CUDNN_STATUS_ALLOC_FAILED",
    "hip": "HIP out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 63.98 GiB",
    "xpu": "XPU out of memory. Tried to allocate 1024.00 MiB (GPU 0; 15.11 GiB total capacity)",
    "mps": ("MPS backend out of memory (MPS allocated: 17.76 GB, other allocations: 1.34 GB, max "
            "allowed: 18.13 GB). Tried to allocate 256.00 MB on private pool. Use "
            "PYTORCH_MPS_HIGH_WATERMARK_RATIO=0.0 to disable upper limit for memory allocations"),
    "cpu linux": ("[enforce fail at alloc_cpu.cpp:83] err == 0. DefaultCPUAllocator: can't "
                  "allocate memory: you tried to allocate 85899345920 bytes. Error code 12 "
                  "(Cannot allocate memory)"),
    "cpu windows": ("[enforce fail at ..\\c10\\core\\impl\\alloc_cpu.cpp:72] data. "
                    "DefaultCPUAllocator: not enough memory: you tried to allocate 4294967296 "
                    "bytes."),
}
NOT_OOM = {
    "illegal memory access": RuntimeError("CUDA error: an illegal memory access was encountered"),
    "shape mismatch": RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 4x2)"),
    "value error about memory": ValueError("CUDA out of memory"),
    "type error": TypeError("DefaultCPUAllocator: can't allocate memory"),
    "keyboard interrupt": KeyboardInterrupt(),
    "cudnn execution failure": RuntimeError("cuDNN error: CUDNN_STATUS_EXECUTION_FAILED"),
}


@pytest.mark.parametrize("message", OOM_MESSAGES.values(), ids=OOM_MESSAGES.keys())
def test_is_oom_recognises_each_backends_runtime_error(message):
    assert is_oom(RuntimeError(message))


@pytest.mark.parametrize("error", [torch.OutOfMemoryError("anything"), MemoryError(),
                                   BudgetExceededError("over budget")],
                         ids=["torch.OutOfMemoryError", "MemoryError", "BudgetExceededError"])
def test_is_oom_recognises_out_of_memory_types_whatever_they_say(error):
    assert is_oom(error)


@pytest.mark.parametrize("error", NOT_OOM.values(), ids=NOT_OOM.keys())
def test_is_oom_rejects_other_errors(error):
    assert not is_oom(error)


def test_budget_exceeded_error_is_a_torch_out_of_memory_error():
    assert issubclass(BudgetExceededError, torch.OutOfMemoryError)


# The device each backend's message comes from ("cuda" covers ROCm's HIP builds).
MESSAGE_DEVICE = {"cuda caching allocator": "cuda", "cuda raw cudaMalloc": "cuda",
                  "cublas": "cuda", "cudnn": "cuda", "cudnn workspace": "cuda", "hip": "cuda",
                  "xpu": "xpu", "mps": "mps", "cpu linux": "cpu", "cpu windows": "cpu"}


@pytest.mark.parametrize("backend", OOM_MESSAGES)
def test_is_oom_trusts_a_message_only_from_the_device_that_prints_it(backend):
    error = RuntimeError(OOM_MESSAGES[backend])
    assert is_oom(error, MESSAGE_DEVICE[backend])
    others = {"cuda", "xpu", "mps", "cpu"} - {MESSAGE_DEVICE[backend]}
    assert not any(is_oom(error, device) for device in others)


@pytest.mark.parametrize("backend", OOM_MESSAGES)
def test_find_batch_on_the_cpu_takes_only_the_cpus_messages_as_out_of_memory(backend):
    error = RuntimeError(OOM_MESSAGES[backend])

    def step(batch_size: int) -> None:
        if batch_size > 2:
            raise error

    if MESSAGE_DEVICE[backend] != "cpu":  # a user's error that reads like another device's OOM
        with pytest.raises(RuntimeError) as info:
            bw.find_batch(step, device="cpu", steps_per_trial=1)
        assert error in (info.value, info.value.__cause__)  # its own, or said with it as cause
        return
    report = bw.find_batch(step, device="cpu", steps_per_trial=1)
    assert (report.max_batch_size, report.first_oom_batch_size) == (2, 3)
    failed = [a for a in report.attempts if not a.fits]
    assert failed
    assert all(a.error.startswith("RuntimeError: ") for a in failed)


@pytest.mark.parametrize(("text", "expected"), [
    ("512MB", 512 * 10**6), ("1.5GB", 1_500_000_000), ("16GiB", 16 * 2**30),
    (" 64 kib ", 64 * 2**10), ("100", 100), ("2TB", 2 * 10**12), (2**20, 2**20), (1e6, 10**6),
    (None, None),
    # one letter is binary, as Docker, Slurm and PyTorch's messages write sizes
    ("512M", 512 * 2**20), ("1G", 2**30), ("1.5g", 3 * 2**29), ("64k", 64 * 2**10),
    ("2T", 2 * 2**40), ("1e9", 10**9), ("2.5e3MB", 2_500_000_000)])
def test_parse_bytes_reads_sizes_and_units(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize(("value", "error_type"), [
    ("lots", ValueError), ("12 parsecs", ValueError), ("-5MB", ValueError), (0, ValueError),
    (-1, ValueError), (True, TypeError), ([512], TypeError), (float("nan"), ValueError),
    (float("inf"), ValueError), ("inf", ValueError), ("1e999", ValueError), ("5e", ValueError),
    ("1MiBs", ValueError)])
def test_parse_bytes_rejects_what_is_not_a_size_and_names_the_argument(value, error_type):
    with pytest.raises(error_type) as info:
        parse_bytes(value, "budget")
    assert f"budget={value!r}" in str(info.value)
    assert str(info.value).startswith("budget should be")
    assert "\n" not in str(info.value)


def test_the_size_error_says_which_units_are_binary_and_which_decimal():
    with pytest.raises(ValueError, match="budget should be a size") as info:
        parse_bytes("12 parsecs")
    assert "KB, MB, GB, TB = 1000**n" in str(info.value)
    assert "KiB, MiB, GiB, TiB = 1024**n" in str(info.value)
    assert "K, M, G, T = 1024**n" in str(info.value)


def test_tracker_counts_live_tensor_bytes_and_keeps_the_peak():
    with track_tensor_memory() as tracker:
        a = torch.zeros(1000)  # 4000 bytes
        b = torch.zeros(500, dtype=torch.float64)  # 4000 bytes
        view = a[:10]  # shares a's storage: no new bytes
        del b
        c = torch.zeros(250)  # 1000 bytes
    assert (tracker.peak_bytes, tracker.live_bytes) == (8000, 5000)
    del a, view, c
    assert tracker.live_bytes == 0  # frees are seen after the block too


def test_tracker_counts_the_baseline_against_the_budget():
    weights = torch.zeros(1000)
    over = track_tensor_memory(budget_bytes=6000, baseline=[weights, {"w": weights}])
    with over, pytest.raises(BudgetExceededError):
        torch.zeros(600)  # 4000 + 2400 > 6000; the baseline is counted once
    with track_tensor_memory(budget_bytes=6400, baseline=[weights, {"w": weights}]) as tracker:
        torch.zeros(600)
    assert tracker.baseline_bytes == 4000


def test_budget_error_is_raised_at_the_operation_that_crosses_it_not_later():
    kept = []

    def allocate_400_bytes_at_a_time() -> None:
        for _ in range(100):
            kept.append(torch.ones(100))

    with track_tensor_memory(budget_bytes=10_000), pytest.raises(BudgetExceededError) as info:
        allocate_400_bytes_at_a_time()
    assert len(kept) == 25  # the 26th pushed it to 10_400 bytes and raised instead of returning
    assert "over the budget of 10000 bytes" in str(info.value)


class CycleHoldingOOM:
    """A step whose frame holds its activations in a reference cycle with its own OOM error (as
    `except ... as e: err = e; raise` does), so plain reference counting cannot free them."""

    def __init__(self, largest: int) -> None:
        self.largest = largest
        self.refs: list[tuple[int, weakref.ref]] = []
        self.alive_at_start: list[int] = []

    def __call__(self, batch_size: int) -> None:
        self.alive_at_start.append(sum(ref() is not None for _, ref in self.refs))
        # at most 64 samples' worth: the search tries millions after its prediction misses (the
        # meter does not see this OOM), and what is checked is that they are freed, not their size
        activations = torch.ones(min(batch_size, 64) * 1000)
        self.refs.append((batch_size, weakref.ref(activations)))
        if batch_size > self.largest:
            try:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            except torch.OutOfMemoryError as error:
                held = error  # noqa: F841 -- the frame now refers to the error, and it to the frame
                raise


def test_after_an_oom_the_next_trial_and_the_caller_have_the_memory_back():
    step = CycleHoldingOOM(largest=6)
    report = bw.find_batch(step, device="cpu", steps_per_trial=1)
    assert report.n_ooms >= 2
    assert step.alive_at_start == [0] * len(step.alive_at_start)  # every trial starts clean
    assert [size for size, ref in step.refs if ref() is not None] == []
    gc.collect()


def test_the_oom_error_recorded_in_an_attempt_is_its_first_line():
    def step(batch_size: int) -> None:
        if batch_size > 1:
            raise MemoryError("no room\nfor this step")

    report = bw.find_batch(step, device="cpu", steps_per_trial=1)
    assert [a.error for a in report.attempts] == ["MemoryError: no room", ""]


def test_views_and_in_place_ops_on_tensors_made_before_the_block_cost_nothing():
    dataset = torch.zeros(10_000)
    with track_tensor_memory() as tracker:
        batch = dataset[:10]  # a view of a storage that predates the block
        dataset.add_(1)  # in place
        doubled = batch * 2  # 40 new bytes
    assert (tracker.peak_bytes, tracker.live_bytes) == (40, 40)
    del doubled
