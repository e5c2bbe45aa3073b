"""select.granularity=head: some KV heads of a layer (with their GQA query groups) stay softmax attention,
the others become one GDN, merged in the teacher's head order before the teacher's o_proj.

References: a float64 loop of causal softmax attention per head (the kept slice), the teacher's own
attention output at the kept heads (the spliced graph), full recomputation (decoding), the saved
weights (save/load), the teacher's statistics read independently with tcal.stats (head scores), the
bytes of K and V per kept KV head (the cache)."""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import json

import pytest
import torch

import surgery
from surgery import DistillConfig, PassManager
from surgery.decode import Decoder
from surgery.errors import CheckpointError, ExportError, PassConfigError
from surgery.data.windows import calibration_ids
from surgery.eval.diff import diff
from surgery.cli.layer_table import layer_rows, title
from surgery.train.placement import Placement
from surgery.train.stages import Layers, stage_l2
from tcal.head_split import HeadSplitLayer, head_stats
from tcal.stats import AttentionStats

from sweep_check import BytesTokenizer
from test_mixer_swa import matches_full, naive_window_attention

GQA = ["llama", "qwen2", "mistral", "gemma2"]  # sdpa; biases; sliding windows; eager with softcap, windows on alternate layers
SMALL = {"samples": 2, "length": 32}
# stories260K: 5 layers of 8 query heads over 4 KV heads; layers 0, 2, 4 whole, 1 and 3 split
HEADS = {"0": [0, 1, 2, 3], "1": [0, 3], "2": [0, 1, 2, 3], "3": [1], "4": [0, 1, 2, 3]}


def split(graph, passes=(), **select):
    select = {"granularity": "head", "policy": "keep", "heads": HEADS} | select
    configs = {"select": select, "calibrate": SMALL, "align": SMALL | {"steps": 10, "progress": False}}
    PassManager(["select", "replace", *passes], {p: configs[p] for p in ["select", *passes]})(graph)
    return graph


def test_module_attends_within_the_kept_heads_and_merges_in_the_teachers_order():
    """8 query heads over 4 KV heads, KV heads 1 and 3 kept (query heads 2, 3, 6, 7): the kept slice is
    causal softmax attention of exactly those heads (float64 loop), the merge puts every head back."""
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 8, 9, 16, generator=g), torch.randn(2, 4, 9, 16, generator=g), torch.randn(2, 4, 9, 16, generator=g)
    attention = dict(num_heads=4, head_dim=16, window=1 << 20, scale=0.25)
    gdn = dict(hidden_size=32, num_heads=4, head_dim=16, v_activation="identity", backend="torch")
    layer = HeadSplitLayer(32, 8, 16, [2, 3, 6, 7], [1, 3], [1, 3], attention, gdn, layer_idx=0)
    assert layer.converted_heads == [0, 1, 4, 5] and layer.kept_kv_map == [0, 0, 1, 1]
    kept = layer.kept(layer.select_q(q), layer.select_k(k), layer.select_v(v))
    want = naive_window_attention(q, k, v, 1 << 20, 0.25)
    torch.testing.assert_close(kept.double(), want[:, [2, 3, 6, 7]], atol=1e-5, rtol=1e-5)
    converted = torch.randn(2, 9, 4 * 16, generator=g)
    merged = layer.merge(kept, converted)
    torch.testing.assert_close(merged[:, [2, 3, 6, 7]], kept)
    torch.testing.assert_close(merged[:, [0, 1, 4, 5]], converted.unflatten(-1, (4, 16)).transpose(1, 2))
    assert head_stats({"distance": torch.arange(8.0), "rows": torch.ones(8)}, [0, 5])["distance"].tolist() == [0.0, 5.0]
    with pytest.raises(ValueError, match="some but not all"):
        HeadSplitLayer(32, 8, 16, list(range(8)), [0, 1, 2, 3], [0, 1, 2, 3], attention | {"num_heads": 8}, gdn)


