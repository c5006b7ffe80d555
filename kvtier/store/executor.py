"""Where the store's operations run: its I/O threads, or the thread that waits for them.

A hand-off to a sleeping I/O thread and back costs two wake-ups, which on a small
machine cost more than a 2 MiB memcpy (docs/benchmarks.md). Most callers wait at once
(the vLLM worker's load and save threads, the LMCache plug-in, the calculator), so
:class:`StealingExecutor` lets the waiter do the work itself when no I/O thread has
begun it yet: ``result()`` claims the task and runs it on the calling thread. A caller
that does not wait (callbacks, ``asyncio.wrap_future``, a ``result`` with a timeout)
gets the I/O thread as before, and tasks submitted together still run in parallel: the
waiter takes the one it waits for, the threads the rest. Whoever claims first runs the
task; the other finds it taken.

Even a task its waiter took back costs the I/O thread that was woken for it the GIL: it
must run Python to find the task claimed, and on two cores that hand-over of the GIL
costs more than a 256 KiB copy (docs/benchmarks.md, "Host tier vs memcpy"). Where
the C speedups are built, the queue is :class:`kvtier._speedups.WorkQueue`: its workers
wait, and find a task taken, without the GIL, and a task becomes due to them only
:data:`GRACE_S` after it was queued, so a caller that waits at once takes it first. A
task is due at once when its future gets a callback (``asyncio.wrap_future``) or a
``result``/``exception`` with a timeout (``concurrent.futures.wait`` does neither: it
waits out the grace). Without the speedups, a
:class:`~concurrent.futures.ThreadPoolExecutor` runs the same tasks, each claimed
through its own lock.

The store already promises no order between operations in flight (several I/O threads
run them), so a waiter running its own task earlier than the queue would changes no
contract.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

# The states Future.__init__, set_running_or_notify_cancel and set_result leave (since 3.2).
from concurrent.futures._base import FINISHED, PENDING, RUNNING
from typing import Any, Generic, Protocol, TypeVar

T = TypeVar("T")

GRACE_S = 200e-6
"""How long a queued task waits for its caller to take it back before an I/O thread may
start it: longer than a caller needs from ``submit`` to ``result()`` (a whole waited-for
no-op takes a small fraction of it), short against any transfer it delays (a caller
that does not wait, and sets no callback)."""


Callback = Callable[[Future[Any]], object]


class _Queue(Protocol):
    """:class:`kvtier._speedups.WorkQueue`."""

    def put(self, task: object, /) -> None: ...
    def take(self, task: object, /) -> bool: ...
    def hurry(self, task: object, /) -> None: ...
    def get(self) -> Any: ...
    def close(self) -> None: ...


try:
    from kvtier._speedups import WorkQueue as _WorkQueue
except ImportError:  # built without a C compiler: the thread-pool fallback below
    _WorkQueue = None


_LAZY = threading.Lock()
"""Makes a task's condition, and orders that against a quiet change of its state."""


class _Task(Future[T], Generic[T]):
    """A future that carries its own work; the first thread to :meth:`run` it does it.

    Its :class:`threading.Condition` (a Python object built per future, with a lock) is
    made on first need: when a thread other than the one running the task waits for it,
    cancels it or adds a callback. Until then nobody can be waiting, so the running
    thread moves the state itself, under :data:`_LAZY`, without the condition or a
    notify; a waiter that runs its own task (the common case) never makes one, which was
    most of a waited-for no-op's cost (``kvtier bench host --profile``).
    """

    def __init__(
        self, fn: Callable[..., T], args: tuple[object, ...], queue: _Queue | None
    ) -> None:
        # Future.__init__'s fields, less the condition (see the class).
        self._cond: threading.Condition | None = None
        self._state = PENDING
        self._result: T | None = None
        self._exception: BaseException | None = None
        self._waiters: list[Any] = []
        self._done_callbacks: list[Callback] = []
        self._work: tuple[Callable[..., T], tuple[object, ...]] | None = (fn, args)
        # Claimed by taking it out of the queue, or (fallback) through this lock.
        self._queue = queue
        self._claim = threading.Lock() if queue is None else None

    @property
    def _condition(self) -> threading.Condition:  # type: ignore[override]
        cond = self._cond
        if cond is None:
            with _LAZY:
                cond = self._cond
                if cond is None:
                    cond = self._cond = threading.Condition()
        return cond

    def run(self) -> None:
        """Do the work here unless another thread claimed it, or it was cancelled."""
        if self._queue is not None:
            if self._queue.take(self):
                self.execute()
        elif self._claim is not None and self._claim.acquire(blocking=False):
            self.execute()

    def execute(self) -> None:
        """Do the work; the caller has claimed the task."""
        work, self._work = self._work, None  # drop the references (buffers) once run
        if work is None:
            return
        with _LAZY:
            quiet = self._cond is None  # nobody has cancelled it or waits for it
            if quiet:
                self._state = RUNNING
        if not quiet and not self.set_running_or_notify_cancel():
            return
        fn, args = work
        try:
            value = fn(*args)
        except BaseException as exc:  # the waiter sees it through the future, as with a pool
            self._finish(None, exc)
        else:
            self._finish(value, None)

    def _finish(self, value: T | None, exc: BaseException | None) -> None:
        with _LAZY:
            quiet = self._cond is None
            if quiet:
                self._result, self._exception = value, exc
                self._state = FINISHED
        if quiet:
            self._invoke_callbacks()  # type: ignore[attr-defined]
        elif exc is not None:
            self.set_exception(exc)
        else:
            self.set_result(value)  # type: ignore[arg-type]

    def result(self, timeout: float | None = None) -> T:
        if timeout is None:
            self.run()
            if self._state == FINISHED:  # final: read without the condition
                exc = self._exception
                if exc is None:
                    return self._result  # type: ignore[return-value]
                try:
                    raise exc
                finally:
                    del self, exc  # the traceback keeps this frame: no cycle (as Future's)
        else:
            self._hurry()
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if timeout is None:
            self.run()
        else:
            self._hurry()
        return super().exception(timeout)

    def add_done_callback(self, fn: Callable[[Future[T]], object]) -> None:
        self._hurry()  # someone reacts to the result instead of waiting for it
        super().add_done_callback(fn)

    def _hurry(self) -> None:
        if self._queue is not None:
            self._queue.hurry(self)


