"""specdec: lossless speculative decoding."""

from .drafters import Draft, Drafter, make_drafter, register
from .engine import Engine, GenerationResult
from .errors import SpecdecError
from .models import LoadedModel, load_model
from .sampling import SamplingParams

__all__ = [
    "Draft",
    "Drafter",
    "Engine",
    "GenerationResult",
    "LoadedModel",
    "SamplingParams",
    "SpecdecError",
    "load_model",
    "make_drafter",
    "register",
]
__version__ = "0.1.0"
