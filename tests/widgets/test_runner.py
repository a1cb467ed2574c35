"""widgets._runner.Runner: the latest request wins, the one in flight is asked to stop, results and
errors reach their callbacks off the main thread, and wait/close never hang. Requests are real
functions on a real thread, held at known points by events (no sleeps, no timing)."""

from __future__ import annotations

import threading

import pytest

from batchwidgets.widgets._runner import Runner, Task

WAIT_S = 30


class Held:
    """A request that runs until released or asked to stop, recording what it saw."""

    def __init__(self, value: object) -> None:
        self.value = value
        self.started, self.release = threading.Event(), threading.Event()
        self.stopped = False
        self.thread: threading.Thread | None = None

    def __call__(self, task: Task) -> object:
        self.thread = threading.current_thread()
        self.started.set()
        while not self.release.wait(0.001):
            if task.should_stop():
                self.stopped = True
                return ("partial", self.value)
        return self.value


def collecting() -> tuple[Runner, list, list]:
    results: list = []
    errors: list = []
    return Runner(on_result=results.append, on_error=errors.append, name="test-runner"), \
        results, errors


def test_a_request_runs_off_the_calling_thread_and_its_result_reaches_on_result():
    runner, results, errors = collecting()
    request = Held(7)
    request.release.set()
    assert runner.submit(request)
    assert runner.wait(WAIT_S)
    assert results == [7]
    assert errors == []
    assert request.thread is not threading.current_thread()
    assert request.thread.name == "test-runner"
    assert not runner.busy


def test_the_latest_request_wins_and_the_one_in_flight_is_stopped_and_dropped():
    runner, results, _ = collecting()
    first, skipped, last = Held(1), Held(2), Held(3)
    runner.submit(first)
    assert first.started.wait(WAIT_S)
    runner.submit(skipped)
    runner.submit(last)  # replaces `skipped`, which never starts
    last.release.set()
    assert runner.wait(WAIT_S)
    assert first.stopped  # its should_stop() said yes once a newer request waited
    assert not skipped.started.is_set()
    assert results == [3]  # the partial result of `first` was dropped


def test_the_same_key_as_the_request_in_flight_is_not_started_twice_unless_again():
    runner, results, _ = collecting()
    first = Held("a")
    runner.submit(first, key="a")
    assert first.started.wait(WAIT_S)
    assert not runner.submit(Held("a again"), key="a")  # dropped: it measures the same
    assert runner.busy
    again = Held("forced")
    again.release.set()
    assert runner.submit(again, key="a", again=True)
    assert runner.wait(WAIT_S)
    assert first.stopped
    assert results == ["forced"]


def test_an_error_reaches_on_error_without_its_traceback_and_the_runner_lives_on():
    runner, results, errors = collecting()

    def boom(task: Task) -> None:
        raise ValueError("cannot open shard 3")

    runner.submit(boom)
    assert runner.wait(WAIT_S)
    assert [str(e) for e in errors] == ["cannot open shard 3"]
    assert errors[0].__traceback__ is None  # its frames would keep the panel's data alive
    ok = Held("next")
    ok.release.set()
    runner.submit(ok)
    assert runner.wait(WAIT_S)
    assert results == ["next"]


def test_cancel_stops_the_request_in_flight_and_drops_the_waiting_one():
    runner, results, _ = collecting()
    first, waiting = Held(1), Held(2)
    runner.submit(first)
    assert first.started.wait(WAIT_S)
    runner.submit(waiting)
    runner.cancel()
    assert runner.wait(WAIT_S)
    assert first.stopped
    assert not waiting.started.is_set()
    assert results == []


def test_wait_with_a_timeout_returns_false_while_busy():
    runner, _, _ = collecting()
    request = Held(1)
    runner.submit(request)
    assert request.started.wait(WAIT_S)
    assert runner.wait(0.01) is False
    request.release.set()
    assert runner.wait(WAIT_S) is True


def test_close_stops_the_request_in_flight_and_refuses_further_ones():
    runner, results, _ = collecting()
    request = Held(1)
    runner.submit(request)
    assert request.started.wait(WAIT_S)
    assert runner.close(WAIT_S)
    assert request.stopped
    assert not runner.submit(Held(2))
    assert not runner.busy
    assert results == []


def test_a_callback_that_raises_does_not_leave_wait_hanging():
    failures: list = []
    threads: list[threading.Thread] = []

    def bad_callback(thread: object) -> None:
        if isinstance(thread, threading.Thread):
            threads.append(thread)
            raise RuntimeError("a bug in on_result")

    previous = threading.excepthook
    threading.excepthook = failures.append  # the thread's uncaught error, not pytest's
    try:
        runner = Runner(on_result=bad_callback)
        runner.submit(lambda task: threading.current_thread())
        assert runner.wait(WAIT_S)
        threads[0].join(WAIT_S)  # the error reaches the excepthook as the thread ends
    finally:
        threading.excepthook = previous
    assert [str(f.exc_value) for f in failures] == ["a bug in on_result"]
    assert not runner.busy
    assert runner.submit(lambda task: 2)  # a new thread starts
    assert runner.wait(WAIT_S)


@pytest.mark.parametrize("again", [False, True])
def test_requests_without_a_key_always_replace_each_other(again):
    runner, results, _ = collecting()
    first = Held(1)
    runner.submit(first)
    assert first.started.wait(WAIT_S)
    second = Held(2)
    second.release.set()
    assert runner.submit(second, again=again)
    assert runner.wait(WAIT_S)
    assert results == [2]
