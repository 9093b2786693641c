"""The data feed of a run: (step, rows) for steps [start, stop) at the data offset the NaN guard keeps."""
from __future__ import annotations


class Feed:
    """(step, rows) for steps [start, stop) at the current data offset; a rollback restarts it."""

    def __init__(self, batches, start: int, stop: int, offset: int):
        self.batches, self.start, self.stop, self.offset, self._gen = batches, start, stop, offset, 0

    def restart(self, start: int, offset: int):
        self.start, self.offset, self._gen = start, offset, self._gen + 1

    def __iter__(self):
        while self.start < self.stop:
            gen = self._gen
            for item in self.batches.iterate(self.start, self.stop, offset=self.offset):
                yield item
                if gen != self._gen:
                    break
            else:
                return


def prefetched(train, start: int, stop: int, prefetch: int = 4, offset: int = 0):
    """(step, train(step + offset)) for steps [start, stop), produced ahead in one grain worker thread."""
    import grain
    ds = grain.MapDataset.range(start, stop).map(lambda s: (s, train(s + offset)))
    return iter(ds.to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=prefetch)))
