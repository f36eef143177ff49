"""specdecode: speculative decoding for causal language models — the target's answers, fewer target passes."""

from .api import GenerateOutput, generate
from .drafters import ComboDrafter, Draft, Drafter, ModelDrafter, NgramDrafter, SelfDrafter, SuffixDrafter
from .engine import GenerationResult, SpeculativeEngine
from .models import BUILTINS, ModelError, load_model
from .pipeline import Completion, SpecDecoder
from .sampling import SamplingParams
from .stats import GenerationStats

__all__ = [
    "BUILTINS",
    "ComboDrafter",
    "SelfDrafter",
    "Completion",
    "Draft",
    "Drafter",
    "GenerateOutput",
    "GenerationResult",
    "GenerationStats",
    "ModelDrafter",
    "ModelError",
    "NgramDrafter",
    "SamplingParams",
    "SpecDecoder",
    "SpeculativeEngine",
    "SuffixDrafter",
    "generate",
    "load_model",
]
__version__ = "0.1.0"
