"""The gated delta rule kernels and the GatedDeltaNet layer, on CPU."""

import importlib.util
import math
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tcal.gdn import GatedDeltaNet
from tcal.kernels import (
    chunked_gated_delta_rule_torch,
    gated_delta_rule,
    recurrent_gated_delta_rule_torch,
)


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    """These tensors are tiny: with the 2 cores shared by other jobs, OpenMP's barriers on every
    small matmul cost more than the work (seen: 5 s instead of 25 ms at T=4096), so use one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def reference_recurrence(q, k, v, g, beta, scale, initial_state=None):
    """Float64 loop over tokens, written from the definition with S [Dv, Dk] per head.

    Returns o [B, T, H, Dv] and the final state in the API layout [B, H, Dk, Dv]."""
    q, k, v, g, beta = (x.detach().double() for x in (q, k, v, g, beta))
    batch, seq_len, heads, dk = k.shape
    dv = v.shape[-1]
    o = torch.zeros(batch, seq_len, heads, dv, dtype=torch.float64)
    final = torch.zeros(batch, heads, dk, dv, dtype=torch.float64)
    for b in range(batch):
        for h in range(heads):
            s = torch.zeros(dv, dk, dtype=torch.float64)
            if initial_state is not None:
                s = initial_state[b, h].double().T.clone()
            for t in range(seq_len):
                s = math.exp(g[b, t, h]) * s
                kt = k[b, t, h]
                s = s + beta[b, t, h] * torch.outer(v[b, t, h] - s @ kt, kt)
                o[b, t, h] = s @ (scale * q[b, t, h])
            final[b, h] = s.T
    return o, final


def make_inputs(batch, seq_len, heads, dk, dv, *, dtype=torch.float32, g_min=-5.0, beta="uniform", seed=0):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q = F.normalize(randn(batch, seq_len, heads, dk), dim=-1)
    k = F.normalize(randn(batch, seq_len, heads, dk), dim=-1)
    v = randn(batch, seq_len, heads, dv)
    g = g_min * torch.rand(batch, seq_len, heads, generator=gen, dtype=torch.float64)
    u = torch.rand(batch, seq_len, heads, generator=gen, dtype=torch.float64)
    beta = {"uniform": u, "near0": 1e-4 * u, "near1": 1 - 1e-4 * u}[beta]
    h0 = randn(batch, heads, dk, dv)
    return [x.to(dtype) for x in (q, k, v, g, beta)], h0.to(dtype)


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


CASES = [
    # batch, seq_len, heads, dk, dv, chunk_size, g_min, beta
    (1, 64, 1, 8, 8, 16, -1.0, "uniform"),  # T a multiple of the chunk
    (2, 37, 3, 8, 5, 16, -5.0, "uniform"),  # T not a multiple, Dk != Dv
    (2, 11, 3, 6, 9, 16, -5.0, "uniform"),  # T < chunk
    (1, 50, 2, 8, 8, 16, -20.0, "uniform"),  # strong decay
    (2, 40, 3, 8, 4, 32, -0.5, "near0"),
    (2, 40, 3, 8, 4, 8, -0.5, "near1"),
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.float64, 1e-12)])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_matches_reference(case, dtype, tol, with_state):
    batch, seq_len, heads, dk, dv, chunk, g_min, beta = case
    (q, k, v, g, b), h0 = make_inputs(batch, seq_len, heads, dk, dv, dtype=dtype, g_min=g_min, beta=beta)
    h0 = h0 if with_state else None
    scale = dk**-0.5
    o_ref, s_ref = reference_recurrence(q, k, v, g, b, scale, h0)
    o, s = chunked_gated_delta_rule_torch(
        q, k, v, g, b, initial_state=h0, output_final_state=True, chunk_size=chunk
    )
    assert o.dtype == dtype and o.shape == (batch, seq_len, heads, dv)
    assert s.shape == (batch, heads, dk, dv)
    assert rel_err(o, o_ref) <= tol
    assert rel_err(s, s_ref) <= tol


def test_chunked_keeps_slow_decay_under_bf16_autocast():
    """Training runs under bf16 autocast: the state carried between chunks, and each chunk's decay,
    must stay float32: with weak writes the state is mostly decayed memory, and a chunk decay near 1
    rounded to bf16 (steps of 2^-8) compounds over the chunks (measured: 10x the error)."""
    (q, k, v, g, b), _ = make_inputs(1, 4096, 1, 64, 64, g_min=-2e-4, beta="near0", seed=3)
    o_ref, s_ref = reference_recurrence(q, k, v, g, b, 64**-0.5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o, s = chunked_gated_delta_rule_torch(q, k, v, g, b, output_final_state=True)
    assert s.dtype == torch.float32
    assert rel_err(s, s_ref) < 6e-3, rel_err(s, s_ref)
    assert rel_err(o, o_ref) < 8e-3, rel_err(o, o_ref)


def load_fla_naive():
    # fla (flash-linear-attention) is a declared dependency; on a CPU it cannot be imported (no
    # triton), so its pure-PyTorch reference is loaded by path
    spec = importlib.util.find_spec("fla")
    assert spec is not None and spec.submodule_search_locations, "fla (flash-linear-attention) is not installed"
    path = Path(list(spec.submodule_search_locations)[0]) / "ops" / "gated_delta_rule" / "naive.py"
    assert path.is_file(), f"fla's naive gated delta rule reference is missing at {path}"
    module_spec = importlib.util.spec_from_file_location("fla_gdn_naive", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def test_matches_fla_naive_reference():
    """fla's references compute in float32, take (beta, g) in the recurrent one's argument order,
    apply the scale themselves and keep the state as [B, H, Dk, Dv], like ours."""
    naive = load_fla_naive()
    (q, k, v, g, b), h0 = make_inputs(2, 45, 3, 8, 6, g_min=-8.0)
    o, s = chunked_gated_delta_rule_torch(q, k, v, g, b, initial_state=h0, output_final_state=True, chunk_size=16)
    o_rec, s_rec = naive.naive_recurrent_gated_delta_rule(q, k, v, b, g, initial_state=h0, output_final_state=True)
    o_chk, s_chk = naive.naive_chunk_gated_delta_rule(
        q, k, v, g, b, chunk_size=16, initial_state=h0, output_final_state=True
    )
    for o_fla, s_fla in ((o_rec, s_rec), (o_chk, s_chk)):
        assert rel_err(o, o_fla) <= 1e-5
        assert rel_err(s, s_fla) <= 1e-5


def test_recurrent_matches_chunked():
    (q, k, v, g, b), h0 = make_inputs(2, 29, 3, 8, 6, g_min=-3.0)
    o_r, s_r = recurrent_gated_delta_rule_torch(q, k, v, g, b, initial_state=h0, output_final_state=True)
    o_c, s_c = chunked_gated_delta_rule_torch(q, k, v, g, b, initial_state=h0, output_final_state=True, chunk_size=8)
    assert rel_err(o_r, o_c) <= 1e-5 and rel_err(s_r, s_c) <= 1e-5


def test_state_carries_across_calls():
    """Prefill then decode with the returned state equals one pass over the whole sequence."""
    (q, k, v, g, b), _ = make_inputs(1, 40, 2, 8, 8)
    o_full, s_full = gated_delta_rule(q, k, v, g, b, output_final_state=True, backend="torch", chunk_size=16)
    head = [x[:, :36] for x in (q, k, v, g, b)]
    tail = [x[:, 36:] for x in (q, k, v, g, b)]
    o_head, state = gated_delta_rule(*head, output_final_state=True, backend="torch", chunk_size=16)
    o_tail, s_tail = gated_delta_rule(*tail, initial_state=state, output_final_state=True, backend="torch")
    assert rel_err(torch.cat([o_head, o_tail], 1), o_full) <= 1e-5
    assert rel_err(s_tail, s_full) <= 1e-5


def test_default_scale_and_unknown_backend():
    (q, k, v, g, b), _ = make_inputs(1, 20, 1, 4, 4)
    o_default, _ = gated_delta_rule(q, k, v, g, b, backend="torch")
    o_explicit, _ = gated_delta_rule(q, k, v, g, b, scale=0.5, backend="torch")
    assert torch.allclose(o_default, o_explicit)
    with pytest.raises(ValueError):
        gated_delta_rule(q, k, v, g, b, backend="cuda")


def test_gradcheck_chunked():
    (q, k, v, g, b), h0 = make_inputs(1, 5, 1, 3, 3, dtype=torch.float64, g_min=-2.0)
    inputs = [x.clone().requires_grad_() for x in (q, k, v, g, b, h0)]

    def fn(q, k, v, g, b, h0):
        return chunked_gated_delta_rule_torch(q, k, v, g, b, initial_state=h0, output_final_state=True, chunk_size=2)

    assert torch.autograd.gradcheck(fn, inputs)


@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_gradients_match_recurrent(with_state):
    """Float64, T not a multiple of the chunk: the chunked kernel's gradients (inputs and initial
    state, through both the output and the final state) equal the token loop's."""
    (q, k, v, g, b), h0 = make_inputs(2, 21, 2, 5, 3, dtype=torch.float64, g_min=-3.0, seed=4)
    h0 = h0 if with_state else None
    gen = torch.Generator().manual_seed(5)
    grad_o = torch.randn(2, 21, 2, 3, generator=gen, dtype=torch.float64)
    grad_s = torch.randn(2, 2, 5, 3, generator=gen, dtype=torch.float64)

    def grads(kernel, **options):
        inputs = [x.clone().requires_grad_() for x in (q, k, v, g, b)]
        state = None if h0 is None else h0.clone().requires_grad_()
        o, s = kernel(*inputs, initial_state=state, output_final_state=True, **options)
        wrt = inputs + ([state] if state is not None else [])
        return [o, s, *torch.autograd.grad((o * grad_o).sum() + (s * grad_s).sum(), wrt)]

    for chunked, looped in zip(grads(chunked_gated_delta_rule_torch, chunk_size=8),
                               grads(recurrent_gated_delta_rule_torch)):
        assert rel_err(chunked, looped) <= 1e-12


