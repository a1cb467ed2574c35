"""BatchSizeReport: a frozen, comparable, picklable record; its recommendation follows the rule it
states; its HTML escapes every value. No torch needed."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from batchwidgets.results import Attempt, BatchSizeReport, MemoryModel

MIB = 2**20


def report_with(attempts: tuple[Attempt, ...], **fields) -> BatchSizeReport:
    ran = [a.batch_size for a in attempts if a.fits]
    failed = [a.batch_size for a in attempts if not a.fits]
    defaults = {"max_batch_size": max(ran), "first_oom_batch_size": min(failed, default=None),
                "attempts": attempts, "device": "cuda:0", "budget_bytes": 64 * MIB,
                "limit_bytes": 64 * MIB, "memory_model": MemoryModel(2 * MIB, 0.5 * MIB)}
    return BatchSizeReport(**{**defaults, **fields})


STEADY = (Attempt(8, True, 6 * MIB, 0.08), Attempt(64, True, 34 * MIB, 0.60),
          Attempt(100, True, 52 * MIB, 0.95), Attempt(101, False, 65 * MIB, None))


def test_a_report_has_the_contract_fields_and_the_fitted_memory_model():
    names = {field.name for field in dataclasses.fields(BatchSizeReport)}
    assert names >= {"max_batch_size", "first_oom_batch_size", "attempts", "device",
                     "budget_bytes", "memory_model"}
    assert {field.name for field in dataclasses.fields(Attempt)} >= {
        "batch_size", "fits", "peak_memory_bytes", "step_time_s"}
    report = report_with(STEADY)
    assert report.recommended_batch_size == 90
    assert report.attempts[1].samples_per_s == pytest.approx(64 / 0.6)


def test_a_report_is_frozen_comparable_picklable_and_plain_data():
    report = report_with(STEADY)
    with pytest.raises(dataclasses.FrozenInstanceError):
        report.max_batch_size = 7
    assert pickle.loads(pickle.dumps(report)) == report
    data = dataclasses.asdict(report)
    assert data["attempts"][3] == {"batch_size": 101, "fits": False, "peak_memory_bytes": 65 * MIB,
                                   "step_time_s": None, "peak_reserved_bytes": None,
                                   "activation_peak_bytes": None, "error": "",
                                   "predicted_peak_bytes": None, "predicted_fits": None,
                                   "fake": False}
    assert data["memory_model"] == {"fixed_bytes": 2 * MIB, "per_sample_bytes": 0.5 * MIB}


@pytest.mark.parametrize(("max_batch_size", "headroom", "multiple_of", "expected"), [
    (100, 0.9, 1, 90), (100, 0.9, 8, 88), (97, 0.9, 1, 87), (8, 0.5, 8, 8), (1, 0.9, 1, 1),
    (100, 1.0, 1, 100)])
def test_recommended_is_headroom_times_max_rounded_down_to_multiple_of(
        max_batch_size, headroom, multiple_of, expected):
    attempts = (Attempt(max_batch_size, True, MIB, 1.0),)
    report = report_with(attempts, headroom=headroom, multiple_of=multiple_of)
    assert report.recommended_batch_size == expected
    assert report.recommendation_rule == (f"headroom {headroom:g} x max_batch_size, rounded down "
                                          f"to a multiple of {multiple_of}")


def test_when_throughput_saturates_earlier_the_fastest_size_is_recommended():
    saturated = (Attempt(8, True, 6 * MIB, 0.04), Attempt(32, True, 18 * MIB, 0.10),  # 320/s
                 Attempt(100, True, 52 * MIB, 0.40), Attempt(101, False, 65 * MIB, None))  # 250/s
    report = report_with(saturated)
    assert report.recommended_batch_size == 32
    assert "fastest size measured" in report.recommendation_rule
    nearly = report_with((*saturated[:1], Attempt(32, True, 18 * MIB, 0.125),  # 256/s
                          *saturated[2:]))
    assert nearly.recommended_batch_size == 90  # not 10% faster than the largest: headroom rule


def test_on_the_cpu_step_times_do_not_rank_throughput_and_the_rule_says_so():
    saturated = (Attempt(32, True, 18 * MIB, 0.10), Attempt(100, True, 52 * MIB, 0.40))
    report = report_with(saturated, device="cpu")
    assert report.recommended_batch_size == 90
    assert report.recommendation_rule.startswith("headroom 0.9 x max_batch_size")
    assert "CPU" in report.recommendation_rule


def test_with_headroom_changes_the_recommendation_without_new_measurements():
    report = report_with(STEADY)
    relaxed = report.with_headroom(0.5)
    assert (relaxed.recommended_batch_size, relaxed.attempts) == (50, report.attempts)
    with pytest.raises(ValueError, match="headroom") as info:
        report.with_headroom(0)
    assert "headroom should be in (0, 1], but got headroom=0" in str(info.value)


def test_headroom_bytes_is_what_the_model_leaves_under_the_limit_at_the_recommendation():
    report = report_with(STEADY)
    assert report.headroom_bytes == 64 * MIB - (2 * MIB + 0.5 * MIB * 90)
    assert report_with(STEADY, memory_model=None).headroom_bytes is None


def test_counts_and_summary():
    report = report_with(STEADY)
    assert (report.n_attempts, report.n_ooms) == (4, 1)
    assert report.summary() == ("max_batch_size=100, recommended_batch_size=90 (cuda:0, 4 tries, "
                                "1 OOM)")


def test_repr_html_escapes_every_value():
    evil = "<img src=x onerror=alert(1)>"
    report = report_with(STEADY, device=evil, amp=evil, stop_reason=evil)
    page = report._repr_html_()
    assert "<img src=x" not in page
    assert page.count("&lt;img src=x onerror=alert(1)&gt;") >= 3


def test_a_memory_model_predicts_and_inverts_itself():
    model = MemoryModel(fixed_bytes=1000, per_sample_bytes=100)
    assert model.predict_bytes(10) == 2000
    assert model.largest_batch_size(2050) == 10
    assert model.largest_batch_size(2050, multiple_of=4) == 8
    assert model.largest_batch_size(500) == 0
    assert MemoryModel(1000, 0).largest_batch_size(2000) is None  # flat: no boundary in sight


def tracker_report(n_losses: int = 10_000, **fields):
    from batchwidgets.results import NoiseTrackerReport

    return NoiseTrackerReport(**{
        "history": tuple((i, 10.0 + i, 2.0, 3.0) for i in range(1, 301)),
        "losses": tuple(1.0 / (i + 1) for i in range(n_losses)), "b_simple": 12.0,
        "b_simple_error": 0.5, "grad_norm_sq": 2.0, "trace_cov": 24.0, "measurable": True,
        "reason": "", "n_updates": 300, "micro_batch_size": 8, "effective_batch_size": 32,
        **fields})


def test_a_tracker_report_repr_leaves_out_its_long_series():
    report = tracker_report()
    text = repr(report)
    assert len(text) < 2_000  # 124,189 characters when the 10,000 losses were in it
    assert "b_simple=12.0" in text
    assert "0.0001" not in text
    assert len(report.losses) == 10_000  # still there, only not printed


def test_history_points_are_named_and_still_unpack_as_the_old_four_tuples():
    from batchwidgets.results import NoisePoint

    report = tracker_report(history_errors=(None,) * 299 + (0.5,))
    last = report.history[-1]
    assert isinstance(last, NoisePoint)
    assert (last.update, last.b_simple, last.b_simple_error) == (300, 310.0, 0.5)
    update, b_simple, grad_norm_sq, trace_cov = last
    assert (update, b_simple, grad_norm_sq, trace_cov) == (300, 310.0, 2.0, 3.0)
    assert last[1] == 310.0
    assert len(last) == 4
    assert report.history_errors[-1] == 0.5
    assert report.history_errors[0] is None
    again = tracker_report(**{k: v for k, v in dataclasses.asdict(report).items()
                              if k in ("history", "history_errors")})
    assert again == report  # asdict writes each point as a dict; the report takes it back
    points = tracker_report(history=report.history)  # points in, the errors come with them
    assert points.history_errors == report.history_errors
    assert points == report


def test_every_report_renders_the_rows_of_its_table_through_one_surface():
    from batchwidgets.results import AccumulationReport, DataStallReport

    reports = [
        report_with((Attempt(2, True, 2**20, 0.1), Attempt(4, False, None, None))),
        AccumulationReport(steps=4, micro_steps=8, real_steps=2, skipped_steps=0,
                           remainder="none", remainder_micro_steps=0, micro_batch_size=8,
                           world_size=1, target_batch_size=None, skips_allreduce=False,
                           losses=(1.0, 0.5), grad_norms=()),
        DataStallReport(stall_fraction=0.25, step_time_s=0.04, replay_step_time_s=0.03,
                        data_wait_s=0.01, n_steps=10, device="cpu"),
        tracker_report(n_losses=10),
        tracker_report(n_losses=10).schedule,
    ]
    for report in reports:
        page = report._repr_html_()
        assert page.startswith('<div><table class="batchwidgets"><caption>batchwidgets: ')
        for label, _ in report.rows():
            assert f"<td>{label}</td>".replace("'", "&#x27;") in page, (type(report), label)
        assert report.summary()
