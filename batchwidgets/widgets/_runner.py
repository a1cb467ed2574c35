"""One background worker per panel: the latest request wins, and the one in flight is asked to stop.

A panel's callbacks run on the kernel's main thread and must return at once; the measurement they
ask for runs here, on a daemon thread that starts when there is work and ends when there is none.

Usage:
    >>> runner = Runner(on_result=print, name="demo")
    >>> runner.submit(lambda task: 42)
    True
    >>> runner.wait(5)
    42
    True
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Any


class Task:
    """One request: ``fn(task)`` polls ``task.should_stop()`` between units of work (pass it as
    an engine function's ``should_stop``); ``cancelled`` stays True once it said yes."""

    def __init__(self, runner: Runner, fn: Callable[[Task], Any], key: Hashable | None) -> None:
        self._runner, self.fn, self.key = runner, fn, key
        self.cancelled = False

    def should_stop(self) -> bool:
        """True once a newer request waits, or the runner was cancelled or closed."""
        with self._runner._cond:
            if self._runner._closed or self._runner._pending is not None:
                self.cancelled = True
            return self.cancelled


class Runner:
    """Runs one request at a time off the kernel's main thread; only the latest waits.

    ``submit(fn)`` replaces the request waiting (if any) and makes the one in flight stop at its
    next ``task.should_stop()``: quick changes of a control cost one measurement, not one each.
    A request with the same ``key`` as the one in flight (not cancelled) is dropped instead,
    unless ``again``: it would measure the same thing.

    Parameters
    ----------
    on_result : callable, optional
        ``on_result(result)`` on the worker thread after ``fn`` returns, unless ``fn`` saw
        ``task.should_stop()`` say yes (a newer request follows, or the runner is closing):
        that result is partial, so it is dropped.
    on_error : callable, optional
        ``on_error(error)`` on the worker thread when ``fn`` raises, stopped or not. The error's
        traceback is cleared first: its frames would keep the panel's data (a model, a loader
        and its workers) alive. Without ``on_error`` the error is lost, the runner lives on.
    name : str
        The thread's name (seen in debuggers and ``threading.enumerate()``).

    Examples
    --------
    >>> results = []
    >>> runner = Runner(on_result=results.append)
    >>> runner.submit(lambda task: 1), runner.wait(5), results
    (True, True, [1])
    """

    def __init__(self, *, on_result: Callable[[Any], None] | None = None,
                 on_error: Callable[[Exception], None] | None = None,
                 name: str = "batchwidgets") -> None:
        self.on_result, self.on_error, self.name = on_result, on_error, name
        self._cond = threading.Condition()  # guards everything below
        self._pending: Task | None = None  # the latest request, not started yet
        self._in_flight: Task | None = None
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def busy(self) -> bool:
        """A request runs or waits."""
        with self._cond:
            return self._thread is not None

    def submit(self, fn: Callable[[Task], Any], *, key: Hashable | None = None,
               again: bool = False) -> bool:
        """Make ``fn`` the next request (cheap, from any thread); False when it was dropped:
        the runner is closed, or the request in flight has the same ``key`` (and not ``again``)."""
        with self._cond:
            if self._closed:
                return False
            flight = self._in_flight
            if (key is not None and not again and flight is not None and not flight.cancelled
                    and flight.key == key):
                self._pending = None  # an older different request is no longer wanted either
                return False
            self._pending = Task(self, fn, key)
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, daemon=True, name=self.name)
                self._thread.start()
            return True

    def cancel(self) -> None:
        """Drop the request waiting and ask the one in flight to stop (it may still finish)."""
        with self._cond:
            self._pending = None
            if self._in_flight is not None:
                self._in_flight.cancelled = True

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until nothing runs or waits; False when ``timeout`` seconds passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: self._thread is None, timeout)

    def close(self, timeout: float | None = None) -> bool:
        """Cancel, refuse further requests, and wait (as ``wait``) for the one in flight."""
        with self._cond:
            self._closed = True
        self.cancel()
        return self.wait(timeout)

    def _work(self) -> None:
        task = None
        try:
            while True:
                with self._cond:
                    task = None if self._closed else self._pending
                    self._pending, self._in_flight = None, task
                    if task is None:
                        return
                self._run(task)
        finally:  # also when a callback raised: wait() must never hang on a dead thread
            with self._cond:
                self._thread = self._in_flight = None
                if task is not None:  # something escaped: a later submit starts a new thread
                    self._pending = None
                self._cond.notify_all()

    def _run(self, task: Task) -> None:
        try:
            result = task.fn(task)
        except Exception as error:  # the panel shows it; the kernel and the runner live on
            error.__traceback__ = None
            if self.on_error is not None:
                self.on_error(error)
            return
        if not task.cancelled and self.on_result is not None:
            self.on_result(result)
