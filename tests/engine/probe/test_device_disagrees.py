"""The device runs out of memory where the probe's meter saw room (tests/_emulated_device.py: in
forward, in backward, in the optimizer's step, past 12 samples, under a budget of a GiB): the
answer is the device's edge, and the model then trains its next steps exactly as one that never
met find_batch (equal weights, optimizer state and loss scale after the same steps on the same
batches). Plain, AMP with a GradScaler, torch.compile here; DDP and FSDP2, on 1, 2 and 4 ranks,
in tests/engine/probe/test_ranks_fail_alone.py."""

from __future__ import annotations

import pytest
import torch
from _emulated_device import (
    WHERE,
    Device,
    batches,
    equal,
    make_batch,
    net,
    state_of,
    step_runs_out,
    train,
)
from torch import nn

import batchwidgets as bw

EDGE = 12


def _run(kind: str, where: str, probe: bool) -> tuple[int | None, list]:
    """The user's job: two steps, find_batch (``probe``), three more steps on other batches."""
    device = Device(EDGE, where)
    model = net(device)
    optimizer = step_runs_out(torch.optim.Adam(model.parameters(), lr=1e-2), device)
    amp = kind == "amp"
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8) if amp else None
    if kind == "compile":
        model = torch.compile(model, backend="aot_eager")
    train(model, optimizer, batches(2, seed=5), scaler, amp=amp)
    answer = None
    if probe:
        answer = bw.find_batch(model, make_batch, loss_fn=nn.functional.cross_entropy,
                               optimizer=optimizer, budget="1GiB", amp="fp16" if amp else None,
                               scaler=scaler, max_batch_size=16, start=8, trace="real",
                               cache=False).max_batch_size
    device.armed = False
    train(model, optimizer, batches(3), scaler, amp=amp)
    return answer, state_of(model, optimizer, scaler)


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("kind", ["plain", "amp", "compile"])
def test_after_the_device_ran_out_the_model_trains_as_if_never_probed(kind, where):
    _, untouched = _run(kind, where, probe=False)
    answer, probed = _run(kind, where, probe=True)
    assert answer == EDGE
    assert equal(probed, untouched)


# NOTE [ A reducer left mid-reduction ] and NOTE [ An FSDP2 unit left mid-step ] (engine/
# _state.py), NOTE [ A rank that runs out alone ] (probe/_ranks.py): the private members
# the state guard and the ranks' checkpoints touch, on the torch CI runs. A torch that renames
# one fails here first; the behaviour is tested in tests/engine/probe/test_ranks_fail_alone.py.
@pytest.mark.skipif(not torch.__version__.startswith("2.13"), reason="pinned to torch 2.13")
def test_the_private_members_the_state_guard_resets_exist_on_the_pinned_torch():
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    reducer = torch._C._distributed_c10d.Reducer
    for owner, name in ((reducer, "_reset_state"), (reducer, "_check_reducer_finalized"),
                        (FSDPModule, "reset_iter_state"), (FSDPModule, "reshard"),
                        (FSDPParamGroup, "unshard"), (FSDPParamGroup, "post_backward")):
        assert callable(getattr(owner, name, None)), name
    assert "_fsdp_param_groups" in FSDPState().__dict__
    assert "unsharded_accumulated_grad" in FSDPParam.__annotations__
    assert "_unsharded_param" in FSDPParam.__annotations__
    ddp = torch.nn.parallel.DistributedDataParallel
    assert "require_forward_param_sync" in ddp.__init__.__code__.co_names


@pytest.mark.parametrize("where", WHERE)
def test_after_the_device_ran_out_no_what_if_row_fits_fewer_than_the_answer(where):
    # the device's failure lowers the limit to its live bytes, taken mid-step: the per-op rows
    # (a loop that frees the output, SGD: changes that only free memory) were once predicted
    # against that and said 0, and the summary "keep_output=False: 0"
    device = Device(EDGE, where)
    model = net(device)
    optimizer = step_runs_out(torch.optim.Adam(model.parameters(), lr=1e-2), device)
    report = bw.find_batch(model, make_batch, loss_fn=nn.functional.cross_entropy,
                           optimizer=optimizer, budget="1GiB", max_batch_size=16, start=8,
                           trace="real", cache=False)
    assert report.max_batch_size == EDGE
    predicted = [row for row in report.what_if if not row.measured]
    assert predicted, report.what_if
    assert all(row.max_batch_size >= EDGE for row in predicted), report.what_if
    assert ": 0" not in report.summary()
