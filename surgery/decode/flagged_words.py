"""Values handed between the programs of one launch as flagged words: a reader waits for the words it
reads, not for a grid barrier.

The one-launch GDN layer (surgery.decode.gdn_block) hands each phase's output to the next through
memory, and a grid barrier between them costs an arrival (a release, then an atomic's round trip),
the polls until the last program arrives, and only then the read of the data (four barriers alone:
4.3-4.6 us a launch on the H200, bench/RESULTS.md, thirty-third session). Here every value travels in
one 64-bit word whose high half is the launch's number and whose low half the value's float32 bits
(already rounded to the model's dtype, as the composed kernels round it): one aligned 8-byte store,
which the GPU makes visible whole, says both what the value is and that it is there. A reader loads
its words until every one carries its launch's number (the idea of NCCL's LL protocol), so the read
that finds them ready is the read of the data (and where Triton holds a word in several threads, each
copy is checked again after the test: `_again`). A launch's number comes from a counter that only
grows (the arrivals of all launches before it, as gdn_block's grid_wait counts): words that earlier
launches left are never taken for this one's, and nothing is reset.

The buffer is the block's own (`new_exchange`: zeros, so no word carries a launch's number before
that launch writes it) and each word is written once a launch; launches on one buffer run one after
another, never overlapping."""
from __future__ import annotations

import torch

try:  # Triton is a CUDA-side extra: CPU installs do not have it
    import triton
    import triton.language as tl
except Exception:  # a broken install raises more than ImportError
    triton = None

HEADER_WORDS = 8     # word 0: the launch counter; the regions start past the header
MAX_POLLS = 1 << 22  # reads of a word set before a program gives up (a non-resident grid): flags an error


def new_exchange(words: int, device) -> torch.Tensor:
    """A block's exchange buffer: the header and `words` flagged words, int64 zeros."""
    return torch.zeros(HEADER_WORDS + words, dtype=torch.int64, device=device)


