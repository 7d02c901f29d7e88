"""A state taken at any point of a run resumes into the batches the run went on to give: in an
epoch, right after its last batch (the loop stopped before the iterator said so), between
epochs and before the first, for every sampler that draws from a generator the state holds,
with or without persistent workers.

The cases the positions catch: a state taken after an epoch's last batch rolls over to the
next epoch, whose order the restored generator used to repeat (the saved epoch's, again); and
a loader whose epochs do not all start a new iterator (persistent workers) used to restore its
generator one base-seed draw early.
"""

from __future__ import annotations

import pytest
import torch
import torch.utils.data as tud

import gpufeed

pytestmark = pytest.mark.filterwarnings("ignore::gpufeed.random.RandomStateWarning")

N = 7
EPOCHS = 4


def _generator():
    return torch.Generator().manual_seed(3)


SAMPLERS = {
    "shuffle-generator": lambda: dict(shuffle=True, generator=_generator()),
    "random-sampler": lambda: dict(sampler=tud.RandomSampler(range(N), generator=_generator())),
    "subset": lambda: dict(sampler=tud.SubsetRandomSampler([0, 2, 3, 5, 6],
                                                           generator=_generator())),
    "weighted": lambda: dict(sampler=tud.WeightedRandomSampler(
        [1.0, 2, 3, 4, 5, 6, 7], N, generator=_generator())),
    "seed": lambda: dict(shuffle=True, seed=4),
    "sequential": lambda: {},
}
WORKERS = {
    "main": {},
    "threads": dict(num_workers=2, worker_type="thread"),
    "threads-persistent": dict(num_workers=2, worker_type="thread", persistent_workers=True),
    "processes-persistent": dict(num_workers=2, persistent_workers=True),
}


def _make(sampler, workers, batch_size):
    return gpufeed.DataLoader(list(range(N)), batch_size=batch_size, **SAMPLERS[sampler](),
                              **WORKERS[workers])


def _plain(batch):
    return batch.tolist() if isinstance(batch, torch.Tensor) else batch


# every sampler in the main process and thread workers; one process-worker case (the
# bookkeeping is the main process's whatever the workers)
CASES = [(s, w, b) for s in SAMPLERS for w in WORKERS for b in (3, None)
         if w != "processes-persistent" or (s, b) == ("random-sampler", 3)]


@pytest.mark.parametrize("sampler,workers,batch_size", CASES)
def test_a_state_from_any_point_resumes_into_the_rest_of_the_run(sampler, workers, batch_size):
    reference = _make(sampler, workers, batch_size)
    run = [[_plain(b) for b in reference] for _ in range(EPOCHS)]
    flat = [b for epoch in run for b in epoch]
    per_epoch = len(run[0])

    def resumed(state, taken):
        fresh = _make(sampler, workers, batch_size)
        fresh.load_state_dict(state)
        rest: list = []
        while len(rest) < len(flat) - taken:
            rest.extend(_plain(b) for b in fresh)
        return rest[: len(flat) - taken]

    # before the first epoch
    assert resumed(_make(sampler, workers, batch_size).state_dict(), 0) == flat
    # in epoch 1, after one batch
    loader = _make(sampler, workers, batch_size)
    list(loader)
    it = iter(loader)
    next(it)
    assert resumed(loader.state_dict(), per_epoch + 1) == flat[per_epoch + 1:]
    del it
    # right after epoch 1's last batch, the iterator not run out
    loader = _make(sampler, workers, batch_size)
    list(loader)
    it = iter(loader)
    for _ in range(per_epoch):
        next(it)
    assert resumed(loader.state_dict(), 2 * per_epoch) == flat[2 * per_epoch:]
    del it
    # between epochs 1 and 2 (the iterator ran out)
    loader = _make(sampler, workers, batch_size)
    list(loader)
    list(loader)
    assert resumed(loader.state_dict(), 2 * per_epoch) == flat[2 * per_epoch:]


def _distributed():
    return dict(sampler=tud.distributed.DistributedSampler(range(N + 1), num_replicas=2, rank=0,
                                                           seed=1))