def test_long_sequence_is_fast():
    (q, k, v, g, b), _ = make_inputs(1, 4096, 2, 16, 16)
    start = time.perf_counter()
    o, _ = chunked_gated_delta_rule_torch(q, k, v, g, b)
    assert time.perf_counter() - start < 3.0
    assert torch.isfinite(o).all()


# The layer.

HIDDEN, HEADS, HEAD_DIM = 16, 2, 8


def make_layer(**kwargs):
    torch.manual_seed(0)
    return GatedDeltaNet(HIDDEN, HEADS, HEAD_DIM, backend="torch", **kwargs)


def hidden(batch=2, seq_len=21):
    return torch.randn(batch, seq_len, HIDDEN, generator=torch.Generator().manual_seed(1))


def test_layer_shape_and_forward_parts():
    layer = make_layer()
    x = hidden()
    parts = layer.forward_parts(x)
    assert layer(x).shape == x.shape
    assert torch.equal(layer(x), parts["out"])
    per_head = (2, 21, HEADS, HEAD_DIM)
    for name in ("q", "k", "v", "core", "gate", "normed"):
        assert parts[name].shape == per_head, name
    for name in ("g", "beta", "beta_logit"):
        assert parts[name].shape == (2, 21, HEADS), name
    assert (parts["g"] <= 0).all()
    assert torch.allclose(parts["beta"], parts["beta_logit"].sigmoid())
    assert torch.allclose(parts["q"].norm(dim=-1), torch.ones(()), atol=1e-4)


