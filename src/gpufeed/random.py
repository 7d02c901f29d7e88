"""Randomness that does not depend on the number or kind of workers.

A random transform that draws from these gets the same numbers for a sample whichever worker,
process or thread, runs it, and again after a resume: the generator is seeded by
(base seed, epoch, sample index).
"""

from ._order.sample_rng import RandomStateWarning, sample_generator, sample_random, sample_rng
from ._order.seeding import sample_seed

__all__ = [
    "RandomStateWarning",
    "sample_generator",
    "sample_random",
    "sample_rng",
    "sample_seed",
]
