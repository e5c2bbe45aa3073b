"""How the one-launch GDN layer's work is laid out over its programs (surgery.decode.gdn_block runs it): the
shape it is specialised on, each matmul phase's output tiles, a reduction's power-of-two pieces, how many programs
a launch takes, and which program takes which tile. Plain arithmetic on the layer's widths, so it is checked
without Triton or a GPU.

Tiles are dealt so that a phase's programs were idle in the phase before: the token step's (row, head) items run
on programs 0, 1, ...; the input projection, o_proj and down start past them and gate/up past o_proj, so each
fetches its weights while the phase before runs (on an H100, flagged words: 14.3 us a layer in L2 against 15.7,
15.6 against 18.0 from HBM; bench/RESULTS.md, fifty-fifth session)."""
from __future__ import annotations

from dataclasses import dataclass

MAX_TILE = 64        # output columns of one program's tile
MIN_PIECE = 16       # the narrowest piece of a reduction
MAX_TILE_ELEMENTS = 32768  # weight elements one program holds for a phase (64 KB of bf16: 64 registers a thread)


@dataclass(frozen=True)
class BlockShape:
    """What the kernel is specialised on: widths, the projection's column offsets, heads."""

    hidden: int
    proj: int             # columns of the fused input projection (its aligned rows included)
    offsets: tuple        # q, k, v, a (decay input, one per head), b, g column offsets into proj
    heads: int
    head_dim: int
    inter: int            # the MLP's intermediate width
    gate_first: bool      # SiLU applies to the first half of gate/up's output
    v_silu: bool


def pieces(width: int) -> tuple[int, int, int]:
    """A reduction of `width` as up to three power-of-two pieces (0: none), the last one padded: 576 ->
    (512, 64, 0), 1,536 -> (1024, 512, 0); Triton's blocks are powers of two, and one padded block
    would spend registers on up to twice the width."""
    out, left = [], width
    while left >= MIN_PIECE and len(out) < 2:
        out.append(1 << (left.bit_length() - 1))
        left -= out[-1]
    if left > 0:
        out.append(max(MIN_PIECE, 1 << (left - 1).bit_length()))
    return tuple(out + [0] * (3 - len(out)))


def tile_width(columns: int, limit: int) -> int | None:
    """Output columns per tile: the fewest (16 up) that give at most `limit` tiles, or None past MAX_TILE."""
    width = 16
    while -(-columns // width) > limit:
        width *= 2
        if width > MAX_TILE:
            return None
    return width


def block_tiles(shape: BlockShape, limit: int) -> dict | None:
    """Each matmul phase's (columns, tile width), every phase within `limit` tiles and each tile within
    MAX_TILE_ELEMENTS of weights; None where a layer is too wide for that."""
    inner = shape.heads * shape.head_dim
    phases = dict(IN=(shape.proj, shape.hidden, 1), O=(shape.hidden, inner, 1), GU=(shape.inter, shape.hidden, 2),
                  D=(shape.hidden, shape.inter, 1))
    tiles = {}
    for key, (n, k, count) in phases.items():
        bn = tile_width(n, limit)
        if bn is None or bn * sum(pieces(k)) * count > MAX_TILE_ELEMENTS:
            return None
        tiles[key] = (n, bn)
    return tiles


def block_programs(shape: BlockShape, limit: int, rows: int) -> int:
    """Programs of a launch (block_tiles(shape, limit) must not be None): one per tile of the widest phase, and
    more up to `limit` where the token step's items, o_proj's tiles and gate/up's can then each have programs of
    their own (shape_constants' offsets)."""
    count = {key: -(-n // bn) for key, (n, bn) in block_tiles(shape, limit).items()}
    return max(max(count.values()), min(limit, rows * shape.heads + count["O"] + count["GU"]))


def shape_constants(shape: BlockShape, rows: int, limit: int) -> dict:
    """The kernel's constants that follow from the layer's shape, the rows and the program limit (the launcher adds
    which weights and biases there are): widths, offsets, tiles, reduction pieces and programs."""
    q, k, v, a, b, g = shape.offsets
    programs = block_programs(shape, limit, rows)
    widths = dict(H=shape.hidden, I=shape.heads * shape.head_dim, X=shape.inter)
    tiles = block_tiles(shape, limit)
    # the token step's (row, head) items run on programs 0, 1, ...; the input projection, o_proj and down start past
    # them (OFF_PAST), gate/up past o_proj (OFF_GU; down's programs, idle in gate/up, fetch its weights while it runs)
    items = rows * shape.heads
    after_o = items + -(-tiles["O"][0] // tiles["O"][1])
    return dict(HID=shape.hidden, N_IN=shape.proj, Q=q, K_=k, V=v, A=a, B=b, G=g, H=shape.heads, D=shape.head_dim,
                BD=1 << (shape.head_dim - 1).bit_length(), V_SILU=shape.v_silu, INTER=shape.inter,
                GATE_FIRST=shape.gate_first, **{f"BN_{key}": bn for key, (_, bn) in tiles.items()},
                **{f"{key}P{i}": p for key, width in widths.items() for i, p in enumerate(pieces(width))},
                ROWS=rows, nprog=programs, IT_TS=-(-items // programs),
                OFF_PAST=items % programs, OFF_GU=after_o % programs)


def exchange_words(shape: BlockShape, rows: int) -> int:
    """Flagged words the phases hand over (proj, core, y, m) for `rows` rows: new_exchange's size."""
    return rows * (shape.proj + shape.heads * shape.head_dim + shape.hidden + shape.inter)
