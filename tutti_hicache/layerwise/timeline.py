"""`tutti_timeline_file`: one JSON line per layer-wise load, for tracing where a restore's time goes.

At a glance:
    tl = TimelineFile(path_template)    "{pid}" in the template is replaced by the process id
    tl.write(record)                    appends json.dumps(record) + newline; never raises (tracing
                                        must not break loads): the first failure is logged once
    now_ns()                            CLOCK_MONOTONIC nanoseconds, the read stream's clock

A record (layerwise/counter.py builds it; the loader adds its part) holds, all in now_ns():
    index, start_ns                 the batch handed to the loader (LayerwiseKV.start)
    seq                             the load's number since the counter was made (the index
                                    restarts at every reset); a forward's record says it as
                                    forward_of
    complete_ns[layer]              the layer handed to the forward (its copy enqueued)
    wait_ns[layer] = [in, out]      the forward's wait_until(layer): entry and return (0, 0: never)
    finish_ns = [in, out]           finish_layer_wise_loading
    pages, chunk_layers, chunk_done_ns, loader_end_ns   from the loader: the pages loaded, each
                                    staging chunk's layer and the time its reads became final,
                                    the loader's end; error on failure
    lookup_ns = [in, out], load_ns  the linker's last lookup before the start (0, 0: none)
                                    and its first load call (0: none)
    begin_ns, opened_ns             the loader thread took the batch; its read stream was open
                                    (pages planned, directories held for reads)
tutti_hicache/benchmarks/timeline.py summarizes a file.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time

from ..statsfile import warn_once

logger = logging.getLogger("tutti_hicache.timeline")


def now_ns() -> int:
    return time.monotonic_ns()  # CLOCK_MONOTONIC on Linux, as the read stream's done_ns


class TimelineFile:
    def __init__(self, template: str):
        self.path = template.replace("{pid}", str(os.getpid())) if template else ""
        self._failed = False
        self._lock = threading.Lock()

    def write(self, record: dict) -> bool:
        if not self.path:
            return False
        try:
            line = json.dumps(record) + "\n"
            with self._lock, open(self.path, "a") as f:
                f.write(line)
            return True
        except (OSError, TypeError, ValueError) as e:
            self._failed = warn_once(self._failed, logger, "tutti_timeline_file", self.path, e)
            return False