def test_stories_split_keeps_the_teachers_heads_decodes_exactly_and_caches_only_them(stories, stories_teacher, record):
    graph = split(stories())
    assert graph.layer_kinds == ["attention", "split", "attention", "split", "attention"]
    assert graph.meta["select"].split_layers() == {1: [0, 3], 3: [1]}
    ids = torch.randint(3, 512, (1, 19), generator=torch.Generator().manual_seed(0))
    # layer 1 reads the teacher's input (layer 0 is whole): its kept heads give the teacher's attention output there
    target = graph.gdn_targets()[1]
    merge = next(n.name for n in graph.gm.graph.nodes if n.op == "call_module" and n.target == f"{target}.merge")
    mine = record(graph.gm, ids, [merge])[merge]
    teacher = record(stories_teacher.gm, ids, [stories_teacher.sites[1].attn_node])[stories_teacher.sites[1].attn_node]
    kept_q = [0, 1, 6, 7]  # KV heads 0 and 3, two query heads each
    torch.testing.assert_close(mine[:, kept_q], teacher[:, kept_q], atol=1e-6, rtol=1e-6)
    assert (mine[:, [2, 3, 4, 5]] - teacher[:, [2, 3, 4, 5]]).abs().max() > 1e-3
    matches_full(graph, ids, 7)
    decoder = Decoder(graph).reset(1, 19)
    decoder.prefill(ids)
    assert {l: m.k_cache.shape[1] for l, m in decoder.attention.items()} == {0: 4, 1: 2, 2: 4, 3: 1, 4: 4}
    per_layer = decoder.cache_bytes(per_layer=True)
    kv = 2 * 19 * 8 * 4  # K and V, 19 positions of 8 dims, float32, per KV head
    assert per_layer[1] == 2 * kv + 4 * 8 * 8 * 4 and per_layer[3] == kv + 6 * 8 * 8 * 4  # + the GDN's state over 4 and 6 heads
    report = graph.meta["select"].kv_cache
    assert report["kv_bytes_per_layer"][1] * 2 == report["kv_bytes_per_layer"][0] == report["kv_bytes_per_layer"][3] * 4


@pytest.mark.parametrize("name", GQA)
def test_tiny_gqa_archs_split_align_and_round_trip(tiny, name, tmp_path):
    """Both layers split (KV head 1 of layer 0, KV head 0 of layer 1 kept), Phase 1 + 2 on the converted
    heads, exact incremental decoding (mistral: the kept heads keep the teacher's sliding window of 8
    at 13 tokens), save/load exact."""
    entry = tiny(name)
    entry.require_sites()
    graph = entry.graph.branch()
    graph.tokenizer = BytesTokenizer(128)
    split(graph, passes=("calibrate", "align"), heads={"0": [1], "1": [0]})
    assert graph.layer_kinds[:2] == ["split", "split"]
    windows = [graph.gdn_modules()[layer].kept.window.item() for layer in (0, 1)]
    assert windows == {"mistral": [8, 8], "gemma2": [8, graph.max_length]}.get(name, [graph.max_length] * 2)
    for layer, report in graph.meta["calibrate"]["layers"].items():
        assert report["rel_error_after"] < report["rel_error_before"]
        assert len(report["distance"]) == (2 if layer < 2 else 4)  # a split layer's 2 converted query heads (gemma2's layer 2: whole)
    for report in graph.meta["align"]["layers"].values():
        assert report["best"] < report["initial"]
    ids = torch.randint(3, 128, (1, 13), generator=torch.Generator().manual_seed(1))
    matches_full(graph, ids, 5)
    graph.tokenizer = None  # BytesTokenizer is the test's, not the model's
    surgery.save(graph, tmp_path / "h")
    loaded = surgery.load(tmp_path / "h")
    assert loaded.layer_kinds == graph.layer_kinds and loaded.meta["select"].split_layers() == {0: [1], 1: [0]}
    assert torch.equal(loaded.logits(ids), graph.logits(ids))
    matches_full(loaded, ids, 5)


@pytest.mark.parametrize("policy", ["distance", "entropy", "output"])
def test_head_scores_are_the_teachers_statistics_per_kv_group_and_the_best_are_kept(stories, stories_teacher, stories_eager, record, policy):
    """Each KV head's score is its query group's mean statistic, read here from the teacher's own Q
    and K with tcal.stats (distance, entropy), or from its attention output and the eager model's
    o_proj weight (output: the mean squared norm of each head's share of the layer output); the
    keep_count best-scoring KV heads are the ones kept."""
    graph = stories()
    split(graph, policy=policy, keep_count=6, heads=None, samples=2, length=64)
    s = graph.meta["select"]
    rows = {(r["layer"], r["kv_head"]): r["score"] for r in s.scores}
    kept = {(l, h) for l in range(5) for h in ([0, 1, 2, 3] if l in s.keep else s.split_layers().get(l, []))}
    assert len(kept) == 6 and min(rows[x] for x in kept) >= max(rows[x] for x in rows if x not in kept)
    ids = calibration_ids(stories_teacher, None, 2, 64, 0)
    site = stories_teacher.sites[2]
    values = record(stories_teacher.gm, ids, [site.q_node, site.k_node, site.attn_node])
    if policy == "output":
        w = stories_eager.model.layers[2].self_attn.o_proj.weight.detach().double()   # [hidden, H * D]
        ctx = values[site.attn_node].double()                                         # [B, H, T, D]
        statistic = [float((ctx[:, h] @ w[:, h * 8:(h + 1) * 8].T).pow(2).sum(-1).mean()) for h in range(8)]
    else:
        stats = AttentionStats(site.num_heads)
        stats.update_from_qk(values[site.q_node], values[site.k_node], scale=site.scale)
        statistic = stats.result()[policy].tolist()
    scores = {r["kv_head"]: r["score"] for r in s.scores if r["layer"] == 2}
    for j in range(site.num_kv_heads):
        group = [statistic[h] for h in range(site.num_heads) if site.kv_map[h] == j]
        assert scores[j] == pytest.approx(float(sum(group) / len(group)), rel=1e-5)