if triton is not None:
    POLL_LIMIT = tl.constexpr(MAX_POLLS)
    THREADS_MAX = tl.constexpr(1024)

    @triton.jit
    def launch_number(ex, nprog, first: tl.constexpr):
        """This launch's number (1, 2, ...): where `first`, every program arrives at the counter and
        reads its number from its own arrival; a later launch of the same step (a phase launched on
        its own) reads the count its first launch left."""
        if first:
            old = tl.atomic_add(ex, 1, sem="relaxed")
            return old // nprog + 1
        return tl.load(ex, volatile=True) // nprog

    @triton.jit
    def flag_store(ex, index, value, mask, number):
        """Words index (masked) = (number, value's float32 bits); `value` already rounded to the model's dtype."""
        bits = value.to(tl.float32).to(tl.uint32, bitcast=True).to(tl.int64)
        tl.store(ex + index, (number.to(tl.int64) << 32) | bits, mask=mask)

    @triton.jit
    def _ready(words, mask, number):
        """1 where every masked word carries `number`, else 0 (a scalar)."""
        return tl.min(((words >> 32) == number) | (mask == 0), 0).to(tl.int32)

    @triton.jit
    def _everywhere(ready):
        """1 only where every thread's `ready` is 1. A test over a tensor that fits in one warp is reduced
        within each warp, from that warp's own copy, so warps can disagree; a poll loop whose threads leave
        it at different rounds would then meet the other tests' barriers out of step. Each thread's own
        value goes into a tensor that holds one element per thread or more (THREADS_MAX covers 32 warps),
        whose reduction crosses warps."""
        return tl.min(tl.full([THREADS_MAX], 1, tl.int32) * ready, 0)

    @triton.jit
    def _value(words, mask):
        return tl.where(mask, words.to(tl.uint32).to(tl.float32, bitcast=True), 0.0)

    @triton.jit
    def _piece_words(ex, r, k0, P: tl.constexpr, K: tl.constexpr):
        """The addresses of a row's piece [k0, k0 + P) and which lie inside the row."""
        c = k0 + tl.arange(0, P)
        return ex + r * K + c, c < K

    @triton.jit
    def _piece(ex, r, k0, P: tl.constexpr, K: tl.constexpr):
        address, mask = _piece_words(ex, r, k0, P, K)
        return tl.load(address, mask=mask, other=0, volatile=True), mask

    @triton.jit
    def _again(address, words, mask, number):
        """`words` once more where this thread's copy does not carry `number`. Triton holds a small tensor in
        several threads at once (replicas), each loading it itself, and the ready test reduces over one
        replica: another may still hold words it read before they arrived (seen on an H100: whole rows of
        the step before, or of the zeros a fresh buffer starts with). The test's reduction meets at a
        barrier after a thread found every word there, so this read, issued after it, finds them too; a
        thread whose copy is current issues nothing."""
        return tl.load(address, mask=mask & ((words >> 32) != number), other=words, volatile=True)

    @triton.jit
    def _piece_again(ex, r, k0, words, number, P: tl.constexpr, K: tl.constexpr):
        address, mask = _piece_words(ex, r, k0, P, K)
        return _value(_again(address, words, mask, number), mask)

    @triton.jit
    def _row_words3(ex, r, number, K: tl.constexpr, P0: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr):
        """One read of a row's pieces (every load issued at once) and whether all carry `number`."""
        w0, m0 = _piece(ex, r, 0, P0, K)
        w1, m1 = w0, m0
        w2, m2 = w0, m0
        if P1 > 0:
            w1, m1 = _piece(ex, r, P0, P1, K)
        if P2 > 0:
            w2, m2 = _piece(ex, r, P0 + P1, P2, K)
        return w0, m0, w1, m1, w2, m2, _everywhere(_ready(w0, m0, number) & _ready(w1, m1, number)
                                                   & _ready(w2, m2, number))

    @triton.jit
    def flagged_row3(ex, r, number, error, K: tl.constexpr, P0: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr):
        """Row r of a [rows, K] region in up to three pieces along K (as gdn_block's _row3), float32, zeros
        outside: read again until all carry `number` (error set past MAX_POLLS)."""
        w0, m0, w1, m1, w2, m2, ready = _row_words3(ex, r, number, K, P0, P1, P2)
        polls = 0
        while (ready == 0) & (polls < POLL_LIMIT):
            w0, m0, w1, m1, w2, m2, ready = _row_words3(ex, r, number, K, P0, P1, P2)
            polls += 1
        if ready == 0:
            tl.atomic_xchg(error, 1)
        x0 = _piece_again(ex, r, 0, w0, number, P0, K)
        x1 = x0
        x2 = x0
        if P1 > 0:
            x1 = _piece_again(ex, r, P0, w1, number, P1, K)
        if P2 > 0:
            x2 = _piece_again(ex, r, P0 + P1, w2, number, P2, K)
        return x0, x1, x2

    @triton.jit
    def _head_addresses(row, h, Q: tl.constexpr, K_: tl.constexpr, V: tl.constexpr, A: tl.constexpr,
                        B: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BD: tl.constexpr):
        """Where a head's q, k, v and gate words [BD] and its (a, b) pair [2] lie in a projection row."""
        d = tl.arange(0, BD)
        two = tl.arange(0, 2)
        return (row + Q + h * D + d, row + K_ + h * D + d, row + V + h * D + d, row + G + h * D + d,
                row + tl.where(two == 0, A + h, B + h))

    @triton.jit
    def _head_words(row, h, number, Q: tl.constexpr, K_: tl.constexpr, V: tl.constexpr, A: tl.constexpr,
                    B: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BD: tl.constexpr):
        """One read of a head's q, k, v, gate words and its (a, b) pair (every load issued at once), and whether
        all carry `number`."""
        inside = tl.arange(0, BD) < D
        two = tl.arange(0, 2)
        pq, pk, pv, pg, ps = _head_addresses(row, h, Q, K_, V, A, B, G, D, BD)
        wq = tl.load(pq, mask=inside, other=0, volatile=True)
        wk = tl.load(pk, mask=inside, other=0, volatile=True)
        wv = tl.load(pv, mask=inside, other=0, volatile=True)
        wg = tl.load(pg, mask=inside, other=0, volatile=True)
        ws = tl.load(ps, volatile=True)
        ready = _ready(wq, inside, number) & _ready(wk, inside, number) & _ready(wv, inside, number) \
            & _ready(wg, inside, number) & _ready(ws, two >= 0, number)
        return wq, wk, wv, wg, ws, _everywhere(ready)

    @triton.jit
    def flagged_head(ex, r, h, number, error, N: tl.constexpr, Q: tl.constexpr, K_: tl.constexpr, V: tl.constexpr,
                     A: tl.constexpr, B: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BD: tl.constexpr):
        """A head's token-step inputs from row r of a [rows, N] projection region: q, k, v, gate [BD] (zeros past
        D) and the scalars a, b, float32, read again until all carry `number`."""
        row = ex + r * N
        wq, wk, wv, wg, ws, ready = _head_words(row, h, number, Q, K_, V, A, B, G, D, BD)
        polls = 0
        while (ready == 0) & (polls < POLL_LIMIT):
            wq, wk, wv, wg, ws, ready = _head_words(row, h, number, Q, K_, V, A, B, G, D, BD)
            polls += 1
        if ready == 0:
            tl.atomic_xchg(error, 1)
        inside = tl.arange(0, BD) < D
        two = tl.arange(0, 2)
        pq, pk, pv, pg, ps = _head_addresses(row, h, Q, K_, V, A, B, G, D, BD)
        wq = _again(pq, wq, inside, number)
        wk = _again(pk, wk, inside, number)
        wv = _again(pv, wv, inside, number)
        wg = _again(pg, wg, inside, number)
        scalars = _value(_again(ps, ws, two >= 0, number), two >= 0)
        return (_value(wq, inside), _value(wk, inside), _value(wv, inside), _value(wg, inside),
                tl.sum(tl.where(two == 0, scalars, 0.0), 0), tl.sum(tl.where(two == 1, scalars, 0.0), 0))
