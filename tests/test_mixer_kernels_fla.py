"""What the mixers' kernel wrappers (tcal.mixers.*_kernels, backend "fla") hand fla, checked on the CPU in
the pattern a Decoder uses: a prefill, then one-token steps carrying the final state as the next initial
state, against a float64 reference over the whole sequence (issue 31).

Two ways: (1) GLA's calls bound to fla's own signatures (read from its installed sources) and run by
fla's documented semantics: a decay passed under another name, a scale or state in the wrong slot,
fails here without Triton; (2) fla's real Triton kernels for gla, kda and mamba2 (simple_gla) under
Triton's CPU interpreter (skipped where Triton is not installed, like tests/test_token_step.py's)."""
from __future__ import annotations

import ast
import importlib.util
import inspect
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch

from tcal.mixers.gla_kernels import gla

from test_mixer_gla import fla_naive, inputs, naive_gla

FLA = importlib.util.find_spec("fla")


def fla_signature(relative: str, function: str) -> inspect.Signature:
    """The signature of fla's `function` in fla/<relative>, from its source (fla itself needs Triton to import)."""
    path = Path(list(FLA.submodule_search_locations)[0]) / relative
    tree = ast.parse(path.read_text())
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == function)
    a = node.args
    required = len(a.args) - len(a.defaults)
    params = [inspect.Parameter(x.arg, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                default=inspect.Parameter.empty if i < required else ast.literal_eval(a.defaults[i - required]))
              for i, x in enumerate(a.args)]
    if a.kwarg is not None:
        params.append(inspect.Parameter(a.kwarg.arg, inspect.Parameter.VAR_KEYWORD))
    return inspect.Signature(params)


def fake_fla_gla(calls: list) -> types.ModuleType:
    """fla.ops.gla with fused_recurrent_gla and chunk_gla bound to fla's signatures and computed by fla's
    naive recurrence, reading each argument by the name fla gives it (the decay: gk for the recurrent
    kernel, g for the chunked one; scale None: K^-0.5)."""
    naive = fla_naive("gla").naive_recurrent_gla
    module = types.ModuleType("fla.ops.gla")

    def make(name: str, relative: str, decay: str):
        signature = fla_signature(relative, name)

        def run(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            p = bound.arguments
            assert not p.get("kwargs"), f"{name} got arguments it does not take: {sorted(p['kwargs'])}"
            assert p.get("gv") is None, f"{name}: a decay on the values (gv) is not GLA's"
            calls.append(name)
            q, k = p["q"], p["k"]
            scale = k.shape[-1] ** -0.5 if p["scale"] is None else p["scale"]
            o, s = naive(q * (scale * k.shape[-1] ** 0.5), k, p["v"], p[decay], p["initial_state"], p["output_final_state"])
            return o.to(q.dtype), s

        setattr(module, name, run)

    make("fused_recurrent_gla", "ops/gla/fused_recurrent.py", "gk")
    make("chunk_gla", "ops/gla/chunk.py", "g")
    return module


@pytest.mark.skipif(FLA is None, reason="fla (flash-linear-attention) is not installed")
def test_gla_wrapper_passes_fla_its_arguments_by_fla_names(monkeypatch):
    calls = []
    monkeypatch.setitem(sys.modules, "fla.ops.gla", fake_fla_gla(calls))
    for prefill, kernel in ((8, "fused_recurrent_gla"), (70, "chunk_gla")):
        q, k, v, g, _ = inputs(b=2, t=prefill + 3, h=3, dk=8, dv=5, dtype=torch.float32)
        want, want_state = naive_gla(q, k, v, g, 0.3, torch.zeros(2, 3, 8, 5))
        with torch.no_grad():
            o, state = gla(q[:, :prefill], k[:, :prefill], v[:, :prefill], g[:, :prefill], 0.3, output_final_state=True, backend="fla")
            outs = [o]
            for t in range(prefill, prefill + 3):
                o, state = gla(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], g[:, t:t + 1], 0.3, state, True, backend="fla")
                outs.append(o)
        assert calls[0] == kernel and set(calls[1:]) == {"fused_recurrent_gla"}, calls
        calls.clear()
        torch.testing.assert_close(torch.cat(outs, 1).double(), want, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(state.double(), want_state, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None or FLA is None,
                    reason="Triton is not installed (a CUDA-side extra), or fla is not")
def test_fla_kernels_through_the_wrappers_in_the_interpreter():
    """fla's Triton kernels run by Triton's CPU interpreter through gla, kda and ssd (mamba2): a prefill
    of 8 tokens (fla's recurrent kernel; float32 and bf16) or 70 (its chunked kernel; float32: the
    interpreter's bf16 dot products are not the GPU's), then 3 one-token steps carrying the state,
    against the float64 PyTorch reference of the whole sequence."""
    script = textwrap.dedent("""
        import torch
        from tests.fla_interpreter import install
        install("fla.ops.gla", "fla.ops.kda", "fla.ops.simple_gla")
        from tcal.mixers.gla_kernels import gla
        from tcal.mixers.kda_kernels import kda
        from tcal.mixers.mamba2_kernels import ssd

        def case(mixer, t, b=1, h=2, d=16):
            gen = torch.Generator().manual_seed(0)
            r = lambda *s: torch.randn(*s, generator=gen)
            q, k, v = r(b, t, h, d), torch.nn.functional.normalize(r(b, t, h, d), dim=-1), r(b, t, h, d)
            g = -torch.rand(*((b, t, h) if mixer == "mamba2" else (b, t, h, d)), generator=gen) * 0.5
            return [q, k, v, g] + ([torch.rand(b, t, h, generator=gen)] if mixer == "kda" else [])

        rel = lambda a, b: ((a.double() - b).norm() / b.norm()).item()
        for mixer, run in (("gla", gla), ("kda", kda), ("mamba2", ssd)):
            for prefill, dtype, tol in ((8, torch.float32, 1e-5), (8, torch.bfloat16, 2e-2), (70, torch.float32, 1e-5)):
                x = case(mixer, prefill + 3)
                want, want_state = run(*[a.double() for a in x], 0.3, output_final_state=True, backend="torch")
                x = [a.to(dtype) if i < 3 else a for i, a in enumerate(x)]
                with torch.no_grad():
                    o, s = run(*[a[:, :prefill] for a in x], 0.3, output_final_state=True, backend="fla")
                    outs = [o]
                    for t in range(prefill, prefill + 3):
                        o, s = run(*[a[:, t:t + 1] for a in x], 0.3, s, True, backend="fla")
                        outs.append(o)
                errors = rel(torch.cat(outs, 1), want), rel(s, want_state)
                assert max(errors) < tol, (mixer, prefill, dtype, errors)
        print("ok")
    """)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]
