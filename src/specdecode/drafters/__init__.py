"""Drafters: one class per method behind the `Drafter` protocol."""

from .base import Draft, Drafter
from .model import ModelDrafter
from .ngram import NgramDrafter

__all__ = ["Draft", "Drafter", "ModelDrafter", "NgramDrafter"]