SET_EPOCH = {  # loaders whose epoch the training loop sets, and how it sets it
    "distributed": (_distributed, lambda loader, e: loader.sampler.set_epoch(e)),
    "seed": (lambda: dict(shuffle=True, seed=4), lambda loader, e: loader.set_epoch(e)),
    "sequential": (dict, lambda loader, e: loader.set_epoch(e)),
}


@pytest.mark.parametrize("workers", ["main", "threads-persistent"])
@pytest.mark.parametrize("kind", SET_EPOCH)
def test_the_usual_resume_loop_that_sets_each_epoch_continues_the_run(kind, workers):
    """``for e in range(saved_epoch, E): set_epoch(e); for batch in loader`` after a state taken
    in an epoch or after its last batch (the iterator not yet run out): the saved epoch's rest
    (empty after its last batch), then the later epochs, neither repeated nor skipped."""
    options, set_epoch = SET_EPOCH[kind]

    def make():
        return gpufeed.DataLoader(list(range(N + 1)), batch_size=2, **options(),
                                  **WORKERS[workers])

    def epochs(loader, first, seen=()):
        out = list(seen)
        for e in range(first, EPOCHS):
            set_epoch(loader, e)
            out += [(e, _plain(b)) for b in loader]
        return out

    run = epochs(make(), 0)
    per_epoch = sum(1 for e, _ in run if e == 0)
    for taken in (1, per_epoch):  # in epoch 1, and after its last batch
        loader, seen = make(), []
        for e in range(2):
            set_epoch(loader, e)
            it = iter(loader)
            seen += [(e, _plain(next(it))) for _ in range(per_epoch if e == 0 else taken)]
        state = loader.state_dict()
        del it
        fresh = make()
        fresh.load_state_dict(state)
        assert epochs(fresh, 1, seen) == run, (kind, taken)


@pytest.mark.parametrize("workers", ["main", "threads-persistent"])
@pytest.mark.parametrize("kind", SET_EPOCH)
def test_a_state_taken_once_the_epoch_ran_out_belongs_to_the_next_epoch(kind, workers):
    """The documented rule (docs/guides/distributed.md) for a state taken after
    ``for batch in loader`` is over: restarting at the next epoch continues the run; setting the
    saved epoch again replays it whole."""
    options, set_epoch = SET_EPOCH[kind]

    def make():
        return gpufeed.DataLoader(list(range(N + 1)), batch_size=2, **options(),
                                  **WORKERS[workers])

    def epoch(loader, e):
        set_epoch(loader, e)
        return [_plain(b) for b in loader]

    reference = make()
    run = [epoch(reference, e) for e in range(3)]
    loader = make()
    for e in range(2):
        assert epoch(loader, e) == run[e]
    state = loader.state_dict()  # epoch 1's iterator has run out
    fresh = make()
    fresh.load_state_dict(state)
    assert epoch(fresh, 2) == run[2], kind
    again = make()
    again.load_state_dict(state)
    assert epoch(again, 1) == run[1], kind


@pytest.mark.parametrize("workers", ["main", "threads", "processes-persistent"])
def test_a_state_between_epochs_of_a_stock_shuffle_leaves_the_order_to_the_global_generator(
        workers):
    """``shuffle=True`` without ``seed=`` draws each epoch's seed from torch's global generator
    when the epoch starts, as torch does. A state taken before the first epoch or between two
    draws nothing (taking a checkpoint does not change the run that takes it), and the epoch
    after its load draws from the resumed run's global generator, as a new loader would
    (docs/guides/distributed.md, "Resume mid-epoch")."""
    def make():
        return gpufeed.DataLoader(list(range(N)), batch_size=3, shuffle=True,
                                  **WORKERS[workers])

    torch.manual_seed(5)
    plain = make()
    run = [[_plain(b) for b in plain] for _ in range(2)]
    after = torch.get_rng_state()
    torch.manual_seed(5)
    checkpointed = make()
    states, seen = [], []
    for _ in range(2):
        states.append(checkpointed.state_dict())
        seen.append([_plain(b) for b in checkpointed])
    assert seen == run and torch.equal(torch.get_rng_state(), after)
    for state in states:
        torch.manual_seed(7)
        first = [_plain(b) for b in make()]
        torch.manual_seed(7)
        fresh = make()
        fresh.load_state_dict(state)
        assert [_plain(b) for b in fresh] == first
