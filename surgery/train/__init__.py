"""Training a hybrid further against its teacher (distillation): config, run directory and resume,
stages, the trainer loop, losses."""
from .distill import DistillConfig, distill

__all__ = ["DistillConfig", "distill"]