def test_layer_matches_hand_computation():
    layer = make_layer()
    with torch.no_grad():
        layer.o_norm.weight.uniform_(0.5, 1.5)
    x = hidden()
    parts = layer.forward_parts(x)

    def heads(y):
        return y.view(2, 21, HEADS, HEAD_DIM)

    q = heads(F.silu(layer.q_proj(x)))
    q = q / torch.sqrt(q.pow(2).sum(-1, keepdim=True) + 1e-6)
    g = -layer.A_log.exp() * F.softplus(layer.a_proj(x) + layer.dt_bias)
    core = parts["core"]
    gate = heads(layer.g_proj(x))
    normed = core / torch.sqrt(core.pow(2).mean(-1, keepdim=True) + 1e-5) * layer.o_norm.weight * F.silu(gate)
    assert torch.allclose(parts["q"], q, atol=1e-6)
    assert torch.allclose(parts["g"], g, atol=1e-6)
    assert torch.allclose(parts["normed"], normed, atol=1e-6)
    assert torch.allclose(parts["out"], layer.o_proj(normed.flatten(-2)), atol=1e-6)
    o_ref, _ = reference_recurrence(parts["q"], parts["k"], parts["v"], parts["g"], parts["beta"], HEAD_DIM**-0.5)
    assert rel_err(core, o_ref) <= 1e-5


def test_v_activation_identity():
    layer = make_layer(v_activation="identity")
    x = hidden()
    expected = layer.v_proj(x).view(2, 21, HEADS, HEAD_DIM)
    assert torch.allclose(layer.forward_parts(x)["v"], expected)
    with pytest.raises(ValueError):
        make_layer(v_activation="relu")


def test_decay_parameter_init_ranges():
    torch.manual_seed(0)
    layer = GatedDeltaNet(HIDDEN, 64, 4)
    a = layer.A_log.exp()
    dt = F.softplus(layer.dt_bias)
    assert (a > 0).all() and (a <= 16).all()
    assert (dt >= 1e-3 * (1 - 1e-5)).all() and (dt <= 0.1 * (1 + 1e-5)).all()
    assert torch.equal(layer.o_norm.weight, torch.ones(4))


