"""The pass protocol (registry, configs, ordering), select's policies, replace over every tiny
architecture (weight transfer checked against hand-sliced teacher weights), and surgery.diff."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import surgery
from archs import ARCHS
from surgery import PassManager
from surgery.errors import CalibrationError, PassConfigError, PassFailedError, PassOrderError, SurgeryError
from surgery.core.pipeline import REGISTRY
from surgery.passes.select import SelectConfig, uniform_keep
from surgery.passes.selection import LayerSelection

PASSES = ["align", "calibrate", "replace", "select"]


def convert(graph, layers, **replace):
    configs = {"select": {"policy": "convert", "layers": list(layers)}}
    if replace:
        configs["replace"] = replace
    return PassManager(["select", "replace"], configs)(graph)


def ids_for(shape, vocab, seed=0):
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------------
# registry and configs


def test_registry_knows_the_four_passes():
    assert surgery.known_passes() == PASSES
    for name in PASSES:
        p = surgery.get_pass(name)
        assert p.name == name and isinstance(p, REGISTRY[name])
    assert REGISTRY["select"].structural and REGISTRY["replace"].structural
    assert not REGISTRY["calibrate"].structural and not REGISTRY["align"].structural


def test_unknown_pass_lists_known_ones():
    with pytest.raises(PassConfigError) as info:
        surgery.get_pass("quantize")
    assert "quantize" in info.value.problem
    assert all(name in info.value.fix for name in PASSES)
    with pytest.raises(PassConfigError):
        PassManager(["select", "nope"])


@pytest.mark.parametrize("name", PASSES)
def test_default_config_round_trips_through_json(name):
    cls = REGISTRY[name].config_cls
    config = cls.from_dict({})
    again = cls.from_dict(json.loads(json.dumps(config.to_dict())))
    assert again == config
    assert set(config.to_dict()) == {f.name for f in dataclasses.fields(cls)}


def test_select_config_round_trip_and_cli_spellings():
    config = SelectConfig.from_dict({"policy": "convert", "layers": "3,1"})  # --set select.layers=3,1
    assert config.layers == [3, 1]
    assert SelectConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    assert SelectConfig.from_dict({"keep_ratio": "0.25"}).keep_ratio == 0.25
    assert SelectConfig.from_dict({"stride": "4"}).stride == 4
    assert REGISTRY["align"].config_cls.from_dict({"progress": "false", "steps": "7"}).progress is False


@pytest.mark.parametrize("bad", [
    {"policy": "random"},
    {"keep_ratio": 1.0},
    {"keep_ratio": -0.1},
    {"stride": 0},
    {"policy": "keep"},
    {"policy": "convert", "layers": []},
    {"layers": "a,b", "policy": "convert"},
    {"keep_ratio": "half"},
])
def test_select_rejects_bad_configs(bad):
    with pytest.raises(PassConfigError):
        SelectConfig.from_dict(bad)


def test_unknown_option_is_a_config_error_naming_known_options():
    with pytest.raises(PassConfigError) as info:
        surgery.get_pass("select", {"keep_ration": 0.5})
    assert "keep_ration" in info.value.problem and "keep_ratio" in info.value.fix
    with pytest.raises(PassConfigError):
        PassManager(["select", "replace"], {"replace": {"v_activation": "gelu"}})
    with pytest.raises(PassConfigError):
        PassManager(["select", "replace"], {"align": {"steps": 3}})  # options for a pass not in the pipeline
    with pytest.raises(PassConfigError):
        surgery.get_pass("align", {"steps": 0})
    with pytest.raises(PassConfigError):
        surgery.get_pass("calibrate", {"gate": "sigmoid"})


# ------------------------------------------------------------------------------------------------
# select


def test_uniform_keep_seven_of_twenty_eight():
    assert uniform_keep(28, 0.25, None) == [0, 4, 8, 12, 16, 20, 24]
    assert uniform_keep(28, None, 4) == [0, 4, 8, 12, 16, 20, 24]
    assert uniform_keep(10, None, 3) == [0, 3, 6, 9]
    assert uniform_keep(10, 0.5, None) == [0, 2, 4, 6, 8]
    assert uniform_keep(6, 0.0, None) == []


def _decide(num_layers, **config):
    return surgery.get_pass("select", config).decide(num_layers)


def test_select_policies_decide_the_converted_layers():
    assert _decide(28, keep_ratio=0.25) == [i for i in range(28) if i % 4]
    assert _decide(12, stride=3) == [1, 2, 4, 5, 7, 8, 10, 11]
    assert _decide(5, policy="keep", layers=[0, 2]) == [1, 3, 4]
    assert _decide(5, policy="convert", layers=[3, 1, 3]) == [1, 3]
    assert _decide(4, keep_ratio=0.0) == [0, 1, 2, 3]


def test_select_on_a_graph_records_its_decision(stories):
    g = stories()
    result = PassManager(["select"], {"select": {"policy": "keep", "layers": [0, 4]}})(g)
    assert g.meta["select"] == LayerSelection("keep", convert=[1, 2, 3], keep=[0, 4])
    assert result.info["select"] == {"policy": "keep", "convert": [1, 2, 3], "keep": [0, 4]}  # what the recipe writes
    assert result.modified is False and g.history[-1]["pass"] == "select"
    assert g.layer_kinds == ["attention"] * 5  # nothing replaced yet


def test_replace_reads_only_a_typed_selection(stories):
    g = stories()
    g.meta["select"] = {"policy": "convert", "convert": [1], "keep": [0, 2, 3, 4]}  # a dict is not a decision
    with pytest.raises(PassConfigError, match="LayerSelection"):
        surgery.get_pass("replace")(g)
    assert g.teacher is None and "replace" not in g.meta


@pytest.mark.parametrize("config", [{"policy": "convert", "layers": [5]}, {"policy": "keep", "layers": [0, -1]}])
def test_select_out_of_range_layer(stories, config):
    g = stories()
    with pytest.raises(PassConfigError) as info:
        PassManager(["select"], {"select": config})(g)
    assert "5 attention layers" in str(info.value)
    assert g.history == [] and "select" not in g.meta


@pytest.mark.parametrize("config", [{"keep_ratio": 0.95}, {"policy": "keep", "layers": [0, 1, 2, 3, 4]}, {"stride": 1}])
def test_select_converting_nothing_is_refused(stories, config):
    g = stories()
    with pytest.raises(PassConfigError) as info:
        PassManager(["select", "replace"], {"select": config})(g)
    assert "converts no layer" in str(info.value)
    assert g.history == [] and g.teacher is None


# ------------------------------------------------------------------------------------------------
# ordering


@pytest.mark.parametrize("order", [
    ["replace"],
    ["calibrate"],
    ["align"],
    ["select", "calibrate", "replace"],
    ["select", "replace", "align", "calibrate"],
    ["select", "replace", "calibrate", "calibrate"],
    ["select", "replace", "align", "align"],
    ["select", "replace", "select"],
    ["select", "replace", "replace"],
])
def test_bad_orders_are_refused_before_anything_runs(stories, order):
    with pytest.raises(PassOrderError) as info:
        PassManager(order).validate()
    assert ",".join(order) in info.value.problem
    g = stories()
    gm = g.gm
    with pytest.raises(PassOrderError):
        PassManager(order)(g)
    assert g.history == [] and g.gm is gm and "select" not in g.meta


@pytest.mark.parametrize("order, twice", [(["select", "replace", "replace"], "replace"),
                                          (["select", "replace", "calibrate", "calibrate"], "calibrate")])
def test_a_pass_given_twice_is_named_as_such(order, twice):
    with pytest.raises(PassOrderError) as info:
        PassManager(order).validate()
    assert f"Pass '{twice}' appears twice" in info.value.problem and "cannot run twice" in info.value.problem
    assert f"before {twice}" not in info.value.fix


def test_pass_declarations_are_ordering_names():
    assert REGISTRY["replace"].runs_after == ("select",) and REGISTRY["calibrate"].not_after == ("align", "calibrate")
    assert not hasattr(REGISTRY["replace"], "requires") and not hasattr(REGISTRY["replace"], "forbids")


def test_order_is_checked_against_the_graph_history(stories):
    g = stories()
    convert(g, [1])
    PassManager(["calibrate"], {"calibrate": {"samples": 1, "length": 32}})(g)  # replace already ran
    PassManager(["align"], {"align": {"steps": 1, "samples": 1, "length": 32, "progress": False}})(g)
    with pytest.raises(PassOrderError) as info:
        PassManager(["calibrate"])(g)  # calibrate after align would undo it
    assert "align" in info.value.problem and "already run on this graph" in info.value.problem
    with pytest.raises(PassOrderError):
        PassManager(["select"])(g)
    assert [h["pass"] for h in g.history] == ["select", "replace", "calibrate", "align"]


def test_failing_pass_names_itself_and_what_ran_before(stories, tmp_path):
    g = stories()
    with pytest.raises(SurgeryError) as info:
        PassManager(["select", "replace"], {"select": {"policy": "convert", "layers": [9]}})(g)
    assert "Pass 'select' failed (after: nothing)" in info.value.problem
    convert(g, [1])
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(CalibrationError) as info:
        PassManager(["calibrate"], {"calibrate": {"calibration": [str(empty)]}})(g)
    # select and replace ran before (in an earlier PassManager call): the message must not say "nothing"
    assert "Pass 'calibrate' failed (after: select, replace)" in info.value.problem, info.value.problem


# ------------------------------------------------------------------------------------------------
# replace over every tiny architecture


@pytest.mark.parametrize("name", list(ARCHS))
def test_replace_every_arch(name, tiny, record, gdn_at):
    t = tiny(name)
    sites = t.require_sites()
    g = t.graph.branch()
    PassManager(["select", "replace"], {"select": {"keep_ratio": 0.5}})(g)
    converted = g.meta["replace"]["layers"]
    assert 0 not in converted and converted, f"{name}: converted {converted}"
    assert g.layer_kinds == ["gdn" if i in converted else "attention" for i in range(len(sites))]
    assert g.teacher is t.graph.gm and g.gm is not t.graph.gm
    vocab = t.model.config.vocab_size
    for shape in [(1, 9), (2, 21)]:
        ids = ids_for(shape, vocab, seed=shape[1])
        with torch.no_grad():
            logits = g(ids)
        assert logits.shape == (*shape, vocab) and torch.isfinite(logits).all(), f"{name} {shape}"

    # the teacher is untouched, and the kept layer 0 (before any converted layer) is bit-identical
    ids = ids_for((2, 13), vocab, seed=1)
    with torch.no_grad():
        torch.testing.assert_close(t.graph.teacher_gm(input_ids=ids, **t.graph.teacher_gm.meta['extra_inputs']).logits,
                                   t.model(input_ids=ids).logits, atol=1e-5, rtol=0)
    s0 = sites[0]
    first = converted[0]
    teacher_vals = record(g.teacher, ids, [s0.output_node])
    call = next(n.name for n in g.gm.graph.nodes if n.op == "call_module" and n.target == g.meta["replace"]["modules"][str(first)]["target"])
    hybrid_vals = record(g.gm, ids, [s0.output_node, sites[first].input_node, call])
    assert torch.equal(teacher_vals[s0.output_node], hybrid_vals[s0.output_node]), f"{name}: kept layer 0 changed"
    # the GDN is called on the replaced layer's input
    with torch.no_grad():
        want = gdn_at(g, first)(hybrid_vals[sites[first].input_node])
    torch.testing.assert_close(hybrid_vals[call], want, atol=1e-6, rtol=0)
    # the attention it replaced is gone from the hybrid, still there in the teacher
    hybrid_nodes = {n.name for n in g.gm.graph.nodes}
    assert sites[first].attn_node not in hybrid_nodes
    assert sites[0].attn_node in hybrid_nodes


# ------------------------------------------------------------------------------------------------
# what replace promises (ensures), checked after it runs


def test_replace_that_leaves_the_attention_in_place_is_caught(stories, monkeypatch):
    import surgery.passes.replace as replace_module

    monkeypatch.setattr(replace_module, "prune", lambda gm: 0)  # the old region stays in the graph
    g = stories()
    with pytest.raises(PassFailedError) as info:
        convert(g, [1, 3])
    problem = info.value.problem
    assert "Pass 'replace'" in problem and "did not keep its promise" in problem and "layer 1" in problem
    assert g.sites[1].attn_node in problem


def test_replace_that_splices_no_gdn_is_caught(stories, monkeypatch):
    from surgery.passes.replace import Replace

    monkeypatch.setattr(Replace, "_splice", staticmethod(lambda gm, site, target, gdn: None))
    with pytest.raises(PassFailedError, match="is not a GatedDeltaNet call"):
        convert(stories(), [2])


def test_replace_copies_exactly_the_gdn_copied_parameters(stories, monkeypatch):
    import surgery.passes.replace as replace_module

    made = replace_module.gdn_for_site

    def with_o_bias(site, config):  # a GDN with an output bias the teacher has no value for
        gdn = made(site, config)
        gdn.o_proj = torch.nn.Linear(gdn.o_proj.in_features, gdn.o_proj.out_features, bias=True)
        return gdn

    monkeypatch.setattr(replace_module, "gdn_for_site", with_o_bias)
    g = stories()
    with pytest.raises(PassFailedError, match="o_proj.bias"):
        convert(g, [1])
    assert g.teacher is None and "replace" not in g.meta  # refused before the graph changed


# ------------------------------------------------------------------------------------------------
# weight transfer, against the teacher's weights sliced by hand


def _w(linear, conv1d=False):
    """(weight [out, in], bias) of an nn.Linear, or of GPT-2's Conv1D (stored [in, out])."""
    w = linear.weight.detach()
    return (w.t() if conv1d else w), (linear.bias.detach() if getattr(linear, "bias", None) is not None else None)


