"""The gallery: a report of every type, each made by the engine that makes it (on the CPU), built
once per process (a session fixture) and read by test_report_consistency.py alone: under
``--dist loadfile`` a file is one worker, and a second file reading it would build it again in
the other worker. The reports are frozen dataclasses; a test that wants one changed makes a
copy (dataclasses.replace)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

import batchwidgets as bw
from batchwidgets._warnings import BatchwidgetsWarning
from batchwidgets.datasets import SlowDataset
from batchwidgets.engine.probe import NoBatchSizeFits
from batchwidgets.integrations._fit import split_report


def cnn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                         nn.ReLU(), nn.Flatten(), nn.Linear(8 * 8 * 8, 10))


def images(n):
    return torch.randn(n, 3, 8, 8), torch.randint(0, 10, (n,))


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))


def features(n):
    return torch.randn(n, 16), torch.randint(0, 4, (n,))


class Tagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(16, 4)

    def forward(self, x):
        return self.linear(x)


def sequences(n, length):
    return torch.randn(n, length, 16), torch.randint(0, 4, (n, length))


def per_token(out, y):
    return nn.functional.cross_entropy(out.flatten(0, 1), y.flatten())


class Stream(IterableDataset):
    def __init__(self, data):
        self.data = data

    def __iter__(self):
        return iter(self.data)


def probes() -> dict:
    cross_entropy = nn.functional.cross_entropy
    image = images(1)[0][0]
    try:
        bw.find_batch(cnn(), images, loss_fn=cross_entropy, budget="64KiB", device="cpu")
    except NoBatchSizeFits as error:
        nothing = error.report
    return {
        "find_batch": bw.find_batch(cnn(), images, loss_fn=cross_entropy, budget="8MiB",
                                    device="cpu"),
        "find_batch real steps only": bw.find_batch(cnn(), images, loss_fn=cross_entropy,
                                                    budget="8MiB", device="cpu", trace="real"),
        # the MLP: the measured what-ifs (bf16, fp16) of the CNN at 8 MiB took 117 s of CPU
        "find_batch of a Dataset, what_if": bw.find_batch(
            mlp(), TensorDataset(*features(300)), loss_fn=cross_entropy, budget="1MiB",
            device="cpu", what_if=True),
        "find_batch of one tensor": bw.find_batch(cnn(), image, budget="8MiB", device="cpu",
                                                  loss_fn=lambda out: out.square().mean()),
        "find_batch nothing fits": nothing,
        "find_batch frontier": bw.find_batch(Tagger(), sequences, loss_fn=per_token,
                                             budget="4MiB", device="cpu", seq_len=[8, 32]),
        "plan": bw.find_batch(mlp(), features, loss_fn=cross_entropy, target="T4"),
        "plan what_if": bw.find_batch(mlp(), features, loss_fn=cross_entropy, target="T4",
                                      what_if=True),
        "plan ranks": bw.find_batch(mlp(), features, loss_fn=cross_entropy, target="2xT4",
                                    parallel="compare"),
    }


def noise_reports() -> dict:
    generator = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(200, 16, generator=generator),
                         torch.randint(0, 4, (200,), generator=generator))
    model = mlp()
    with torch.no_grad():
        model[2].bias.copy_(torch.tensor([3.0, 0.0, 0.0, 0.0]))  # a gradient above the noise
    cross_entropy = nn.functional.cross_entropy
    shuffled = DataLoader(data, batch_size=16, shuffle=True)
    with pytest.warns(BatchwidgetsWarning, match="does not shuffle"):
        in_order = bw.measure_noise(model, DataLoader(data, batch_size=16), cross_entropy)
    return {
        "measure_noise whole": bw.measure_noise(model, data, cross_entropy,
                                                batch_sizes=(1, 8, 32)),
        "measure_noise N of M": bw.measure_noise(model, shuffled, cross_entropy,
                                                 max_examples=64),
        "measure_noise unknown size": bw.measure_noise(model, Stream(data), cross_entropy,
                                                       max_examples=50),
        "measure_noise not measurable": bw.measure_noise(mlp(), data, cross_entropy,
                                                         max_examples=16, batch_sizes=(1, 4)),
        "measure_noise unshuffled": in_order,
    }


def training_reports() -> tuple[dict, dict]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 10, generator=generator)
    data = TensorDataset(x, (x[:, 0] + 0.5 * torch.randn(1024, generator=generator) > 0).long())
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    cross_entropy = nn.functional.cross_entropy
    critical = bw.critical_batch(model, data, optimizer=optimizer, loss_fn=cross_entropy,
                                 base_batch_size=8)
    tracker = bw.NoiseTracker(ema=0.95, overhead_target=None, max_batch_size=256)
    loader = DataLoader(data, batch_size=16, shuffle=True, drop_last=True,
                        generator=torch.Generator().manual_seed(0))
    with bw.accumulate(optimizer, steps="auto", model=model, noise=tracker) as acc:
        for _ in range(4):
            for inputs, targets in loader:
                cross_entropy(model(inputs), targets).backward()
                optimizer.step()
                optimizer.zero_grad()
    made = {"critical_batch": critical, "accumulate auto": acc.report,
            "NoiseTracker": tracker.report, "schedule": tracker.report.schedule}
    tracker.critical = critical
    made |= {"NoiseTracker with critical": tracker.report,
             "schedule from critical": tracker.report.schedule}
    return made, {"tracker": tracker}


def loader_reports() -> tuple[dict, dict]:
    slow = SlowDataset(256, shape=(3, 8, 8), work_ms=0.2)
    tuned = bw.tune_loader(slow, "cpu", batch_size=16, max_workers=1, duration_s=0.1,
                           step=lambda batch: batch[0].sum())
    live = bw.live_loader(slow, batch_size=16)
    for i, _ in enumerate(live):
        if i == 4:
            live.set(num_workers=1)
        if i == 10:
            break
    return ({"tune_loader": tuned, "data_stall": tuned.stall, "live_loader": live.report},
            {"live": live})


@pytest.fixture(scope="session")
def gallery():
    made = probes()
    made["memory_split"] = made["find_batch"].memory_split
    # what fit_trainer and BatchSizeCallback return: their split of the probe's answer
    made["batch_split"] = split_report(made["find_batch"], 96, world_size=1, stacklevel=1)
    made |= noise_reports()
    trained, objects = training_reports()
    made |= trained
    loaders, live = loader_reports()
    return made | loaders, objects | live