def test_gdn_config_round_trip():
    layer = make_layer(q_bias=True, use_short_conv=True, layer_idx=3)
    with torch.no_grad():
        layer.q_conv1d.weight.normal_()
    rebuilt = GatedDeltaNet.from_gdn_config(layer.gdn_config())
    rebuilt.load_state_dict(layer.state_dict())
    x = hidden()
    assert torch.equal(rebuilt(x), layer(x))
    assert rebuilt.gdn_config() == layer.gdn_config()
    assert "layer_idx=3" in repr(layer)


def test_short_conv_identity_init_keeps_projections():
    layer = make_layer(use_short_conv=True, v_bias=True)
    x = hidden()
    parts = layer.forward_parts(x)
    assert layer.q_conv1d.weight.shape == (HEADS * HEAD_DIM, 1, 4)
    assert torch.allclose(parts["v"], F.silu(layer.v_proj(x)).view(2, 21, HEADS, HEAD_DIM), atol=1e-6)
    assert torch.allclose(parts["q"], make_layer().forward_parts(x)["q"], atol=1e-6)


def test_short_conv_is_causal():
    layer = make_layer(use_short_conv=True, conv_identity_init=False)
    x = hidden()
    changed = x.clone()
    changed[:, 10:] += 1.0
    assert torch.equal(layer(x)[:, :10], layer(changed)[:, :10])


def test_bias_flags():
    layer = make_layer(q_bias=True, k_bias=True, v_bias=True, o_bias=True)
    assert all(getattr(layer, f"{n}_proj").bias is not None for n in "qkvo")
    plain = make_layer()
    assert all(getattr(plain, f"{n}_proj").bias is None for n in "qkvoabg")


def test_gradients_reach_every_parameter():
    layer = make_layer(q_bias=True, k_bias=True, v_bias=True, o_bias=True, use_short_conv=True)
    layer(hidden(seq_len=40)).square().mean().backward()
    for name, param in layer.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, name


def test_layer_as_fx_call_module():
    layer = make_layer()
    graph = torch.fx.Graph()
    node = graph.call_module("attn", (graph.placeholder("x"),))
    graph.output(node)
    module = torch.fx.GraphModule(torch.nn.ModuleDict({"attn": layer}), graph)
    x = hidden()
    assert torch.equal(module(x), layer(x))


def test_fused_projection_cache_follows_weight_updates():
    """Inference keeps the concatenated projection weight between calls; any change to a projection
    (an in-place optimiser or calibration write, or a new tensor) must be seen by the next call."""
    torch.manual_seed(0)
    layer = GatedDeltaNet(32, 2, 16, q_bias=True)
    x = torch.randn(1, 5, 32)
    with torch.no_grad():
        first = layer(x)
        assert torch.equal(layer(x), first)                    # served from the cache
        layer.k_proj.weight.mul_(2.0)                          # in place: version counter moves
        changed = layer(x)
        layer.k_proj.weight.div_(2.0)
        layer.q_proj.bias = torch.nn.Parameter(layer.q_proj.bias + 1.0)   # a new tensor
        rebound = layer(x)
    reference = GatedDeltaNet(32, 2, 16, q_bias=True)
    reference.load_state_dict(layer.state_dict())
    with torch.no_grad():
        assert torch.equal(reference(x), rebound)              # a fresh layer with the same weights
    assert not torch.allclose(changed, first) and not torch.allclose(rebound, first)
    out = layer(x)                                             # with gradients: no stale cache, grads flow
    out.square().sum().backward()
    assert layer.k_proj.weight.grad is not None and "_fused_cache" not in layer.__dict__


def test_padded_fused_projection_gives_the_same_outputs():
    """A fused input projection with zero rows appended (row_aligned's CUDA padding, here passed in as a
    caller's projection) gives the same layer output as the unpadded one: the padding is sliced off."""
    from tcal.gdn import concatenated

    torch.manual_seed(0)
    layer = GatedDeltaNet(hidden_size=32, num_heads=2, head_dim=16, backend="torch").double()
    x = torch.randn(2, 7, 32, dtype=torch.float64)
    layers = [layer.get_submodule(n) for n in layer.INPUT_PROJECTIONS]
    weight, bias = concatenated([l.weight for l in layers], [l.bias for l in layers])
    padded = torch.nn.functional.pad(weight, (0, 0, 0, -weight.shape[0] % 64 or 64))
    with torch.no_grad():
        plain = layer(x)
        assert torch.equal(layer(x, projection=(padded, None)), plain)
