"""What one measures on a graph: perplexity, passkey retrieval, layer ablations, graph diffs."""
from .diff import diff
from .perplexity import perplexity

__all__ = ["diff", "perplexity"]
