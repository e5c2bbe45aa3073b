"""Multi-head latent attention (MLA) teachers: tiny DeepSeek-V3 (dense MLPs: first_k_dense_replace 3 > 2
layers) and Kimi Linear with every layer full attention (MLA without RoPE, q_proj without a low rank).

References: the eager transformers model (its logits; its projections' inputs and outputs, hooked), the
low-rank algebra composed step by step in float64, and sweep_check's incremental-vs-full decoding and
save/load/generate/export round trip (the other MLA families of archs.EXTRA_ARCHS run in the opt-in sweep;
deepseek_v3 in its default SUBSET)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

import surgery
from archs import config as arch_config
from surgery import PassManager
from surgery.core.slice_fill import fold_slice_fills
from surgery.errors import PassConfigError
from surgery.sites.site import through_low_rank
from sweep_check import CONFIGS, PIPELINE, BytesTokenizer, SweepResult, decode, probe_ids, round_trip


def kimi_config():
    return AutoConfig.for_model("kimi_linear", vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=4, intermediate_size=96, kv_lora_rank=16, qk_nope_head_dim=8,
                                qk_rope_head_dim=8, v_head_dim=16, layer_types=["full_attention"] * 2,
                                mlp_layer_types=["dense"] * 2, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def deepseek_config(v_head_dim=16):
    config = arch_config("deepseek_v3")
    config.v_head_dim = v_head_dim
    return config


MODELS = {"deepseek_v3": deepseek_config, "kimi_linear": kimi_config}


@pytest.fixture(scope="module")
def teachers():
    """name -> (eager model, captured graph), built once for this module."""
    out = {}
    for name, make in MODELS.items():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(make()).float().eval()
        out[name] = (model, surgery.capture(model))
    return out


@pytest.mark.parametrize("name", MODELS)
def test_mla_teachers_capture_and_the_graph_equals_eager(name, teachers):
    model, graph = teachers[name]
    for shape in [(1, 7), (3, 23)]:
        ids = torch.randint(0, 128, shape, generator=torch.Generator().manual_seed(shape[1]))
        with torch.no_grad():
            diff = (graph.logits(ids) - model(input_ids=ids).logits).abs().max().item()
        assert diff <= 1e-5, f"{name} {shape}: {diff:.3g}"
    assert not any(n.target is torch.ops.aten.new_empty.default for n in graph.gm.graph.nodes)
    assert len(graph.sites) == 2
    for site in graph.sites:
        assert (site.num_heads, site.num_kv_heads, site.head_dim, site.v_head_dim, site.hidden_size) == (4, 4, 16, 0, 64)
        assert site.rope == (name == "deepseek_v3") and not site.q_norm and not site.k_norm
        assert len(site.k.more) == 1 and not site.v.more  # K: the per-head latent part and the shared key
        assert site.v.via["weight"] == site.k.weight       # V's latent comes from the projection of K's shared key
        assert (site.q.via is not None) == (name == "deepseek_v3")  # Kimi's q_proj reads the layer input


def hooked(model, layer: int, ids):
    """The eager attention's projection inputs and outputs at `layer` (forward hooks)."""
    attn, seen, hooks = model.model.layers[layer].self_attn, {}, []
    for part in ("q_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"):
        module = getattr(attn, part, None)
        if module is not None:
            hooks.append(module.register_forward_hook(lambda m, i, o, part=part: seen.update({part: (i[0], o)})))
    with torch.no_grad():
        model(input_ids=ids)
    for h in hooks:
        h.remove()
    return seen


@pytest.mark.parametrize("name", MODELS)
def test_folded_maps_against_the_eager_projections(name, teachers):
    """V (through kv_a -> norm -> kv_b) is the teacher's up to one positive factor per token; the shared
    key rows of K are kv_a's rows exactly; Kimi's Q (no low rank) is exact."""
    model, graph = teachers[name]
    params = dict(graph.gm.named_parameters())
    ids = torch.randint(3, 128, (2, 30), generator=torch.Generator().manual_seed(5))  # not the zero padding embedding
    for site in graph.sites:
        seen = hooked(model, site.layer, ids)
        x = seen["kv_a_proj_with_mqa"][0]
        with torch.no_grad():
            v = (x @ site.v.out_matrix(params)[0].T).unflatten(-1, (4, 16))
            want = seen["kv_b_proj"][1].reshape(*x.shape[:2], 4, 24)[..., 8:]  # [B, 1, T, 96] viewed per head
            cos = F.cosine_similarity(v.flatten(2), want.flatten(2), dim=-1)
            assert cos.min() > 1 - 1e-5, f"{name} layer {site.layer}: values not the teacher's up to a factor per token"
            assert ((v.flatten(2).norm(dim=-1) / want.flatten(2).norm(dim=-1)) > 0).all()
            k = site.k.out_matrix(params)[0].unflatten(0, (4, 16))
            shared = params[site.k.weight][16:]                               # kv_a's rows after the 16 latent ones
            for h in range(4):
                assert torch.cdist(k[h, 8:], shared).min(dim=1).values.max() == 0, f"{name}: head {h}'s shared key rows"
            if name == "kimi_linear":
                q = x @ site.q.out_matrix(params)[0].T
                teacher_q = seen["q_proj"][1]
                rows = torch.tensor(site.q.rows())
                torch.testing.assert_close(q, teacher_q[..., rows], rtol=0, atol=0)