def test_a_byte_budget_below_one_global_head_keeps_exactly_the_window_layers(tiny):
    """gemma3: layers 0 and 2 slide over 8 positions, layer 1 is global. At 32k tokens (float32) a
    window layer's 2 KV heads cost 2 * 2 * 16 * 8 * 4 bytes + 8 int64 ring positions, a global
    head 2 * 16 * 32768 * 4 = 4 MiB: a budget of 10 kB keeps both window layers whole and nothing else."""
    entry = tiny("gemma3")
    entry.require_sites()
    graph = entry.graph.branch()
    graph.tokenizer = BytesTokenizer(128)
    split(graph, heads=None, policy="distance", kv_bytes=10_000, samples=2, length=32)
    s = graph.meta["select"]
    assert (s.keep, s.convert, s.split_layers()) == ([0, 2], [1], {})
    assert s.kv_cache["kv_bytes"] == 2 * (2 * 2 * 16 * 8 * 4 + 8 * 8)


def test_inspect_and_diff_show_the_kept_heads(stories, stories_teacher):
    graph = split(stories())
    rows = layer_rows(graph)
    assert [r["kept_kv_heads"] for r in rows] == [[0, 1, 2, 3], [0, 3], [0, 1, 2, 3], [1], [0, 1, 2, 3]]
    assert [r["kv_bytes_per_token"] for r in rows] == [256, 128, 256, 64, 256]
    assert rows[1]["state_bytes"] == 4 * 8 * 8 * 4 and rows[3]["state_bytes"] == 6 * 8 * 8 * 4
    assert title(rows) == "5 layers: 3 softmax attention + 2 split by heads"
    assert "kept_kv_heads" not in layer_rows(stories_teacher)[0]
    changed = {e["layer"]: (e["before"], e["after"]) for e in diff(stories_teacher, graph)["layers"] if isinstance(e["layer"], int)}
    assert changed == {1: ("attention", "split"), 3: ("attention", "split")}


@pytest.mark.parametrize("select, words", [
    ({"policy": "ar"}, "Policy 'ar' does not choose heads"),
    ({"policy": "keep", "heads": None}, "needs select.heads"),
    ({"policy": "keep", "heads": {"9": [0]}}, "names layer 9; this model has 5"),
    ({"policy": "keep", "heads": {"1": [4]}}, "KV heads \\[4\\] of layer 1, which has 4"),
    ({"policy": "distance", "heads": None, "keep_count": 20}, "keeps 20 of the model's 20 KV heads"),
    ({"policy": "distance", "heads": None, "stride": 2}, "stride, layers, window"),
    ({"granularity": "layer", "policy": "uniform"}, "only select.granularity=head reads"),
    ({"granularity": "rows"}, "Unknown select.granularity 'rows'"),
    ({"policy": "keep", "kv_bytes": 100}, "select.kv_bytes=100 needs a scoring policy"),
    ({"granularity": "layer", "policy": "uniform", "heads": None, "kv_bytes": 100}, "only select.granularity=head reads"),
    ({"policy": "keep", "heads": {"1": ["a"]}}, "not a layer number to a list of KV head numbers"),
    ({"policy": "keep", "heads": "{1: [0]"}, "SelectConfig.heads = '\\{1: \\[0\\]' is not a valid"),
])
def test_bad_head_options_are_refused_before_any_work(stories, select, words):
    graph = stories()
    with pytest.raises(PassConfigError, match=words):
        split(graph, **select)
    assert "replace" not in graph.meta


def test_heads_take_the_clis_json_spelling():
    from surgery.passes.select import SelectConfig

    config = SelectConfig.from_dict({"granularity": "head", "policy": "keep", "heads": '{"1": [0, 2]}'})
    assert config.heads == {"1": [0, 2]}


