"""Deterministic samplers: seeded windows of seq_length + 1 tokens (WindowSampler), and Megatron's
BlendedDataset rule for a weighted blend (BlendedSampler over a Blend). Sample k is a pure function
of (seed, k), so a checkpoint keeps only the number of samples consumed."""
import math

import numpy

from ..autograd import InputError


class Blend:
    """One split of a --data-path blend: token arrays with weights (summing to 1) and names.
    Its length is all of their tokens, for the log; BlendedSampler draws from it."""

    def __init__(self, parts, weights, names):
        self.parts, self.weights, self.names = list(parts), list(weights), list(names)

    def __len__(self):
        return sum(len(p) for p in self.parts)

    def windows_of(self, seq_length):
        """The blend of the parts that hold a window of seq_length + 1 tokens, weights renormalised;
        None when no part does."""
        kept = [i for i, p in enumerate(self.parts) if len(p) > seq_length]
        if not kept:
            return None
        total = sum(self.weights[i] for i in kept)
        return Blend([self.parts[i] for i in kept], [self.weights[i] / total for i in kept],
                     [self.names[i] for i in kept])


def make_sampler(tokens, seq_length, seed):
    """A BlendedSampler for a Blend, else a WindowSampler."""
    if isinstance(tokens, Blend):
        return BlendedSampler(tokens, seq_length, seed)
    return WindowSampler(tokens, seq_length, seed)


class WindowSampler:
    """Training samples are the corpus cut into windows of seq_length + 1 tokens (neighbours
    share one token), visited in a fresh seeded permutation each epoch. Sample k of the run is a
    pure function of (seed, k), so the number of samples consumed is the whole sampler state
    that a checkpoint must keep, and any data-parallel rank can draw its own share. `stream`
    gives each dataset of a blend its own permutations."""

    def __init__(self, tokens, seq_length, seed, stream=None):
        self.num_windows = (len(tokens) - 1) // seq_length
        if self.num_windows < 1:
            raise InputError(f"the data has {len(tokens)} tokens, too few for --seq-length "
                             f"{seq_length}; use a shorter sequence or more data")
        self.tokens, self.seq_length, self.seed = tokens, seq_length, seed
        self._key = [seed] if stream is None else [seed, stream]
        self._epoch, self._order = None, None

    def _window(self, sample):
        epoch, position = divmod(sample, self.num_windows)
        if epoch != self._epoch:
            self._epoch = epoch
            self._order = numpy.random.default_rng(self._key + [epoch]).permutation(self.num_windows)
        return int(self._order[position])

    def row(self, sample):
        """Sample `sample`'s seq_length + 1 tokens."""
        start = self._window(sample) * self.seq_length
        return self.tokens[start:start + self.seq_length + 1]

    def batch(self, first_sample, count):
        """Samples first_sample .. first_sample + count - 1 as (inputs, targets), int64."""
        rows = numpy.empty((count, self.seq_length + 1), numpy.int64)
        for i in range(count):
            rows[i] = self.row(first_sample + i)
        return rows[:, :-1], rows[:, 1:]


class BlendedSampler:
    """Samples of a weighted blend, as Megatron's BlendedDataset: sample i goes to the dataset
    furthest below its share, argmax over d of weight[d] * (i + 1) - count[d] (the first on ties),
    and is that dataset's count[d]-th sample of its own WindowSampler. Both are pure functions of
    (seed, i), as WindowSampler's samples are; the assignment is computed once, in growing blocks."""

    def __init__(self, blend, seq_length, seed):
        self.parts = []
        for d, (tokens, name) in enumerate(zip(blend.parts, blend.names)):
            try:
                self.parts.append(WindowSampler(tokens, seq_length, seed, stream=d))
            except InputError as error:
                raise InputError(f"{name}: {error}") from None
        self.weights, self.names, self.seq_length = blend.weights, blend.names, seq_length
        self.tokens = blend.parts[0]          # what a prompt is taken from (Trainer.sample)
        self.datasets = numpy.empty(0, numpy.int64)       # sample i's dataset ...
        self.positions = numpy.empty(0, numpy.int64)      # ... and its sample number there
        self._counts = [0] * len(self.parts)

    def assign(self, end):
        """Make sure samples 0 .. end - 1 are assigned (doubling, so a run costs O(samples))."""
        done = len(self.datasets)
        if end <= done:
            return
        end = max(end, 2 * done, 1024)
        datasets, positions = [], []
        counts, weights = self._counts, list(enumerate(self.weights))
        for i in range(done, end):         # plain Python lists: 4x faster than max(key=) or NumPy here
            chosen, furthest = 0, -math.inf
            for d, weight in weights:
                if weight * (i + 1) - counts[d] > furthest:
                    chosen, furthest = d, weight * (i + 1) - counts[d]
            datasets.append(chosen)
            positions.append(counts[chosen])
            counts[chosen] += 1
        self.datasets = numpy.concatenate([self.datasets, numpy.array(datasets, numpy.int64)])
        self.positions = numpy.concatenate([self.positions, numpy.array(positions, numpy.int64)])

    def batch(self, first_sample, count):
        """Samples first_sample .. first_sample + count - 1 as (inputs, targets), int64."""
        self.assign(first_sample + count)
        rows = numpy.empty((count, self.seq_length + 1), numpy.int64)
        for i in range(count):
            k = first_sample + i
            rows[i] = self.parts[self.datasets[k]].row(int(self.positions[k]))
        return rows[:, :-1], rows[:, 1:]
