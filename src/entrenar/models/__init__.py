"""Native models and their checkpoint formats."""

from entrenar.models.config import ModelConfig
from entrenar.models.transformer import Transformer

__all__ = ["ModelConfig", "Transformer"]