def _rows(t, rows):
    return None if t is None else t[rows]


def teacher_projections(name, model, layer):
    """(q, k, v, o) as (weight, bias) per head layout: q/k/v weight [heads*D, in] with k/v holding the
    KV heads; o weight [hidden, heads*D]. Written from each architecture's modeling code."""
    D = 16
    if name in ("llama", "qwen2", "qwen2_moe", "mistral", "starcoder2", "smollm3", "granite", "stablelm", "stories"):
        a = model.model.layers[layer].self_attn
        return _w(a.q_proj), _w(a.k_proj), _w(a.v_proj), _w(a.o_proj)
    if name == "phi3":  # qkv_proj out = [q 64 | k 32 | v 32]
        a = model.model.layers[layer].self_attn
        w, _ = _w(a.qkv_proj)
        return (w[:64], None), (w[64:96], None), (w[96:], None), _w(a.o_proj)
    if name == "gpt2":  # Conv1D c_attn [in, 3*hidden]
        a = model.transformer.h[layer].attn
        w, b = _w(a.c_attn, conv1d=True)
        return (w[:64], b[:64]), (w[64:128], b[64:128]), (w[128:], b[128:]), _w(a.c_proj, conv1d=True)
    if name in ("gpt_neox", "persimmon"):  # per head [q | k | v]
        a = model.gpt_neox.layers[layer].attention if name == "gpt_neox" else model.model.layers[layer].self_attn
        w, b = _w(a.query_key_value)
        rows = lambda part: [h * 3 * D + part * D + d for h in range(4) for d in range(D)]  # noqa: E731
        return tuple((w[rows(p)], _rows(b, rows(p))) for p in range(3)) + (_w(a.dense),)
    if name == "falcon":  # MQA: [q heads 64 | k 16 | v 16]
        a = model.transformer.h[layer].self_attention
        w, _ = _w(a.query_key_value)
        return (w[:64], None), (w[64:80], None), (w[80:96], None), _w(a.dense)
    if name == "falcon_new":  # per KV group [q q | k | v]
        a = model.transformer.h[layer].self_attention
        w, _ = _w(a.query_key_value)
        q = [g * 64 + j * D + d for g in range(2) for j in range(2) for d in range(D)]
        k = [g * 64 + 32 + d for g in range(2) for d in range(D)]
        v = [g * 64 + 48 + d for g in range(2) for d in range(D)]
        return (w[q], None), (w[k], None), (w[v], None), _w(a.dense)
    if name == "codegen":  # mp_num=4 shards of [q | v | k], one head per shard
        a = model.transformer.h[layer].attn
        w, _ = _w(a.qkv_proj)
        rows = lambda part: [h * 3 * D + part * D + d for h in range(4) for d in range(D)]  # noqa: E731
        return (w[rows(0)], None), (w[rows(2)], None), (w[rows(1)], None), _w(a.out_proj)
    if name == "gpt_bigcode":  # MQA Linear c_attn: [q 64 | k 16 | v 16]
        a = model.transformer.h[layer].attn
        w, b = _w(a.c_attn)
        return (w[:64], b[:64]), (w[64:80], b[64:80]), (w[80:], b[80:]), _w(a.c_proj)
    raise KeyError(name)


