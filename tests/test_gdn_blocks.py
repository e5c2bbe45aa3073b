"""A static decode step's GDN decoder layers as one call each (surgery.decode.gdn_blocks) and the kernel
behind it (surgery.decode.gdn_block): the rewrite against full recomputation on tiny architectures, what
it leaves alone, the setting, the kernel's phases under Triton's CPU interpreter against the composed
kernels, and on CUDA the one-launch kernel (its programs meeting between phases) against them."""

import importlib.util
import operator
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from test_generate import full_greedy, hybrid, incremental_greedy

import surgery.decode.runtime
from surgery.decode import Decoder
from surgery.decode.flagged_words import HEADER_WORDS
from surgery.decode.gdn_block import gdn_block_torch
from surgery.decode.gdn_blocks import GDNBlock, block_programs, match_block
from surgery.decode.gdn_state import GDNState
from tcal.gdn import GatedDeltaNet, GDNCache, fused_weight

HAS_TRITON = importlib.util.find_spec("triton") is not None


def blocks(decoder) -> list:
    return [m for m in decoder.step_gm.modules() if isinstance(m, GDNBlock)]


def prompt(graph, seed=3) -> list:
    return torch.randint(3, graph.config.vocab_size, (6,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_each_gdn_layer_becomes_one_block_and_decodes_as_full_recomputation(arch):
    from conftest import get_tiny

    graph = hybrid(get_tiny(arch).graph.branch())
    decoder = Decoder(graph, step_mode="static")
    assert len(blocks(decoder)) == graph.layer_kinds.count("gdn") > 0
    tokens, logits = incremental_greedy(decoder, prompt(graph), 5)
    want_tokens, want_logits = full_greedy(graph, prompt(graph), 5)
    assert tokens == want_tokens
    torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-4)


def test_a_layer_of_another_form_keeps_its_kernels():
    """GPT-2's LayerNorm and GELU MLP are not the pattern: no block, decoding unchanged."""
    from conftest import get_tiny

    graph = hybrid(get_tiny("gpt2").graph.branch())
    decoder = Decoder(graph, step_mode="static")
    assert not blocks(decoder)
    assert incremental_greedy(decoder, prompt(graph), 4)[0] == full_greedy(graph, prompt(graph), 4)[0]


def test_a_region_read_elsewhere_is_not_fused(monkeypatch):
    """An intermediate with a reader outside the region (here the GDN output) keeps the layer's kernels."""
    from conftest import get_tiny

    monkeypatch.setattr(surgery.decode.runtime, "fuse_gdn_blocks", lambda gm: 0)
    monkeypatch.setattr(surgery.decode.runtime, "fuse_row_linears", lambda gm, in_place=False: (gm, 0))  # keep aten.linear
    graph = hybrid(get_tiny("llama").graph.branch())
    gm = Decoder(graph, step_mode="static").step_gm
    calls = [n for n in gm.graph.nodes if n.op == "call_module" and isinstance(gm.get_submodule(n.target), GDNState)]
    assert calls and all(match_block(gm, n) is not None for n in calls)
    with gm.graph.inserting_after(calls[0]):
        gm.graph.call_function(operator.neg, (calls[0],))
    assert match_block(gm, calls[0]) is None


def test_the_setting_is_checked(monkeypatch):
    monkeypatch.setenv("SURGERY_GDN_BLOCKS", "off")
    assert block_programs(torch.device("cpu")) is None
    monkeypatch.setenv("SURGERY_GDN_BLOCKS", "some")
    with pytest.raises(ValueError, match="SURGERY_GDN_BLOCKS=.some.*or a number"):
        block_programs(torch.device("cpu"))


class TokenStep(torch.nn.Module):
    """GDNState's call in a static step: the layer's token step on an in-place cache."""

    def __init__(self, layer, state, projection):
        super().__init__()
        self.layer, self.state, self.projection = layer, state, projection

    def forward(self, n):
        cache = GDNCache(in_place=True)
        cache.recurrent = self.state
        return self.layer(n, cache=cache, projection=self.projection)


def block_inputs(dtype, rows, bias, hidden=40, heads=3, dim=24, inter=56, seed=0, device="cpu"):
    """A GDN layer with every parameter away from its init, and the block's other inputs."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    layer = GatedDeltaNet(hidden, heads, dim, q_bias=bias, o_bias=bias, v_activation="silu").to(dtype).eval()
    with torch.no_grad():
        layer.A_log.uniform_(-2, 1)
        layer.dt_bias.normal_()
        layer.o_norm.weight.uniform_(0.5, 1.5)
    layer.to(device)
    w_in, b_in = fused_weight(layer, [layer.get_submodule(n) for n in layer.INPUT_PROJECTIONS])

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)

    a, b = r(rows, 1, hidden), r(rows, 1, hidden)
    w0, w1 = ((torch.rand(hidden, generator=g) + 0.5).to(dtype).to(device) for _ in range(2))
    w_gu, w_d = r(2 * inter, hidden, scale=0.2), r(hidden, inter, scale=0.2)
    b_gu, b_d = (r(2 * inter, scale=0.1), r(hidden, scale=0.1)) if bias else (None, None)
    state = (torch.randn(rows, heads, dim, dim, generator=g) * 0.3).to(device)
    return layer, (w_in, b_in), a, b, w0, w1, w_gu, b_gu, w_d, b_d, state


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (a CUDA-side extra)")
def test_kernel_phases_match_the_composed_kernels_in_the_interpreter():
    """Each phase as its own launch under Triton's CPU interpreter (which runs programs one after another,
    so they cannot meet): float32 and float16 (the interpreter's bf16 matmul is wrong), 1, 3 and 16 rows,
    with and without biases, SiLU on either half of gate/up, the state written in place; the phases handing
    their outputs over as flagged words too, two launches on one exchange buffer (the second must not take
    the first's words)."""
    script = textwrap.dedent("""
        import torch
        from surgery.decode.flagged_words import new_exchange
        from surgery.decode.block_layout import exchange_words
        from surgery.decode.gdn_block import gdn_block_torch, gdn_block_triton
        from surgery.decode.gdn_blocks import block_shape
        import tests.test_gdn_blocks as t
        for dtype, tol in ((torch.float32, 1e-4), (torch.float16, 1e-2)):
            for rows, bias, gate_first, flagged in ((1, False, True, False), (3, True, False, False),
                                                    (16, True, True, False), (3, True, True, True)):
                layer, proj, a, b, w0, w1, w_gu, b_gu, w_d, b_d, state = t.block_inputs(dtype, rows, bias, seed=rows)
                mine = state.clone()
                shape = block_shape(layer, proj[0].shape[0], 56, gate_first)
                exchange = new_exchange(exchange_words(shape, rows), "cpu") if flagged else None
                for step in range(2 if flagged else 1):
                    with torch.no_grad():
                        want = gdn_block_torch(a, b, w0, 1e-6, t.TokenStep(layer, state, proj), w1, 1e-5, w_gu, b_gu,
                                               w_d, b_d, 56, gate_first)
                        got = gdn_block_triton(a, b, w0, 1e-6, layer, mine, *proj, w1, 1e-5, w_gu, b_gu, w_d, b_d, shape,
                                               torch.zeros(8, dtype=torch.int32), 16, phased=True, exchange=exchange)
                    for x, y in zip(got, want):
                        torch.testing.assert_close(x.float(), y.float(), rtol=tol, atol=tol)
                    torch.testing.assert_close(mine, state, rtol=tol, atol=tol)
                    a, b = got  # the next launch's inputs differ, so a word the first left would show
        print("ok")
    """)
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.pathsep.join([os.path.dirname(here), here, os.environ.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", script], env=dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]


@pytest.mark.parametrize("rows,limit", [(1, 132), (1, 96), (16, 132)])
def test_each_phase_takes_programs_idle_in_the_phase_before(rows, limit):
    """Every tile of every matmul phase has one program; at one row on 132 SMs (SmolLM2's widths on an H100 or H200)
    the input projection and o_proj leave the token step's programs free, gate/up starts past o_proj's and down is
    not on gate/up's, so a phase's programs hold their weights when its inputs arrive (with fewer programs the phases
    share, each tile still once)."""
    from surgery.decode.block_layout import shape_constants
    from surgery.decode.gdn_blocks import block_shape

    layer, proj = block_inputs(torch.bfloat16, rows, False, hidden=576, heads=9, dim=64, inter=1536)[:2]
    c = shape_constants(block_shape(layer, proj[0].shape[0], 1536, True), rows, limit)
    n = c["nprog"]

    def programs(key, columns, offset):
        owners = [(t + offset) % n for t in range(-(-columns // c[f"BN_{key}"]))]
        assert len(set(owners)) == len(owners) and max(owners) < n
        return set(owners)

    tiles = dict(IN=programs("IN", c["N_IN"], c["OFF_PAST"]), O=programs("O", c["HID"], c["OFF_PAST"]),
                 GU=programs("GU", c["INTER"], c["OFF_GU"]), D=programs("D", c["HID"], c["OFF_PAST"]))
    token = {item % n for item in range(rows * c["H"])}
    if (rows, limit) == (1, 132):
        assert n == 132 and not (tiles["IN"] | tiles["O"]) & token and not tiles["GU"] & tiles["O"]
        assert not tiles["D"] & tiles["GU"]


def assert_near(got, want, state, want_state):
    """bf16 outputs of sums over 576-1,536 terms: the kernel and cuBLAS add in different orders, so they
    differ by about one bf16 step at each output's own scale (|d| reaches ~600 here: a step of 4), and
    a race or a wrong phase would be off by far more."""
    for x, y in zip(got, want):
        torch.testing.assert_close(x.float(), y.float(), rtol=0, atol=2**-7 * y.float().abs().max().item())
    torch.testing.assert_close(state, want_state, rtol=1e-3, atol=2e-3)


def cuda_block(rows: int, flagged: bool):
    """block_inputs at SmolLM2's widths in bf16 on CUDA, then the kernel's shape, counters, exchange buffer (where
    `flagged`) and program limit (the SM count)."""
    from surgery.decode.flagged_words import new_exchange
    from surgery.decode.block_layout import exchange_words
    from surgery.decode.gdn_block import new_sync
    from surgery.decode.gdn_blocks import block_shape

    inputs = block_inputs(torch.bfloat16, rows, False, hidden=576, heads=9, dim=64, inter=1536, device="cuda")
    shape = block_shape(inputs[0], inputs[1][0].shape[0], 1536, True)
    exchange = new_exchange(exchange_words(shape, rows), "cuda") if flagged else None
    return (*inputs, shape, new_sync("cuda"), exchange, torch.cuda.get_device_properties(0).multi_processor_count)


@pytest.mark.skipif(not torch.cuda.is_available() or not HAS_TRITON, reason="needs CUDA and Triton")
@pytest.mark.parametrize("rows,flagged", [(1, False), (16, False), (1, True), (16, True)])
def test_one_launch_matches_the_composed_kernels_on_cuda(rows, flagged):
    """The programs meeting between phases (or handing flagged words over), at SmolLM2's widths in bf16: three
    steps in a row (the counters count on for the next launch), then the same steps replayed from a CUDA graph."""
    from surgery.decode.block_layout import block_programs
    from surgery.decode.gdn_block import gdn_block_triton, sync_failed

    layer, proj, a, b, w0, w1, w_gu, b_gu, w_d, b_d, state, shape, sync, exchange, programs = cuda_block(rows, flagged)
    launches = 0

    def counted():  # each launch's programs all arrived at each of the four meetings (the flagged form: at its
        count = launches * block_programs(shape, programs, rows)  # launch counter, never meeting), and none timed out
        assert sync[:4].tolist() == [0 if flagged else count] * 4 and not sync_failed(sync), sync
        assert not flagged or exchange[0].item() == count, exchange[:1]

    mine = state.clone()
    with torch.no_grad():
        for _ in range(3):
            want = gdn_block_torch(a, b, w0, 1e-6, TokenStep(layer, state, proj), w1, 1e-5, w_gu, b_gu, w_d, b_d, 1536, True)
            got = gdn_block_triton(a, b, w0, 1e-6, layer, mine, *proj, w1, 1e-5, w_gu, b_gu, w_d, b_d, shape, sync, programs,
                                   exchange=exchange)
            launches += 1
            assert_near(got, want, mine, state)
            counted()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = gdn_block_triton(a, b, w0, 1e-6, layer, mine, *proj, w1, 1e-5, w_gu, b_gu, w_d, b_d, shape, sync, programs,
                                   exchange=exchange)
        mine.copy_(state)
        for _ in range(3):
            want = gdn_block_torch(a, b, w0, 1e-6, TokenStep(layer, state, proj), w1, 1e-5, w_gu, b_gu, w_d, b_d, 1536, True)
            graph.replay()
            launches += 1
            assert_near(out, want, mine, state)
        counted()  # the capture itself launched nothing


@pytest.mark.skipif(not torch.cuda.is_available() or not HAS_TRITON, reason="needs CUDA and Triton")
@pytest.mark.parametrize("rows,flagged,poison", [(1, False, False), (1, True, False), (16, True, False), (1, True, True),
                                                 (16, True, True)])
def test_one_launch_is_deterministic_on_cuda(rows, flagged, poison):
    """The same launch from the same state, again and again, eagerly and replayed: every output and state bit-identical
    to the first launch's, itself near the composed kernels. The kernel's sums have one order, and its programs' timing
    differs from launch to launch: any difference is a program that read a value before it was there, which a
    comparison within a tolerance can pass. `poison`: before each launch every flagged word keeps its launch number and
    gets a NaN value, so a reader that takes a word its launch has not written (a stale one, a torn one, or a copy the
    ready test did not look at) puts NaN into the outputs; on an H100 the form without flagged_words._again did so in
    32 of 200 launches at one row (bench/RESULTS.md, fifty-fourth session)."""
    from surgery.decode.gdn_block import gdn_block_triton, sync_failed

    layer, proj, a, b, w0, w1, w_gu, b_gu, w_d, b_d, state, shape, sync, exchange, programs = cuda_block(rows, flagged)
    mine, theirs = state.clone(), state.clone()

    def launch():
        return gdn_block_triton(a, b, w0, 1e-6, layer, mine, *proj, w1, 1e-5, w_gu, b_gu, w_d, b_d, shape, sync,
                                programs, exchange=exchange)

    def outcome(out):
        return torch.cat([out[0].flatten().float(), out[1].flatten().float(), mine.flatten()])

    with torch.no_grad():
        want = gdn_block_torch(a, b, w0, 1e-6, TokenStep(layer, theirs, proj), w1, 1e-5, w_gu, b_gu, w_d, b_d, 1536, True)
        got = launch()
        assert_near(got, want, mine, theirs)  # the first launch reads a fresh buffer's zeros where it reads too soon
        first = outcome(got)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = launch()
        differ = []
        body = exchange[HEADER_WORDS:] if poison else None  # the flagged words
        for i in range(200 if poison else 60):
            mine.copy_(state)
            if poison:
                body.copy_((body & -(1 << 32)) | 0x7FC00000)  # the old launch numbers, NaN values
            if i % 2:
                graph.replay()
                now = outcome(replayed)
            else:
                now = outcome(launch())
            if not torch.equal(now, first):
                differ.append((i, int(now.isnan().sum()), (now - first).abs().max().item()))
    assert not differ and not sync_failed(sync), (differ[:8], len(differ), sync)


def cuda_llama_hybrid():
    """A tiny Llama hybrid captured in bf16 on CUDA (test_generate.hybrid's layers converted)."""
    import surgery
    from archs import build
    from surgery.sites import find_sites

    torch.manual_seed(0)
    captured = surgery.capture(build("llama").to("cuda", torch.bfloat16), find=False)
    captured.sites = find_sites(captured)
    return hybrid(captured)


def counted_launches(monkeypatch, name: str) -> list:
    """A list that gains an item at each call of surgery.decode.gdn_blocks' `name` (a kernel's launcher)."""
    import surgery.decode.gdn_blocks as gdn_blocks

    kernel = getattr(gdn_blocks, name)
    launches = []
    monkeypatch.setattr(gdn_blocks, name, lambda *a, **k: launches.append(1) or kernel(*a, **k))
    return launches


@pytest.mark.skipif(not torch.cuda.is_available() or not HAS_TRITON, reason="needs CUDA and Triton")
def test_a_cuda_decoder_with_blocks_decodes_as_without(monkeypatch):
    """A tiny Llama hybrid captured in bf16 on CUDA, CUDA-graph steps: the kernel runs (its phases meeting, or
    handing flagged words over), and the greedy tokens are those of SURGERY_GDN_BLOCKS=off (with the tail kernel
    off too: the eight kernels)."""
    graph = cuda_llama_hybrid()
    launches = counted_launches(monkeypatch, "gdn_block_triton")
    monkeypatch.setenv("SURGERY_GDN_TAIL", "off")
    runs = {}
    for setting, flags in (("auto", "off"), ("auto", "on"), ("off", "off")):
        monkeypatch.setenv("SURGERY_GDN_BLOCKS", setting)
        monkeypatch.setenv("SURGERY_GDN_BLOCK_FLAGS", flags)
        decoder = Decoder(graph, verify=False)
        assert blocks(decoder)
        runs[setting, flags] = incremental_greedy(decoder, prompt(graph), 8)
        assert bool(launches) == (setting == "auto"), [m.declined for m in blocks(decoder)]
        assert all((m.exchange is not None) == (flags == "on") for m in blocks(decoder))
        launches.clear()
    for key in (("auto", "off"), ("auto", "on")):
        assert runs[key][0] == runs["off", "off"][0], key
        torch.testing.assert_close(runs[key][1].float(), runs["off", "off"][1].float(), rtol=5e-2, atol=5e-2)


def test_a_kernel_that_gave_up_waiting_during_replays_is_reported_not_silent():
    """A replayed step's one-kernel layer that gave up waiting leaves only its error word: generate raises
    (naming the layer) instead of returning the tokens, a reset warns, the layer composes its kernels from then
    on, and a word once reported is cleared. The kernel does not run on the CPU, so the word is set by hand."""
    from conftest import get_tiny

    from surgery.decode import DecodeError, generate
    from surgery.decode.gdn_block import ERROR_WORD, new_sync, sync_failed

    graph = hybrid(get_tiny("llama").graph.branch())
    decoder = Decoder(graph, step_mode="static", verify=False)
    want = generate(decoder, [prompt(graph)], 3)
    first, *others = blocks(decoder)
    first.sync = new_sync("cpu")
    with pytest.raises(DecodeError, match="gave up waiting") as caught:  # the word set while the steps run
        generate(decoder, [prompt(graph)], 3, stream=lambda row, token: first.sync.__setitem__(ERROR_WORD, 1))
    assert first.failed and not sync_failed(first.sync) and not any(m.failed for m in others)
    assert "SURGERY_GDN_BLOCKS=off" in str(caught.value)
    assert generate(decoder, [prompt(graph)], 3) == want  # reported once; composing changes nothing on the CPU
    first.sync[ERROR_WORD] = 1
    with pytest.warns(UserWarning, match="gave up waiting"):
        decoder.reset()
    assert not sync_failed(first.sync)
