"""Registers and spills of tcal's GDN prefill kernels and the one-launch GDN decode layer for sm_90a, on any machine (no GPU: Triton compiles to PTX
and the ptxas it runs for sm_90 assembles it), at SmolLM2-135M's GDN shapes (9 heads of 64, bf16) and the launch each
wrapper uses (its warps; launched as a programmatic dependent, tcal.pdl, when `pdl`). What a CPU-only session
can check of a kernel before a GPU times it: a spill is local-memory traffic in the kernel's inner loop.

    python bench/speed.py --sections registers [--registers-pdl]
"""
from __future__ import annotations

import os
import re
import subprocess
import tempfile

BF16, F32, I32 = "*bf16", "*fp32", "i32"
SHAPES = dict(H=9, K=64, V=64, BK=64, BV=64, DOT="tf32x3")


def kernels() -> dict:
    """name -> (jit function, runtime argument types, constexprs, warps as its wrapper launches it)."""
    import tcal.chunk_inputs as ck
    import tcal.chunk_intra as ci
    import tcal.chunk_states as cs
    import tcal.delta_inputs as di
    import tcal.gated_norm as gn

    strides = lambda names, dims: {f"s{x}_{y}": I32 for x in names for y in dims}  # noqa: E731
    return {
        "tcal.delta_inputs": (di._delta_inputs_kernel, {**dict.fromkeys(("q", "k", "v", "a", "b"), BF16), "A_log": F32, "dt_bias": F32,
                              **dict.fromkeys(("q_out", "k_out", "v_out"), BF16), "g_out": F32, "beta_out": F32,
                              **dict.fromkeys(("rows", "length", "heads"), I32), **strides("qkv", "bthd"), **strides("ab", "bth"),
                              "eps": "fp32"}, dict(D=64, BD=64, BLOCK_T=32, V_SILU=True), 4),
        "tcal.chunk_inputs (the inputs and the intra solve)": (
            ck._chunk_inputs_kernel, {**dict.fromkeys(("q_raw", "k_raw", "v_raw", "a", "b"), BF16), "A_log": F32, "dt_bias": F32,
                                      **dict.fromkeys(("q_out", "k_out", "v_out"), BF16), "g_tmp": F32, "beta_tmp": F32, "g_out": F32, "w": BF16, "u": BF16,
                                      "length": I32, **strides("qkv", "bthd"), **strides("ab", "bth"), "eps": "fp32"},
            dict(H=9, D=64, BD=64, DOT="tf32x3", V_SILU=True), ci.NUM_WARPS),
        "tcal.chunk_intra": (ci._chunk_intra_kernel, dict(k=BF16, v=BF16, g=F32, beta=F32, g_out=F32, w=BF16, u=BF16, length=I32),
                             SHAPES, ci.NUM_WARPS),
        "tcal.chunk_states transitions": (cs._transitions_kernel, dict(k=BF16, w=BF16, u=BF16, g=F32, trans_d=BF16, trans_n=F32,
                                                                       length=I32), SHAPES, cs.NUM_WARPS),
        "tcal.chunk_states walk (value block 16)": (cs._pass_kernel, dict(trans_d=BF16, trans_n=F32, g=F32, h=BF16, h0=F32, ht=F32,
                                                                          length=I32),
                                                    {**SHAPES, "BV": 16, "HAS_H0": True, "STORE_FINAL": True}, cs.NUM_WARPS),
        **{f"tcal.chunk_states output{' + gated norm' if norm else ''}": (
            cs._output_kernel, dict(q=BF16, k=BF16, w=BF16, u=BF16, g=F32, h=BF16, o=BF16, scale="fp32", length=I32, gate=BF16,
                                    weight=BF16, eps="fp32", sg_b=I32, sg_t=I32, sg_h=I32, sg_d=I32),
            {**SHAPES, "NORM": norm, "SIGMOID": False}, cs.NUM_WARPS) for norm in (False, True)},
        "tcal.gated_norm": (gn._gated_rms_norm_kernel, dict(x=BF16, gate=BF16, weight=BF16, out=BF16, rows=I32, length=I32,
                                                            heads=I32, **strides("xg", "bthd"), eps="fp32"),
                            dict(D=64, BD=64, BLOCK_R=32, SIGMOID=False), 4),
    }


