"""Instrumentation of the layer-wise path: one observer, told at named points what a load and
the forward around it are doing. The counter, the loader and LayerwiseKV call it there and
nowhere else; none of them keeps instrumentation state of its own.

At a glance:
    Observer()                     the default: every hook does nothing (no clock read, no record,
                                   no thread, no file)
    timeline.Timeline(write, times)   one record per load, given to write(record); with times
                                   (windows.LayerTimes) the forwards' records too (timeline.py)
    timeline.Trace()               the benchmark's: the loads' records kept in .loads
    observer_for(cfg, times)       Timeline on tutti_timeline_file when it is set, else Observer()

Hook points ([scheduler] SGLang's scheduler thread, [loader] the loader's, [forward] the one
running the forward; `index` is the counter's batch index, `seq` its load number, which unlike
the index does not restart at reset):
    looked_up(begin_ns, end_ns)            [scheduler] a prefix lookup (LayerwiseKV.lookup)
    load_called()                          [scheduler] LayerwiseKV.load
    started(index, seq, layers)            [scheduler] a batch handed to the loader
    load_begun(index, host_pages, copied_pages)   [loader] the loader took the batch (of its pages,
                                           those from the DRAM tier and those copied in the pool)
    stream_opened(index)                   [loader] its pages planned, directories held for reads
    reads_final(index, pages, chunk_layers, done_ns)   [loader] every chunk's reads final
                                           (done_ns: when each became final, the read stream's
                                           CLOCK_MONOTONIC); before the last layer is handed over
    layer_handed(index, layer)             [loader] layer enqueued for the forward (its copy)
    failed(index, error)                   [loader] the load failed; every layer is released
    forward_begun(index, seq)              [forward] set_consumer; index None: no load (seq: the
                                           last load's)
    waiting(index, layer), waited(index, layer)   [forward] wait_until(layer) entered, returned
                                           (waiting only, with index None: a forward without
                                           a load, whose wait returns at once)
    finishing(index), finished(index, seq)   [scheduler] finish_layer_wise_loading entered, and
                                           returning (every layer landed)
    offloaded(begin_ns, pages)             [scheduler] an offload call that began at begin_ns
    reset(), close()                       the counter's reset; LayerwiseKV.close (first)

Thread-safety: hooks run on the threads named above and must never raise into them, nor block.
"""

from __future__ import annotations


class Observer:
    """Every hook point, doing nothing (see the module docstring)."""

    def looked_up(self, begin_ns: int, end_ns: int) -> None:
        pass

    def load_called(self) -> None:
        pass

    def started(self, index: int, seq: int, layers: int) -> None:
        pass

    def load_begun(self, index: int, host_pages: int = 0, copied_pages: int = 0) -> None:
        pass

    def stream_opened(self, index: int) -> None:
        pass

    def reads_final(self, index: int, pages: int, chunk_layers: list, done_ns) -> None:
        pass

    def layer_handed(self, index: int, layer: int) -> None:
        pass

    def failed(self, index: int, error: BaseException) -> None:
        pass

    def forward_begun(self, index, seq: int) -> None:
        pass

    def waiting(self, index, layer: int) -> None:
        pass

    def waited(self, index, layer: int) -> None:
        pass

    def finishing(self, index: int) -> None:
        pass

    def finished(self, index: int, seq: int) -> None:
        pass

    def offloaded(self, begin_ns: int, pages: int) -> None:
        pass

    def reset(self) -> None:
        pass

    def close(self) -> None:
        pass


def observer_for(cfg, times=None) -> Observer:
    """The observer the settings ask for: the timeline file (tutti_timeline_file, with the
    forwards' records where `times` learns them), else none."""
    if not cfg.timeline_file:
        return Observer()
    from .timeline import Timeline, TimelineFile
    return Timeline(TimelineFile(cfg.timeline_file).write, times)
