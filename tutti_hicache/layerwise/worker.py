"""A daemon thread that runs jobs from its queue: the loader's and the offloader's.

    w = Worker(name, run)      run(job) for every job put, in order, on the thread `name`
    w.put(job); w.drain()      drain: wait until every job put so far has run
    w.stop()                   finish the queued jobs, then end the thread

The thread outlives a job that raises (each job reports its own failure; this only logs).
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Callable

logger = logging.getLogger("tutti_hicache.linker")


class Worker:
    def __init__(self, name: str, run: Callable):
        self._queue: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._loop, args=(run,), daemon=True, name=name)
        self.thread.start()

    def put(self, job) -> None:
        self._queue.put(job)

    def drain(self) -> None:
        self._queue.join()

    def stop(self, timeout: float = 60) -> None:
        self._queue.put(None)
        self.thread.join(timeout=timeout)

    def _loop(self, run: Callable) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                run(job)
            except Exception:  # the worker outlives any one job (each job reports its own failure)
                logger.exception("tutti linker: worker job failed")
            finally:
                self._queue.task_done()
