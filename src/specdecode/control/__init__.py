"""Speculation control: how long to draft, from what this machine measured (see adaptive.py)."""

from .adaptive import AdaptiveK, DraftPlan, FixedK
from .batch import BatchPolicy
from .calibrate import calibrate
from .costs import ConfidenceCalibrator, CostModel, Ema, PassCostLine

__all__ = ["AdaptiveK", "BatchPolicy", "ConfidenceCalibrator", "CostModel", "DraftPlan", "Ema", "FixedK", "PassCostLine",
           "calibrate"]
