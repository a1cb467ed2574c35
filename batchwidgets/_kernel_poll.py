"""Widget clicks while a cell runs: ``WidgetPoll().poll()`` dispatches the kernel's pending comm
messages (and only those) from inside the running cell, on ipykernel 6.x and 7.x.

Usage:
    >>> poll = WidgetPoll()       # outside a kernel: available is False, poll() does nothing
    >>> poll.poll()
    0
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time
import warnings
from typing import Any

from ._warnings import BatchwidgetsWarning

# NOTE [ Widget messages while a cell runs ]
# A click in the browser reaches the kernel as a comm message (comm_open / comm_msg / comm_close)
# on the shell channel, which is served by the main thread's event loop, and that loop does not
# turn while a synchronous cell runs. poll() takes the shell messages waiting for the main
# thread, dispatches the comm ones at once and hands every other one back, in order, to where
# the kernel would have taken it from. It rests on these kernel internals, hence the CI test of
# both lines (tests/magics/test_kernel_poll.py):
# - ipykernel 7.x: a shell-channel thread forwards each message over an inproc ZMQ PAIR socket
#   (``kernel.shell_channel_thread.manager.get_shell_channel_to_subshell_pair(None)``; without
#   that thread, ``kernel.shell_stream`` itself) to a ZMQStream on the main loop, whose
#   ``_recv_callback`` runs ``kernel.shell_main``. Messages wait in that socket: poll() receives
#   them (NOBLOCK, until empty, so the socket's edge-triggered fd cannot strand one), and
#   schedules the callback for each held message with ``io_loop.add_callback``. Those callbacks
#   sit in the loop's ready queue before any later socket read, and shell_main's asyncio lock is
#   FIFO, so they run after the cell and before whatever arrives later. (jupyter-ui-poll calls
#   ``kernel.do_one_iteration``, gone in 7.x: hence its silent no-op there.)
# - ipykernel 6.x: ``kernel.shell_stream.flush()`` moves the socket's messages into
#   ``kernel.msg_queue`` (a tornado Queue of ``(counter, dispatch, args)``), as
#   ``do_one_iteration`` does; poll() empties that queue and puts the held items back in order.
# Comm messages are dispatched the way ``dispatch_shell`` does it, synchronously:
# ``kernel.set_parent``, status busy, ``kernel.shell_handlers[msg_type]`` (the CommManager's,
# synchronous on both lines), flush the output streams, status idle. The idle status matters:
# ipywidgets' front end counts a widget's updates in flight and holds further ones until the
# kernel says idle with that update as parent. Afterwards ``kernel.set_parent`` puts back the
# cell's parent header and identity (both lines keep them in ``get_parent("shell")`` and
# ``_parent_ident["shell"]``), so the cell's later prints and displays stay in the cell, and
# poll() says busy again under the cell: JupyterLab's kernel indicator and jupyter_server's
# execution_state (which the idle-kernel culler reads) follow every status message whatever its
# parent, and would show an idle kernel for the rest of the cell.
# A held message is classified from its header frame without ``session.deserialize(content=
# True)``: that records the signature, and the kernel would then drop the message as a replay.
# Taking and handing back run with Ctrl-C deferred to the end of each, so an interrupt cannot
# fall between the two and lose a request. Older 6.x output streams (Colab's 6.17.1, on which
# the kernel tests pass too, run by hand) keep one buffer, sent under whatever parent is current
# at flush time: poll() flushes the cell's output before it sets a comm message as parent.
# Comm messages that arrive after a queued execute_request still run now (ipykernel 7.4 does the
# same for an async cell); everything else keeps its order and waits for the cell.

COMM_MESSAGES = frozenset({"comm_open", "comm_msg", "comm_close"})
WHY_PREFIX = "widget changes made while this cell runs apply when it ends: "


def _running_kernel() -> Any | None:
    """The ipykernel kernel of this process, found only among the modules already loaded: a
    kernel that runs has imported IPython and ipykernel, and a process without one (plain
    Python, terminal IPython, pytest) must not pay for importing them."""
    if "ipykernel" not in sys.modules or "IPython" not in sys.modules:
        return None
    shell = sys.modules["IPython"].get_ipython()
    return getattr(shell, "kernel", None)


class _Kernel7Queue:
    """ipykernel 7.x: the main thread's messages wait in a ZMQ socket read by a ZMQStream."""

    def __init__(self, kernel: Any) -> None:
        channel = getattr(kernel, "shell_channel_thread", None)
        if channel is not None:
            manager = channel.manager
            self.source = manager.get_shell_channel_to_subshell_pair(None).to_stream
            self.reply_stream = manager.get_subshell_to_shell_channel_socket(None)
            self.thread = getattr(channel, "parent_thread", threading.main_thread())
        else:
            self.source = self.reply_stream = kernel.shell_stream
            self.thread = threading.main_thread()
        if self.source is None or not callable(self.source._recv_callback):
            raise LookupError("the kernel reads no shell messages on its main thread")
        self.kernel = kernel
        self.zmq = sys.modules["zmq"]

    def pending(self) -> bool:
        return bool(self.source.socket.EVENTS & self.zmq.POLLIN)

    def take(self) -> list[Any]:
        socket, taken = self.source.socket, []
        while True:
            try:
                taken.append(socket.recv_multipart(self.zmq.NOBLOCK, copy=False))
            except self.zmq.Again:
                return taken

    @staticmethod
    def frames(item: Any) -> list[Any] | None:
        return item

    def give_back(self, held: list[Any]) -> None:
        for item in held:  # in order, ahead of anything the socket receives later
            self.kernel.io_loop.add_callback(self.source._recv_callback, item)


