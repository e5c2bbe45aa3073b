"""Graphs to files and back: opening model sources, hybrid checkpoints and their recipes, and exports
that leave the toolkit (a transformers directory)."""
from .checkpoint import load, save
from .export import export
from .open import capture, open_model

__all__ = ["capture", "export", "load", "open_model", "save"]
