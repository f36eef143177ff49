"""Drafters: one class per method behind the `Drafter` protocol."""

from .base import Draft, Drafter
from .combo import ComboDrafter
from .early_exit import SelfDrafter
from .model import ModelDrafter
from .ngram import NgramDrafter
from .suffix import SuffixDrafter, suffix_available

__all__ = ["ComboDrafter", "Draft", "Drafter", "ModelDrafter", "NgramDrafter", "SelfDrafter", "SuffixDrafter",
           "suffix_available"]