class _Kernel6Queue:
    """ipykernel 6.x: messages wait in the shell socket, then in ``kernel.msg_queue``."""

    def __init__(self, kernel: Any) -> None:
        if kernel.shell_stream is None or not hasattr(kernel.msg_queue, "get_nowait"):
            raise LookupError("the kernel has no shell stream or message queue")
        self.kernel, self.reply_stream = kernel, kernel.shell_stream
        self.thread = threading.main_thread()
        self.pollin = sys.modules["zmq"].POLLIN

    def pending(self) -> bool:
        return bool(self.kernel.msg_queue.qsize()
                    or self.kernel.shell_stream.socket.EVENTS & self.pollin)

    def take(self) -> list[Any]:
        self.kernel.shell_stream.flush(self.pollin)  # socket -> msg_queue, as do_one_iteration
        queue, taken = self.kernel.msg_queue, []
        while queue.qsize():
            taken.append(queue.get_nowait())
        return taken

    def frames(self, item: Any) -> list[Any] | None:
        dispatch, args = item[-2], item[-1]
        return args[0] if dispatch == self.kernel.dispatch_shell and len(args) == 1 else None

    def give_back(self, held: list[Any]) -> None:
        for item in held:  # the queue was emptied and only this thread fills it
            self.kernel.msg_queue.put_nowait(item)


