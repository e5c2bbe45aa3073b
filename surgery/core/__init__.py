"""The captured graph and what runs it: model sources (load), torch.export (capture), the Graph
record, graph rewriting helpers, the pass protocol, and the one recording interpreter (run)."""