def test_low_rank_fold_equals_the_composition():
    """w (scale * (A[rows] x + a[rows])) + b, applied step by step, equals the folded map."""
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(6, 3, generator=g, dtype=torch.float64), torch.randn(6, generator=g, dtype=torch.float64)
    params = {"a": torch.randn(5, 4, generator=g, dtype=torch.float64), "ab": torch.randn(5, generator=g, dtype=torch.float64)}
    via = {"weight": "a", "bias": "ab", "transposed": False, "rows": [4, 0, 2], "scale": [0.5, -2.0, 3.0]}
    x = torch.randn(7, 4, generator=g, dtype=torch.float64)
    latent = (x @ params["a"].T + params["ab"])[:, [4, 0, 2]] * torch.tensor(via["scale"], dtype=torch.float64)
    folded_w, folded_b = through_low_rank(params, w, b, via)
    torch.testing.assert_close(x @ folded_w.T + folded_b, latent @ w.T + b, rtol=1e-12, atol=1e-12)


class SliceFill(torch.nn.Module):
    """A buffer filled slice by slice (MLA's key), and one read (its written half) before it is complete."""

    def forward(self, a, b):
        key = a.new_empty(*a.shape[:-1], a.shape[-1] + b.shape[-1])
        key[..., : a.shape[-1]].copy_(a)
        key[..., a.shape[-1]:].copy_(b * 2)
        partial = a.new_empty(*a.shape[:-1], 2 * a.shape[-1])
        partial[..., : a.shape[-1]].copy_(a)
        early = partial[..., : a.shape[-1]].sum()
        partial[..., a.shape[-1]:].copy_(a)
        return key + 1, partial * early


def test_slice_fills_become_a_cat_and_compute_the_same():
    a, b = torch.randn(2, 3, 4), torch.randn(2, 3, 5)
    gm = torch.export.export(SliceFill(), (a, b)).module()
    want = gm(a, b)
    assert fold_slice_fills(gm) == 1  # the buffer read before it is complete is left alone
    got = gm(a, b)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    targets = [n.target for n in gm.graph.nodes]
    assert targets.count(torch.ops.aten.new_empty.default) == 1 and torch.ops.aten.cat.default in targets


@pytest.mark.parametrize("make", [kimi_config, lambda: deepseek_config(v_head_dim=8)], ids=["kimi_linear", "deepseek_v3_narrow_values"])
def test_a_hybrid_of_an_mla_teacher_converts_decodes_and_round_trips(make):
    """select keep 50%, replace, calibrate, align; decoding incrementally equals full recomputation;
    save -> load -> generate -> export exact. DeepSeek-V3's values narrower than its queries and keys
    (8 < 16, as 128 < 192 in the real model): the GDN heads are zero-padded to 16."""
    torch.manual_seed(0)
    graph = surgery.capture(AutoModelForCausalLM.from_config(make()).float().eval())
    graph.tokenizer = BytesTokenizer(128)
    PassManager(PIPELINE, CONFIGS)(graph)
    layer = graph.meta["replace"]["layers"][0]
    assert graph.gdn_modules()[layer].head_dim == 16
    ids = probe_ids(128)
    with torch.no_grad():
        assert torch.isfinite(graph.logits(ids)).all()
    result = SweepResult("mla")
    decode(result, graph, ids)
    assert result.decodes == "exact", result.why
    assert round_trip(graph, ids) == ("exact", "")


def test_a_head_split_of_narrow_values_is_refused_by_name():
    torch.manual_seed(0)
    graph = surgery.capture(AutoModelForCausalLM.from_config(deepseek_config(v_head_dim=8)).float().eval())
    with pytest.raises(PassConfigError, match="values and queries differ in width per head"):
        PassManager(["select", "replace"], {"select": {"granularity": "head", "policy": "keep", "heads": {0: [0]}}})(graph)


def test_kept_mla_is_refused_by_the_qwen3_5_export_naming_it(tmp_path):
    from surgery.errors import ExportError
    from surgery.io.export import export

    torch.manual_seed(0)
    graph = surgery.capture(AutoModelForCausalLM.from_config(deepseek_config()).eval())
    PassManager(["select", "replace"], {"select": {"policy": "convert", "layers": [1]}})(graph)
    with pytest.raises(ExportError, match=r"layer 0: the attention is MLA \(Q/K/V through a low-rank latent\)"):
        export(graph, tmp_path / "out", format="qwen3_5")
    assert not (tmp_path / "out").exists()
