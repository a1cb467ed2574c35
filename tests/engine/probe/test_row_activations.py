"""A plan for N GPUs says what each rank holds at its answer (report.parallel_plans): a row's
activations are the bytes saved for backward at the rank's peak at the row's own batch, so its
parts add up to at most what a rank can use, and they grow with the batch (NOTE [ A row's
activations, at its answer ] in engine/probe/_parallel.py). They were the small traced step's
split scaled by the batch: a Llama's one-GPU trace peaks in its optimizer step, where only the
input ids are alive (8 bytes a token), and one FSDP2 rank's split is not its peak's."""

from __future__ import annotations

import itertools

import pytest
from _plan_factories import llama_tokens, meta_llama

import batchwidgets as bw

LENGTH, VOCAB = 64, 4000
TARGETS = ("4x512MiB", "4x1GiB")


@pytest.fixture(scope="module")
def plans() -> dict[str, bw.BatchSizeReport]:
    return {target: bw.find_batch(meta_llama(256, 2, 704, VOCAB), llama_tokens(VOCAB, LENGTH),
                                  target=target, parallel="compare", cache=False)
            for target in TARGETS}


def held(row: bw.ParallelPlan) -> int:
    return (row.parameters_bytes + row.gradients_bytes + row.optimizer_bytes
            + row.communication_bytes + row.activations_bytes)


@pytest.mark.parametrize("target", TARGETS)
def test_a_rows_parts_fit_the_rank_at_its_answer(plans, target):
    report = plans[target]
    rows = report.parallel_plans
    assert {row.parallel for row in rows} == {"ddp", "zero1", "zero2", "zero3", "fsdp"}
    for row in rows:
        assert row.max_batch_size > 0, row
        assert held(row) <= report.limit_bytes, row
    chosen = next(row for row in rows if row.parallel == report.parallel)
    assert held(chosen) <= report.predict_peak_bytes(chosen.max_batch_size)


@pytest.mark.parametrize("target", TARGETS)
def test_a_rows_activations_are_the_steps_not_its_input_ids(plans, target):
    for row in plans[target].parallel_plans:
        input_bytes = row.max_batch_size * LENGTH * 8  # the int64 ids (the labels the same)
        assert row.activations_bytes > 100 * input_bytes, row


@pytest.mark.parametrize("target", TARGETS)
def test_every_strategy_saves_the_same_activations_a_sample(plans, target):
    # activations are never sharded: each strategy's rank saves the model's, by its own batch
    rows = sorted(plans[target].parallel_plans, key=lambda row: row.max_batch_size)
    for smaller, larger in itertools.pairwise(rows):
        assert smaller.activations_bytes <= larger.activations_bytes, (smaller, larger)
    per_sample = [row.activations_bytes / row.max_batch_size for row in rows]
    assert max(per_sample) == pytest.approx(min(per_sample), rel=0.01)


def test_a_larger_answer_never_holds_fewer_activations(plans):
    small, large = ({row.parallel: row for row in plans[target].parallel_plans}
                    for target in TARGETS)
    for name, row in small.items():
        assert large[name].max_batch_size > row.max_batch_size
        assert large[name].activations_bytes > row.activations_bytes, (row, large[name])
