"""The run's random streams, each derived from (seed, process rank, purpose) by numpy's `SeedSequence`.

Adding small integers to the seed (`seed + rank`, `seed + k`) makes runs share streams: rank 1 of seed 0 drew
exactly what rank 0 of seed 1 drew, so runs with seeds 0, 1, 2 on several GPUs were correlated. A SeedSequence of
the tuple gives every (seed, rank, purpose) a stream of its own. Runs from before this scheme draw other samples.
"""

from __future__ import annotations

import numpy as np

# Each purpose's fixed number in the entropy tuple: never renumber one (a run's draws would change).
PURPOSES = {"generation": 1, "sub_sampling": 2, "extra_tasks": 3, "training_requests": 4}


def seed_sequence(seed: int, purpose: str, rank: int = 0, *more: int) -> np.random.SeedSequence:
    """The SeedSequence of (seed, rank, purpose, *more); a negative seed is taken modulo 2**64."""
    return np.random.SeedSequence((seed % 2**64, rank, PURPOSES[purpose], *more))


def stream(seed: int, purpose: str, rank: int = 0) -> np.random.Generator:
    """A numpy generator on the stream of (seed, rank, purpose)."""
    return np.random.default_rng(seed_sequence(seed, purpose, rank))


def integer_seed(seed: int, purpose: str, rank: int = 0, *more: int) -> int:
    """A seed for the libraries that take one integer (torch, Python's and numpy's global generators): 32 bits of
    the stream's state, as many as numpy's global generator takes."""
    return int(seed_sequence(seed, purpose, rank, *more).generate_state(1)[0])


def seed_process(seed: int, rank: int) -> np.random.Generator:
    """Seed this process's global generators (Python's, numpy's, torch's: what generation samples from) on its
    generation stream, replacing the `seed + rank` TRL's GRPOTrainer set, and return its sub-sampling stream."""
    from accelerate.utils import set_seed

    set_seed(integer_seed(seed, "generation", rank))
    return stream(seed, "sub_sampling", rank)
