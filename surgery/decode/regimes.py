"""Lengths at which a graph's position tables change (LongRoPE's switch), read from the graph.

The decoder continues the tables the graph computes from the input's length (RoPE's cos/sin, a
learned position row) by evaluating them at cache+new length and keeping the new rows
(surgery.decode.positions). That is exact only if the table at a longer length starts with the table
at a shorter one. LongRoPE breaks it: its factors are chosen by the sequence's length (short ones up
to original_max_position_embeddings, long ones past it, for every position), so cached keys rotated
with the short factors are wrong once the sequence crosses the switch; full recomputation rotates
them all with the long ones. transformers' Phi3 recomputes the cache once at that point.

Nothing here reads a rope type or a config key: the tables are evaluated at lengths on a doubling
grid up to the graph's limit, and every length where the table stops being a prefix of the next is
located by bisection. The Decoder recomputes the whole sequence when a call crosses a switch
(`Regimes.crosses`); with more switches than MAX_SWITCHES (tables that change at every length, as
dynamic NTK scaling would) it refuses lengths past the last one it would handle (`limit`)."""
from __future__ import annotations

from bisect import bisect_right

import torch
from torch.fx import Interpreter

from ..core.rewrite import ancestors
from ..core.run import placeholder_values
from ..errors import DecodeError, first_line
from .lengths import FIX_FULL

MAX_SWITCHES = 4     # recomputations a decode may need; more: refuse past the last
TABLE_TOLERANCE = 1e-5  # relative: the same positions give the same rows up to rounding


class TableRun(Interpreter):
    """The length-derived tables of a graph (the nodes `tables`) at any input length, running only
    what they are computed from."""

    def __init__(self, gm, tables: list, dims: list[int], device):
        super().__init__(gm)
        self.tables, self.dims, self.device = tables, dims, device
        needed = set(tables)
        for t in tables:
            needed |= ancestors(t)
        self.order = [n for n in gm.graph.nodes if n in needed]
        self.cache: dict[int, list] = {}

    def at(self, length: int) -> list:
        if length not in self.cache:
            ids = torch.zeros(1, length, dtype=torch.long, device=self.device)
            self.env, self.args_iter = {}, iter(placeholder_values(self.module, ids))
            try:
                with torch.no_grad():
                    for n in self.order:
                        self.env[n] = self.run_node(n)
            except Exception as exc:  # the graph cannot compute its positions at this length
                raise DecodeError(f"The graph's position tables cannot be evaluated at {length} tokens ({first_line(exc)}).", FIX_FULL) from exc
            self.cache[length] = [self.env[t] for t in self.tables]
            self.env = {}
        return self.cache[length]

    def prefix(self, short: int, long: int) -> bool:
        """The tables at `long` tokens begin with the tables at `short` tokens."""
        for a, b, dim in zip(self.at(short), self.at(long), self.dims):
            b = b.narrow(dim, 0, short)
            if a.shape != b.shape:
                return False
            a, b = a.float(), b.float()
            if a.numel() and (a - b).abs().max().item() > TABLE_TOLERANCE * max(1.0, b.abs().max().item()):
                return False
        return True


class Regimes:
    """The lengths where the position tables switch (sorted), and the longest length decoding
    handles exactly (None: any). A decode call from `offset` cached tokens to `offset + new` crosses
    a switch when the two lengths lie on different sides of one."""

    def __init__(self, switches: list[int] | None = None, limit: int | None = None):
        self.switches, self.limit = list(switches or []), limit

    def regime(self, length: int) -> int:
        return bisect_right(self.switches, length)

    def crosses(self, offset: int, new: int) -> bool:
        return offset > 0 and self.regime(offset) != self.regime(offset + new)

    def same(self, a: int, b: int) -> bool:
        return self.regime(a) == self.regime(b)

    def check(self, length: int) -> None:
        if self.limit is not None and length > self.limit:
            raise DecodeError(
                f"The graph's position tables change with the sequence length at more than {MAX_SWITCHES} lengths "
                f"(from {self.switches[0]} tokens on); decoding is exact only up to {self.limit} tokens, {length} were asked for.",
                FIX_FULL,
            )


def find_regimes(run: TableRun, max_length: int) -> Regimes:
    """Every switch up to max_length: a doubling grid of lengths, bisected where consecutive grid
    lengths disagree (one switch located at a time, from the shorter side)."""
    grid = sorted({min(2 ** i, max_length) for i in range(max_length.bit_length() + 1)})
    switches: list[int] = []
    for short, long in zip(grid, grid[1:]):
        while not run.prefix(short, long):
            low, high = short, long   # prefix(short, low) holds, prefix(short, high) does not
            while high - low > 1:
                mid = (low + high) // 2
                low, high = (mid, high) if run.prefix(short, mid) else (low, mid)
            switches.append(high)
            if len(switches) > MAX_SWITCHES:
                return Regimes(switches[:MAX_SWITCHES], limit=high - 1)
            short = high
    return Regimes(switches)


class History:
    """The tokens fed since the last reset, kept only for a graph whose positions switch: crossing
    a switch feeds them again."""

    def __init__(self, regimes: Regimes):
        self.keep = bool(regimes.switches)
        self.parts: list[torch.Tensor] = []

    def clear(self) -> None:
        self.parts = []

    def add(self, ids: torch.Tensor) -> None:
        if self.keep:
            self.parts.append(ids.clone())

    def joined(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.cat([*self.parts, ids], dim=1)
