"""Drafters: one class per method behind the `Drafter` protocol."""

from .base import Draft, Drafter
from .combo import ComboDrafter
from .early_exit import SelfDrafter
from .model import ModelDrafter
from .ngram import NgramDrafter

__all__ = ["ComboDrafter", "Draft", "Drafter", "ModelDrafter", "NgramDrafter", "SelfDrafter"]