class WidgetPoll:
    """Dispatches the kernel's pending widget (comm) messages while a cell runs.

    Call ``poll()`` between the steps of a long loop (the live loader does, between batches): a
    click on any widget, a panel's or the user's own, then takes effect mid-cell. Every other
    message sent to the kernel (another cell, completions) keeps its order and waits for the
    cell to end, and the cell's own output stays in the cell. Outside a kernel, or from a thread
    other than the kernel's main thread, ``poll()`` does nothing. Where polling cannot work, the
    first ``poll()`` says so in one ``BatchwidgetsWarning`` and the changes apply when the cell
    ends. See NOTE [ Widget messages while a cell runs ].

    Parameters
    ----------
    min_interval_s
        The least time between two looks at the kernel's queue: calls in between return at once.

    Examples
    --------
    >>> poll = WidgetPoll(min_interval_s=0.05)
    >>> for step in range(3):
    ...     n_dispatched = poll.poll()
    """

    def __init__(self, min_interval_s: float = 0.05) -> None:
        if isinstance(min_interval_s, bool) or not isinstance(min_interval_s, (int, float)):
            raise TypeError(f"min_interval_s should be a number of seconds, but got "
                            f"min_interval_s={min_interval_s!r}; pass a number such as 0.05.")
        if not min_interval_s >= 0:
            raise ValueError(f"min_interval_s should be >= 0, but got min_interval_s="
                             f"{min_interval_s!r}; pass a number of seconds such as 0.05.")
        self.min_interval_s = float(min_interval_s)
        self.available = False
        self.reason = "not running in an IPython kernel"  # why not available; "" when it is
        self._queue: _Kernel6Queue | _Kernel7Queue | None = None
        self._next_s = float("inf")  # the next time a poll looks; inf: never
        self._warn_first = False
        self._busy = False
        kernel = _running_kernel()
        if kernel is None:
            return  # outside a kernel: quiet
        self._next_s = 0.0
        try:
            line = _Kernel7Queue if hasattr(kernel, "shell_main") else _Kernel6Queue
            self._queue = line(kernel)
        except Exception as err:  # a kernel line whose internals are not the ones we know
            version = getattr(sys.modules.get("ipykernel"), "__version__", "?")
            self._turn_off(f"ipykernel {version} keeps its messages where batchwidgets cannot "
                           f"reach them ({type(err).__name__}: {err})")
            return
        self.kernel, self.available, self.reason = kernel, True, ""

    def poll(self, stacklevel: int = 2) -> int:
        """Dispatch the comm messages waiting now; return how many (0 between intervals).
        ``stacklevel``: where the one warning points, as for ``warnings.warn`` (the user's loop,
        for a caller that polls from a hook)."""
        now = time.perf_counter()
        if now < self._next_s:
            return 0
        if self._warn_first:
            self._warn_first, self._next_s = False, float("inf")
            warnings.warn(WHY_PREFIX + self.reason, BatchwidgetsWarning,
                          stacklevel=stacklevel)
            return 0
        if self._busy or threading.current_thread() is not self._queue.thread:
            return 0
        self._next_s = now + self.min_interval_s
        self._busy = True
        try:
            return self._dispatch_pending()
        except Exception as err:  # never into the user's loop: polling stops, with one line
            self._turn_off(f"polling failed ({type(err).__name__}: {err})")
            self._warn_first, self._next_s = False, float("inf")
            warnings.warn(WHY_PREFIX + self.reason, BatchwidgetsWarning,
                          stacklevel=stacklevel)
            return 0
        finally:
            self._busy = False

    def _turn_off(self, reason: str) -> None:
        self.available, self.reason = False, reason
        self._warn_first, self._next_s = True, 0.0

    def _dispatch_pending(self) -> int:
        queue = self._queue
        if not queue.pending():
            return 0
        kernel, taken, held, dispatched, done = self.kernel, [], [], 0, 0
        parent, ident = kernel.get_parent("shell"), kernel._parent_ident["shell"]
        try:
            with _interrupts_deferred():  # a message taken is a message given back
                taken.extend(queue.take())
            for item in taken:
                message = self._comm_message(queue.frames(item))
                done += 1
                if message is None:
                    held.append(item)
                    continue
                if not dispatched:
                    _flush_output()  # the cell's output so far goes out under the cell
                dispatched += 1
                self._dispatch(*message)
        finally:
            with _interrupts_deferred():  # an interrupt may have left some untouched
                queue.give_back(held + taken[done:])
            if dispatched:  # the cell's parent back, and its busy (the update said idle)
                kernel.set_parent(ident, parent, channel="shell")
                kernel._publish_status("busy", "shell")
        return dispatched

    def _comm_message(self, frames: list[Any] | None) -> tuple[list, dict] | None:
        """(identities, message) for a well-formed comm message, else None (held)."""
        if frames is None:
            return None
        session = self.kernel.session
        try:
            identities, parts = session.feed_identities(frames, copy=False)
            header = session.unpack(getattr(parts[1], "bytes", parts[1]))
            if header.get("msg_type") not in COMM_MESSAGES:
                return None
            return identities, session.deserialize(parts, content=True, copy=False)
        except Exception:  # malformed or forged: the kernel logs and drops it, as always
            return None

    def _dispatch(self, identities: list, message: dict) -> None:
        kernel = self.kernel
        kernel.set_parent(identities, message, channel="shell")
        kernel._publish_status("busy", "shell")
        try:
            handler = kernel.shell_handlers.get(message["header"]["msg_type"])
            result = handler(self._queue.reply_stream, identities, message)
            if hasattr(result, "__await__"):  # a coroutine handler: it runs when the cell ends
                kernel.io_loop.add_callback(lambda: result)
        except Exception:  # a widget's observer failed: logged, as the kernel does
            kernel.log.error("Exception in message handler:", exc_info=True)
        finally:
            _flush_output()
            kernel._publish_status("idle", "shell")


@contextlib.contextmanager
def _interrupts_deferred():
    """Hold a Ctrl-C (SIGINT) that lands inside the block until it ends, then deliver it to the
    handler in place, so that it cannot fall between taking a message and keeping it."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signals are delivered to the main thread only
        return
    presses: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: presses.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if presses:
            signal.raise_signal(signal.SIGINT)


def _flush_output() -> None:
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()