WEIGHT_ARCHS = ["llama", "qwen2", "starcoder2", "phi3", "gpt2", "gpt_neox", "persimmon", "falcon", "falcon_new",
                "codegen", "gpt_bigcode"]


def _check_transfer(name, model, graph, layer, gdn_at, heads=4, kv_heads=None):
    (wq, bq), (wk, bk), (wv, bv), (wo, bo) = teacher_projections(name, model, layer)
    D = wq.shape[0] // heads
    kv_heads = kv_heads or wk.shape[0] // D
    group = heads // kv_heads
    expand = [kv * D + d for h in range(heads) for kv in [h // group] for d in range(D)]  # repeat_kv
    gdn = gdn_at(graph, layer)
    got = {n: p.detach() for n, p in gdn.named_parameters()}
    want = {"q_proj.weight": wq, "k_proj.weight": wk[expand], "v_proj.weight": wv[expand], "o_proj.weight": wo,
            "q_proj.bias": bq, "k_proj.bias": _rows(bk, expand), "v_proj.bias": _rows(bv, expand), "o_proj.bias": bo}
    for key, value in want.items():
        if value is None:
            assert key not in got, f"{name}: GDN has {key} but the teacher has no such bias"
        else:
            assert key in got, f"{name}: teacher bias dropped: GDN has no {key}"
            assert torch.equal(got[key], value), f"{name}: GDN {key} differs from the teacher's rows"


@pytest.mark.parametrize("name", WEIGHT_ARCHS)
def test_weight_transfer_matches_hand_sliced_teacher(name, tiny, gdn_at):
    t = tiny(name)
    t.require_sites()
    g = t.graph.branch()
    convert(g, [1])
    _check_transfer(name, t.model, g, 1, gdn_at)
    assert g.meta["replace"]["copies"], "replace logs its copies"


def test_weight_transfer_stories_gqa(stories, stories_eager, gdn_at):
    g = stories()
    convert(g, [1, 3])
    for layer in (1, 3):
        _check_transfer("stories", stories_eager, g, layer, gdn_at, heads=8, kv_heads=4)
    gdn = gdn_at(g, 3)
    k = gdn.k_proj.weight.detach().view(8, 8, 64)
    assert torch.equal(k[0], k[1]) and torch.equal(k[6], k[7]) and not torch.equal(k[1], k[2])


def test_replace_keeps_fla_defaults_for_new_parameters_and_is_seeded(stories, gdn_at):
    a, b, c = stories(), stories(), stories()
    convert(a, [2])
    convert(b, [2])
    convert(c, [2], seed=1)
    ga, gb, gc = gdn_at(a, 2), gdn_at(b, 2), gdn_at(c, 2)
    for name in ("A_log", "dt_bias", "a_proj.weight", "b_proj.weight", "g_proj.weight"):
        pa, pb, pc = (dict(x.named_parameters())[name] for x in (ga, gb, gc))
        assert torch.equal(pa, pb), f"{name} not reproducible under the same seed"
        assert not torch.equal(pa, pc), f"{name} ignores the seed"
    # fla's decay init: A ~ U(0, 16), dt in [1e-3, 0.1] through softplus^-1
    assert (ga.A_log.exp() <= 16).all()
    dt = torch.nn.functional.softplus(ga.dt_bias)
    assert ((dt > 9e-4) & (dt < 0.11)).all()
    assert torch.equal(ga.o_norm.weight, torch.ones(8))


def test_replace_config_reaches_the_gdn(stories, gdn_at):
    g = stories()
    convert(g, [0], use_short_conv=True, conv_size=3, v_activation="identity")
    gdn = gdn_at(g, 0)
    assert gdn.use_short_conv and gdn.q_conv1d.weight.shape == (64, 1, 3) and gdn.v_activation == "identity"
    assert g.meta["replace"]["modules"]["0"]["gdn_config"]["conv_size"] == 3


# ------------------------------------------------------------------------------------------------
# diff


def test_diff_of_select_replace_lists_converted_layers_only(stories):
    teacher = stories()
    hybrid = stories()
    convert(hybrid, [1, 3])
    result = surgery.diff(teacher, hybrid)
    json.dumps(result)  # JSON-ready
    by_layer = {e["layer"]: e for e in result["layers"]}
    assert sorted(k for k in by_layer if isinstance(k, int)) == [1, 3]
    for layer in (1, 3):
        e = by_layer[layer]
        assert (e["before"], e["after"]) == ("attention", "gdn")
        assert e["nodes_removed"].get("scaled_dot_product_attention") == 1
        assert e["nodes_added"] == {"module:GatedDeltaNet": 1}
        added = {p["name"] for p in e["params_added"]}
        prefix = f"model.layers.{layer}.self_attn."
        assert {prefix + "A_log", prefix + "dt_bias", prefix + "b_proj.weight", prefix + "g_proj.weight"} <= added
        # the GDN sits at the attention's own path: q/o keep their names and values, k/v are GQA-expanded
        changed = {p["name"]: (p["what"], p["shape"]) for p in e["params_changed"]}
        assert changed == {prefix + "k_proj.weight": ("shape", [[32, 64], [64, 64]]),
                           prefix + "v_proj.weight": ("shape", [[32, 64], [64, 64]])}
        assert e["params_removed"] == []
        assert "attention -> gdn" in e["summary"]
    assert {0, 2, 4} <= set(result["unchanged_layers"])
    assert result["copies"] == hybrid.meta["replace"]["copies"]
    outside = [e for e in result["layers"] if not isinstance(e["layer"], int)]
    for e in outside:
        assert not e["params_added"] and not e["params_removed"] and not e["params_changed"], e["summary"]


def test_diff_of_a_graph_with_itself_is_empty(stories):
    g = stories()
    result = surgery.diff(g, stories())
    assert result["layers"] == [] and result["unchanged_layers"][:5] == [0, 1, 2, 3, 4]


def test_diff_does_not_report_a_tied_embedding_as_removed(tiny):
    """GPT-2 ties lm_head to wte: the hybrid still has the embedding, so the diff outside the decoder
    layers must not list it as a removed parameter."""
    t = tiny("gpt2")
    t.require_sites()
    g = t.graph.branch()
    convert(g, [1])
    result = surgery.diff(t.graph, g)
    assert [e["layer"] for e in result["layers"] if isinstance(e["layer"], int)] == [1]
    removed_outside = [p["name"] for e in result["layers"] if not isinstance(e["layer"], int) for p in e["params_removed"]]
    assert removed_outside == [], f"diff reports {removed_outside} removed, but the tied embedding is still used"
