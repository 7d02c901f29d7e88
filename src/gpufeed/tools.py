"""The measuring tools behind ``gpufeed tune | profile | doctor`` and ``gpufeed.trace``, with
the reports they return."""

from ._tools.doctor import DoctorReport, Finding, diagnose
from ._tools.profiler import Profiler, ProfileReport, profile
from ._tools.trace import Trace, trace
from ._tools.tuner import Budget, Trial, TuneResult, tune

__all__ = [
    "Budget",
    "DoctorReport",
    "Finding",
    "ProfileReport",
    "Profiler",
    "Trace",
    "Trial",
    "TuneResult",
    "diagnose",
    "profile",
    "trace",
    "tune",
]
