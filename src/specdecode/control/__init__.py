"""Speculation control: how long to draft, from what this machine measured (see adaptive.py)."""

from .adaptive import AdaptiveK, DraftPlan
from .batch import BatchDecision, BatchPolicy
from .calibrate import calibrate
from .costs import ConfidenceCalibrator, CostModel, Ema, PassCostLine
from .measurements import Measurements
from .step import Controller, FixedK, RowPlan, StepOutcome, StepPlan

__all__ = ["AdaptiveK", "BatchDecision", "BatchPolicy", "ConfidenceCalibrator", "Controller", "CostModel", "DraftPlan", "Ema", "FixedK",
           "Measurements", "PassCostLine", "RowPlan", "StepOutcome", "StepPlan", "calibrate"]
