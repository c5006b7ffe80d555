"""Where the store's operations run: its I/O threads, or the thread that waits for them.

A hand-off to a sleeping I/O thread and back costs two wake-ups: 70-230 us on a small VM,
more than a 2 MiB memcpy. Most callers wait at once (the vLLM worker's load and save
threads, the LMCache plug-in, the calculator), so :class:`StealingExecutor` lets the
waiter do the work itself when no I/O thread has begun it yet: ``result()`` claims the
task and runs it on the calling thread. A caller that does not wait (callbacks,
``asyncio.wrap_future``, a ``result`` with a timeout) gets the I/O thread as before, and
tasks submitted together still run in parallel: the waiter takes the one it waits for,
the threads the rest. Whoever claims first runs the task; the other finds it taken.

The store already promises no order between operations in flight (several I/O threads
run them), so a waiter running its own task earlier than the queue would changes no
contract.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, TypeVar

T = TypeVar("T")


class _Task(Future[T], Generic[T]):
    """A future that carries its own work; the first thread to :meth:`run` it does it."""

    def __init__(self, fn: Callable[..., T], args: tuple[object, ...]) -> None:
        super().__init__()
        self._work: tuple[Callable[..., T], tuple[object, ...]] | None = (fn, args)
        self._claim = threading.Lock()

    def run(self) -> None:
        """Do the work here unless another thread claimed it, or it was cancelled."""
        if not self._claim.acquire(blocking=False):
            return
        work, self._work = self._work, None  # drop the references (buffers) once run
        if work is None or not self.set_running_or_notify_cancel():
            return
        fn, args = work
        try:
            value = fn(*args)
        except BaseException as exc:  # the waiter sees it through the future, as with a pool
            self.set_exception(exc)
        else:
            self.set_result(value)

    def result(self, timeout: float | None = None) -> T:
        if timeout is None:
            self.run()
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if timeout is None:
            self.run()
        return super().exception(timeout)


class StealingExecutor:
    """A thread pool whose tasks the waiting caller may run itself (see the module)."""

    def __init__(self, threads: int, name: str) -> None:
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=name)

    def submit(self, fn: Callable[..., T], /, *args: object) -> Future[T]:
        task: _Task[T] = _Task(fn, args)
        self._pool.submit(task.run)
        return task

    def shutdown(self, wait: bool = True) -> None:
        self._pool.shutdown(wait=wait)


class InlineExecutor:
    """Runs each submitted call at once on the caller's thread (``io_threads=0``)."""

    def submit(self, fn: Callable[..., T], /, *args: object) -> Future[T]:
        fut: Future[T] = Future()
        try:
            fut.set_result(fn(*args))
        except BaseException as exc:  # the caller sees it through the future, as with a pool
            fut.set_exception(exc)
        return fut

    def shutdown(self, wait: bool = True) -> None:
        pass


INLINE = InlineExecutor()

Executor = StealingExecutor | InlineExecutor
__all__ = ["INLINE", "Executor", "InlineExecutor", "StealingExecutor"]