def _work(queue: _Queue) -> None:
    """An I/O thread: run due tasks until the queue is closed and drained."""
    while (task := queue.get()) is not None:
        task.execute()


def _stop(queue: _Queue, threads: list[threading.Thread], wait: bool) -> None:
    queue.close()
    if wait:
        for t in threads:
            if t is not threading.current_thread():
                t.join()


class StealingExecutor:
    """A thread pool whose tasks the waiting caller may run itself (see the module).

    Args:
        threads: I/O threads.
        name: their name prefix.
        speedups: use the C queue where it is built (False: the thread-pool fallback,
            which tests compare it with).
    """

    def __init__(self, threads: int, name: str, *, speedups: bool = True) -> None:
        self._queue: _Queue | None = None
        self._pool: ThreadPoolExecutor | None = None
        if speedups and _WorkQueue is not None:
            queue: _Queue = _WorkQueue(GRACE_S)
            workers = [
                threading.Thread(target=_work, args=(queue,), name=f"{name}_{i}", daemon=True)
                for i in range(threads)
            ]
            for t in workers:
                t.start()
            self._queue = queue
            # Run at shutdown(), when the executor is collected, or at exit: queued work
            # finishes first, as a ThreadPoolExecutor's does.
            self._stop = weakref.finalize(self, _stop, queue, workers, True)
        else:
            self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=name)

    @property
    def speedups(self) -> bool:
        """Whether the C queue runs the tasks."""
        return self._queue is not None

    def submit(
        self, fn: Callable[..., T], /, *args: object, on_done: Callback | None = None
    ) -> Future[T]:
        """Queue ``fn(*args)``; ``on_done(future)`` runs when it ends (or is cancelled).

        ``on_done`` is the submitter's own bookkeeping: unlike a caller's
        ``add_done_callback``, it does not make the task due at once.
        """
        task: _Task[T] = _Task(fn, args, self._queue)
        if on_done is not None:
            # Not yet seen by another thread: no condition needed (Future's would make it).
            task._done_callbacks.append(on_done)
        if self._queue is not None:
            self._queue.put(task)  # RuntimeError after shutdown, as a pool's
        else:
            assert self._pool is not None
            self._pool.submit(task.run)
        return task

    def shutdown(self, wait: bool = True) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=wait)
        elif wait:
            self._stop()
        else:
            assert self._queue is not None
            self._queue.close()


_FINISHED_CONDITION = threading.Condition()


class Finished(Future[T]):
    """A future born finished, with its result or exception.

    A :class:`~concurrent.futures.Future` makes a :class:`threading.Condition` (a Python
    object, and a lock) in its constructor, and ``set_result`` notifies it: a cost per
    operation comparable to a small copy, for a future nobody waits on, since it is
    finished before anyone sees it. Born finished, it never waits or notifies, so it
    shares one condition for the few lines ``Future``'s methods hold it; every method
    still works (``result``, ``exception``, ``add_done_callback``, ``cancel`` (False),
    ``asyncio.wrap_future``, ``concurrent.futures.wait``).
    """

    def __init__(self, result: T | None = None, exception: BaseException | None = None) -> None:
        # Future.__init__'s fields, as set_result / set_exception leave them.
        self._condition = _FINISHED_CONDITION
        self._state = FINISHED
        self._result = result
        self._exception = exception
        self._waiters: list[Any] = []
        self._done_callbacks: list[Any] = []

    def result(self, timeout: float | None = None) -> T:
        exc = self._exception
        if exc is None:
            return self._result  # type: ignore[return-value]
        try:
            raise exc
        finally:
            del self, exc  # the traceback keeps this frame: no cycle (as Future's)


class InlineExecutor:
    """Runs each submitted call at once on the caller's thread (``io_threads=0``)."""

    def submit(
        self, fn: Callable[..., T], /, *args: object, on_done: Callback | None = None
    ) -> Future[T]:
        fut: Future[T]
        try:
            fut = Finished(fn(*args))
        except BaseException as exc:  # the caller sees it through the future, as with a pool
            fut = Finished(exception=exc)
        if on_done is not None:
            on_done(fut)
        return fut

    def shutdown(self, wait: bool = True) -> None:
        pass


INLINE = InlineExecutor()

Executor = StealingExecutor | InlineExecutor
__all__ = ["INLINE", "Executor", "InlineExecutor", "StealingExecutor"]
