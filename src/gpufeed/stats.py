"""What ``loader.stats()`` returns: frozen dataclasses with documented fields."""

from ._base.stats import DeviceStats, LoaderStats, StageStats
from ._base.tuning import AutotuneStats, TuningDecision

__all__ = ["AutotuneStats", "DeviceStats", "LoaderStats", "StageStats", "TuningDecision"]
