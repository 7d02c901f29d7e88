"""Differential tests: gpufeed against the stock loader on random configurations (one seed,
one configuration: ``support/random_configs.py``), and a mid-run ``state_dict`` against the run
it was taken from. Each case compares everything a program sees: ``len()``, every batch with
its types, dtypes and containers, every error's type and first line (the loop goes on after an
error, as the stock loader allows), each epoch's end, and the state of torch's global generator
and the loader's afterwards.

Three bugs these found, each now with a test of its own: an unbatched loader whose sampler's
closing draw came early (``test_loader.py``), a resume after an epoch's last batch that
repeated the epoch's order (``order/test_resume_positions.py``), and a device stage that ended
the epoch at a worker's error (``host/test_worker_errors.py``).
"""

from __future__ import annotations

import gc

import pytest
import torch.utils.data as tud

import gpufeed
from support.random_configs import config, outcome, resume_matches

SEEDS = range(28)
RESUME_SEEDS = range(100, 120)


@pytest.mark.parametrize("seed", SEEDS)
def test_random_configuration_matches_stock(seed, monkeypatch):
    conf = config(seed)
    # the stock iterator's shutdown waits this long for a worker that does not exit (5 s by
    # default; seed 24's persistent worker) before it terminates it: nothing the outcome holds
    monkeypatch.setattr(tud._utils, "MP_STATUS_CHECK_INTERVAL", 0.2)
    expected = outcome(tud.DataLoader, conf)
    gc.collect()  # the stock iterator of an error (kept by its traceback) goes now
    got = outcome(gpufeed.DataLoader, conf, **conf["gpufeed"])
    gc.collect()
    assert got == expected, conf["label"]


@pytest.mark.filterwarnings("ignore::gpufeed.random.RandomStateWarning")
@pytest.mark.parametrize("seed", RESUME_SEEDS)
def test_random_configuration_resumes_into_the_rest_of_its_run(seed):
    conf = config(seed, resumable=True)
    ok, where = resume_matches(conf, cut_seed=seed)
    assert ok, f"{conf['label']}: {where}"
