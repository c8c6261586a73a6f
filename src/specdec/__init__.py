"""specdec: lossless speculative decoding."""

from specdec.config import EngineConfig
from specdec.drafters import Draft, Drafter, make_drafter, register
from specdec.engine import Engine, GenerationResult
from specdec.errors import SpecdecError
from specdec.models import LoadedModel, load_model
from specdec.request import Request
from specdec.sampling import SamplingParams

__all__ = [
    "Draft",
    "Drafter",
    "Engine",
    "EngineConfig",
    "GenerationResult",
    "LoadedModel",
    "Request",
    "SamplingParams",
    "SpecdecError",
    "load_model",
    "make_drafter",
    "register",
]
__version__ = "0.1.0"