def layer_kernels() -> dict:
    """surgery.decode.gdn_block's one-launch GDN layer at one row (a SmolLM2-shaped GDN layer, the launcher's
    constants for 132 SMs, an H100's or H200's), its phases meeting at grid barriers or handing flagged words over."""
    import surgery.decode.gdn_block as gb
    from surgery.decode.fused_linears import FusedWeight
    from surgery.decode.gdn_blocks import block_shape
    from tcal.gdn import GatedDeltaNet

    layer = GatedDeltaNet(576, 9, 64)
    parts = [layer.get_submodule(n) for n in layer.INPUT_PROJECTIONS]
    w_in, _ = FusedWeight([p.weight for p in parts], [p.bias for p in parts], align_rows=True).pair()  # as a Decoder's
    constexprs = dict(gb.shape_constants(block_shape(layer, w_in.shape[0], 1536, True), 1, 132), HAS_W0=True, HAS_W1=True,
                      HAS_BIAS_IN=False, HAS_BIAS_O=False, HAS_BIAS_GU=False, HAS_BIAS_D=False, FIRST=1, LAST=5)
    names = ("a", "b", "w0", "w_in", "bias_in", "proj", "h", "A_log", "dt_bias", "o_norm_w", "state", "core", "w_o",
             "bias_o", "y", "w1", "w_gu", "bias_gu", "h2", "m", "w_d", "bias_d", "d_out")
    signature = {**dict.fromkeys(names, BF16), "state": F32, "sync": "*i64", "ex": "*i64",
                 **dict.fromkeys(("eps0", "eps1", "scale", "norm_eps"), "fp32")}
    return {f"surgery.decode.gdn_block (one row{', flagged words' if flags else ''})":
            (gb._gdn_block_kernel, signature, dict(constexprs, FLAGS=flags), gb.NUM_WARPS) for flags in (False, True)}


def compile_sm90(kernel, signature: dict, constexprs: dict, warps: int, pdl: bool) -> tuple[str, str]:
    """(the kernel's PTX for sm_90, ptxas -v's report of it for sm_90a)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    constexprs = {**constexprs, "PDL": pdl} if "PDL" in kernel.arg_names else constexprs
    signature = {**signature, **dict.fromkeys(constexprs, "constexpr")}
    # as the JIT specialises a launch: every pointer from torch's allocator 16-byte aligned, a 2k prompt's length too
    aligned = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]]
               for name, kind in signature.items() if kind.startswith("*") or name == "length"}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=aligned)
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, launch_pdl=pdl)).asm["ptx"]
    from triton.backends.nvidia.compiler import get_ptxas  # the assembler Triton itself runs for sm_90 (3.9: ptxas-blackwell)

    ptxas = get_ptxas(90).path
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "kernel.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        report = subprocess.run([ptxas, "-arch=sm_90a", "-v", path, "-o", os.devnull], capture_output=True, text=True, check=True)
    return ptx, report.stderr


def reported(report: str, pattern: str) -> int:
    """The integer ptxas -v printed where `pattern` (a regex with one group) matches (0 when it does not)."""
    found = re.search(pattern, report)
    return int(found.group(1)) if found else 0


def run(rows, pdl: bool = False) -> None:
    for name, (kernel, signature, constexprs, warps) in {**kernels(), **layer_kernels()}.items():
        _, report = compile_sm90(kernel, signature, constexprs, warps, pdl)
        dependent = pdl and "PDL" in kernel.arg_names  # the one-launch layer has no dependent launch
        config = f"sm_90a, {warps} warps, 9 heads of 64, bf16" + (", launched as a dependent" if dependent else "")
        rows.add(name, config, "registers", reported(report, r"Used (\d+) registers"), "per thread")
        rows.add(name, config, "spill stores", reported(report, r"(\d+) bytes spill stores"), "bytes")
