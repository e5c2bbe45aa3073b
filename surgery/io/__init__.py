"""Graphs to files and back: opening model sources, hybrid checkpoints and their recipes."""
from .checkpoint import load, save
from .open import capture, open_model

__all__ = ["capture", "load", "open_model", "save"]