def test_split_is_gdn_only_and_exports_refuse_it_by_name(stories, tmp_path):
    graph = stories()
    with pytest.raises(PassConfigError, match="replace.mixer=swa converts whole layers only"):
        PassManager(["select", "replace"], {"select": {"granularity": "head", "policy": "keep", "heads": HEADS}, "replace": {"mixer": "swa"}})(graph)
    graph = split(stories())
    for fmt in ("hf", "qwen3_5"):
        with pytest.raises(ExportError, match=f"--format {fmt} cannot hold a layer split by heads, and this hybrid keeps some heads of layer\\(s\\) 1, 3"):
            surgery.export(graph, tmp_path / fmt, format=fmt)
        assert not (tmp_path / fmt).exists()
    surgery.save(graph, tmp_path / "h")
    recipe = json.loads((tmp_path / "h" / "recipe.json").read_text())
    recipe["decisions"]["replace"]["modules"]["1"]["gdn_config"]["kept_heads"] = list(range(8))
    (tmp_path / "h" / "recipe.json").write_text(json.dumps(recipe))
    with pytest.raises(CheckpointError, match=r"decisions.replace.modules\['1'\].gdn_config.kept_heads = \[0, 1, .*is not some but not all"):
        surgery.load(tmp_path / "h")


def test_stage_l2_fits_a_splits_converted_heads_to_their_share_of_the_teachers_layer_output(stories, stories_teacher, record):
    """distill's per-layer stage on a head split: the GDN, fed the teacher's input at the site, against the
    converted heads' share of the teacher's attention output (their context through the teacher's o_proj
    columns of those heads), read here from the teacher's recorded nodes and weights; whole layers as before."""
    graph = split(stories())  # layers 1 and 3 split
    stage = stage_l2(graph, stories_teacher, Placement(), contextlib.nullcontext)
    assert isinstance(stage.module, Layers)
    ids = torch.randint(3, 512, (2, 21), generator=torch.Generator().manual_seed(3))
    sites = stories_teacher.sites
    seen = record(stories_teacher.gm, ids, [n for l in (1, 3) for n in (sites[l].input_node, sites[l].attn_node)])
    losses = []
    for layer in (1, 3):
        module, d = graph.gdn_modules()[layer], sites[layer].head_dim
        columns = torch.tensor([h * d + i for h in module.converted_heads for i in range(d)])
        w = stories_teacher.gm.get_parameter(sites[layer].o.weight).index_select(1, columns)
        context = seen[sites[layer].attn_node][:, module.converted_heads].transpose(1, 2).flatten(-2)
        with torch.no_grad():
            mine = module.gdn(seen[sites[layer].input_node]) @ w.T
        losses.append(torch.nn.functional.mse_loss(mine, context @ w.T))
    with torch.no_grad():
        got = stage.loss(ids)
    torch.testing.assert_close(got, torch.stack(losses).mean(), rtol=1e-5, atol=1e-7)
    assert got > 0


def test_distill_trains_a_split_hybrid_through_both_stages_and_it_reloads(stories, stories_teacher, tmp_path):
    """Both stages run on a head-split hybrid (with gradient checkpointing, which recomputes each split's
    GDN): stage l2 moves only the converted heads' GDN, the kept heads stay the teacher's attention, and the
    checkpoint reloads as the same split hybrid with the same logits."""
    graph = split(stories())
    graph = dataclasses.replace(graph, gm=copy.deepcopy(graph.gm))  # stage kl trains every weight: not the session teacher's
    before = {n: p.detach().clone() for n, p in graph.gm.named_parameters()}
    teacher = {n: p.detach().clone() for n, p in stories_teacher.gm.named_parameters()}
    text = tmp_path / "train.txt"
    text.write_text(" ".join(f"Once upon a time there was a cat number {i} who liked the sun." for i in range(200)))
    step = 4 * 32
    config = DistillConfig(tokens=4 * step, l2_tokens=2 * step, stage="both", seq_len=32, global_batch=4, warmup=0.0,
                           schedule="constant", lr_l2_new=3e-3, lr_l2_copied=3e-3, lr_kl_new=1e-3, lr_kl_copied=1e-3,
                           lr_kl_rest=1e-4, grad_checkpoint=True)
    result = surgery.distill(graph, [text], tmp_path / "run", config, teacher=stories_teacher, progress=False)
    log = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    stages = [r["stage"] for r in log if "loss" in r]
    assert stages == ["l2", "l2", "kl", "kl"] and all(r["loss"] > 0 for r in log if "loss" in r)
    moved = {n for n, p in graph.gm.named_parameters() if not torch.equal(p.detach(), before[n])}
    targets = graph.gdn_targets()
    assert any(n.startswith(f"{targets[1]}.gdn.") for n in moved) and any(n.startswith(f"{targets[3]}.gdn.") for n in moved)
    assert all(torch.equal(p, teacher[n]) for n, p in stories_teacher.gm.named_parameters())
    reloaded = surgery.load(result["checkpoint"])
    assert reloaded.layer_kinds == ["attention", "split", "attention", "split", "attention"]
    ids = torch.randint(3, 512, (1, 19), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(reloaded.logits(ids), graph.logits(ids), rtol=0, atol=0)
