"""surgery.decode.step_attention: the split-KV one-query attention of static decode steps, against the
existing SDPA path on tiny architectures (GQA, MHA, softcap), a float64 reference, and the Triton
kernels in Triton's CPU interpreter."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from test_generate import full_greedy, hybrid, incremental_greedy

from surgery.decode import Decoder, caches
from surgery.decode.step_attention import kernel_takes, splits_for, step_attention_reference, step_attention_torch


def recorded_steps(arch: str, monkeypatch, steps: int = 4) -> list:
    """(q, K cache, V cache, index, scale, softcap, SDPA's output) of every linear-cache static step
    of a hybrid of `arch` (half its layers GDN), decoded greedily on the existing path."""
    from conftest import get_tiny

    graph = hybrid(get_tiny(arch).graph.branch())
    decoder = Decoder(graph, step_mode="static")
    seen, original = [], caches.KVCacheAttention._static_step

    def spy(self, q, k, v, index):
        out = original(self, q, k, v, index)
        if self.window is None:
            seen.append((q, self.k_cache.clone(), self.v_cache.clone(), index.clone(), self.scale, self.softcap, out))
        return out

    monkeypatch.setattr(caches.KVCacheAttention, "_static_step", spy)
    prompt = torch.randint(3, graph.config.vocab_size, (7,), generator=torch.Generator().manual_seed(2)).tolist()
    incremental_greedy(decoder, prompt, steps)
    return seen


@pytest.mark.parametrize("arch,grouped,capped", [("llama", True, False), ("qwen2", True, False), ("gpt2", False, False),
                                                 ("gemma2", True, True)])
def test_split_softmax_is_the_existing_path(arch, grouped, capped, monkeypatch):
    """The kernel's split-and-combine arithmetic (in torch) gives what SDPA / the softcap path gives on
    the same cache, at each step, with several splits and with one, and matches float64."""
    seen = recorded_steps(arch, monkeypatch)
    assert seen, f"{arch}: no linear-cache static step ran"
    for q, keys, values, index, scale, softcap, out in seen:
        assert (keys.shape[1] < q.shape[1]) == grouped and (softcap is not None) == capped
        exact = step_attention_reference(q, keys, values, index, scale=scale, softcap=softcap)
        for programs in (1, 3 * keys.shape[1]):
            got = step_attention_torch(q, keys, values, index, scale=scale, softcap=softcap, programs=programs)
            torch.testing.assert_close(got, out, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-5)
        assert not kernel_takes(q, keys, values)  # the CPU path stays SDPA


def test_routed_steps_give_full_recomputation_tokens(monkeypatch):
    """The static step routed through the split attention (its torch form standing in for the CUDA
    kernel): the tokens and logits of recomputing the whole sequence."""
    from conftest import get_tiny

    calls = []

    def split(q, keys, values, index, *, scale, softcap):
        calls.append(index.item())
        return step_attention_torch(q, keys, values, index, scale=scale, softcap=softcap, programs=8)

    monkeypatch.setattr(caches, "kernel_takes", lambda *args: True)
    monkeypatch.setattr(caches, "step_attention_triton", split)
    graph = hybrid(get_tiny("llama").graph.branch())
    prompt = torch.randint(3, graph.config.vocab_size, (8,), generator=torch.Generator().manual_seed(1)).tolist()
    tokens, logits = incremental_greedy(Decoder(graph, step_mode="static"), prompt, 5)
    want_tokens, want_logits = full_greedy(graph, prompt, 5)
    assert tokens == want_tokens and calls[:4] == [8, 9, 10, 11]
    torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-4)


def test_splits_cover_the_cache():
    for batch, heads, size, programs in ((1, 3, 65536, 528), (16, 3, 65536, 528), (1, 1, 5, 8), (2, 4, 1000, 1)):
        count, per = splits_for(batch, heads, size, programs)
        assert per % 64 == 0 and count * per >= size > (count - 1) * per
        assert batch * heads * count <= max(programs, batch * heads)


def test_guard_refuses_what_the_kernel_does_not_do():
    q, kv = torch.randn(1, 4, 1, 16), torch.randn(1, 2, 32, 16)
    assert not kernel_takes(q, kv, kv)                      # CPU tensors
    assert not kernel_takes(q, kv, kv, k_map=[0, 0, 1, 1])   # an explicit head map
    assert not kernel_takes(torch.randn(1, 4, 2, 16), kv, kv)  # two query tokens


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed (a CUDA-side extra)")
def test_kernels_in_the_interpreter():
    """The two Triton kernels in Triton's CPU interpreter against float64: GQA, MHA, softcap, odd head
    widths, q a transposed view, batch 2, the first and the last slot; slots past the index hold NaN.
    And the custom op torch.compile sees passes opcheck (its fake output is the kernels' output)."""
    script = textwrap.dedent("""
        import torch
        import surgery.decode.step_attention as sa
        g = torch.Generator().manual_seed(0)
        cases = [(1, 9, 3, 300, 64, 64, 130, None, 16), (2, 4, 4, 70, 12, 20, 69, 50.0, 3),
                 (1, 2, 1, 5, 8, 8, 0, None, 8), (1, 6, 2, 200, 16, 16, 199, 5.0, 1)]
        for b, h, hc, s, d, dv, idx, cap, programs in cases:
            q = torch.randn(b, 1, h, d, generator=g).transpose(1, 2)
            k, v = torch.randn(b, hc, s, d, generator=g), torch.randn(b, hc, s, dv, generator=g)
            k[:, :, idx + 1:] = float("nan")
            v[:, :, idx + 1:] = float("nan")
            index = torch.tensor([idx])
            sa.device_programs = lambda device: programs
            got = sa.step_attention_triton(q, k, v, index, scale=0.3, softcap=cap)
            want = sa.step_attention_reference(q, k, v, index, scale=0.3, softcap=cap)
            assert got.shape == (b, h, 1, dv), got.shape
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
        torch.library.opcheck(sa.split_kv_attention_op, (q, k.nan_to_num(0), v.nan_to_num(0), index, 0.3, 2.0))
        sa.DOT = True  # the tensor-core form (float16: the interpreter's tl.dot misreads bfloat16 bits)
        for b, h, hc, s, d, idx, cap in [(1, 9, 3, 300, 64, 130, None), (2, 4, 2, 90, 16, 89, 30.0)]:
            q = torch.randn(b, 1, h, d, generator=g).transpose(1, 2).half()
            k, v = torch.randn(b, hc, s, d, generator=g).half(), torch.randn(b, hc, s, d, generator=g).half()
            index = torch.tensor([idx])
            want = sa.step_attention_reference(q, k, v, index, scale=0.125, softcap=cap)
            got = sa.step_attention_triton(q, k, v, index, scale=0.125, softcap=cap)
            assert (got.double() - want).abs().max() < 2e-3, (got.double() - want).abs().max()
        print("ok")
    """)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]
