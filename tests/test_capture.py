"""surgery.capture and attention-site discovery, checked against the eager transformers models.

Every architecture of archs.ARCHS is captured once per session (conftest.tiny). The checks use
independent references: the eager model's logits, the eager attention module's input and output
(forward hooks), the projection weights applied by hand, and the head layouts of archs.EXPECTED.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

import surgery
from archs import ARCHS, EXPECTED
from surgery.errors import CaptureError, ModelLoadError, NoAttentionError, SurgeryError

NAMES = list(ARCHS)
LENGTHS = [(1, 7), (2, 23)]  # neither is the capture shape (2, 16)

# q is multiplied by a constant between its projection and the attention op (OPT folds the softmax
# scale head_dim**-0.5 into q and calls SDPA with scale=1.0); 1.0 for every other architecture.
Q_FACTOR = {"opt": 0.25}


def ids_for(shape, vocab, seed=0):
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def per_layer(value, layer):
    return value[layer] if isinstance(value, list) else value


def assert_one_paragraph(exc: SurgeryError, *words):
    text = str(exc)
    assert text.strip() and "\n" not in text, f"error message is not one paragraph: {text!r}"
    assert "Traceback" not in text
    assert exc.problem, "SurgeryError without a problem statement"
    for w in words:
        assert w.lower() in text.lower(), f"{w!r} not in error message {text!r}"


# ------------------------------------------------------------------------------------------------
# capture == eager


@pytest.mark.parametrize("name", NAMES)
def test_capture_matches_eager_logits(name, tiny):
    t = tiny(name)
    graph = t.require_graph()
    vocab = t.model.config.vocab_size
    for shape in LENGTHS:
        ids = ids_for(shape, vocab, seed=shape[1])
        with torch.no_grad():
            want = t.model(input_ids=ids).logits
            got = graph(ids)
        assert got.shape == want.shape == (*shape, vocab)
        diff = (got - want).abs().max().item()
        assert diff <= 1e-5, f"{name} {shape}: captured logits differ from eager by {diff:.3g}"
    assert graph.meta["capture"]["dtype"] == "float32"
    assert graph.source["kind"] == "module"


# ------------------------------------------------------------------------------------------------
# what the site finder reports


@pytest.mark.parametrize("name", NAMES)
def test_sites_match_expected_geometry(name, tiny):
    sites = tiny(name).require_sites()
    exp = EXPECTED[name]
    assert len(sites) == exp["num_layers"], f"{name}: {len(sites)} sites, expected {exp['num_layers']}"
    for i, s in enumerate(sites):
        assert s.layer == i
        got = (s.num_heads, s.num_kv_heads, s.head_dim)
        want = (exp["heads"], per_layer(exp["kv_heads"], i), exp["head_dim"])
        assert got == want, f"{name} layer {i}: (heads, kv_heads, head_dim) = {got}, expected {want}"
        assert s.hidden_size == tiny(name).model.config.hidden_size
        group = s.num_heads // s.num_kv_heads
        assert s.kv_map == [h // group for h in range(s.num_heads)], f"{name} layer {i}: kv_map {s.kv_map}"
        assert len(s.q.heads) == s.num_heads and len(s.k.heads) == len(s.v.heads) == s.num_kv_heads
        assert len(s.o.heads) == s.num_heads
        assert all(len(h) == s.head_dim for p in (s.q, s.k, s.v, s.o) for h in p.heads)


@pytest.mark.parametrize("name", NAMES)
def test_sites_match_expected_flags(name, tiny):
    sites = tiny(name).require_sites()
    exp = EXPECTED[name]
    for i, s in enumerate(sites):
        summary = s.summary()
        got = {"fused_qkv": s.fused_qkv, "qkv_bias": summary["qkv_bias"], "qk_norm": summary["qk_norm"],
               "rope": s.rope, "kind": s.kind, "softcap": s.softcap or False}
        want = {"fused_qkv": exp["fused_qkv"], "qkv_bias": exp["qkv_bias"], "qk_norm": exp["qk_norm"],
                "rope": per_layer(exp["rope"], i), "kind": exp["attn_op"], "softcap": exp["softcap"]}
        wrong = {k: (got[k], want[k]) for k in want if got[k] != want[k]}
        assert not wrong, f"{name} layer {i}: (found, expected) {wrong}"
        assert s.scale == pytest.approx(exp["scale"], rel=1e-6), f"{name} layer {i}: scale {s.scale}"
        assert summary["heads"] == s.num_heads and summary["kv_heads"] == s.num_kv_heads


@pytest.mark.parametrize("name", NAMES)
def test_site_nodes_are_the_eager_attention_input_and_output(name, tiny, record):
    """The attention module's input (hooked in the eager model) is the site's input_node, and its
    output (after the output projection) is the site's output_node."""
    t = tiny(name)
    sites = t.require_sites()
    ids = ids_for((2, 11), t.model.config.vocab_size, seed=3)
    seen, hooks = {}, []
    modules = dict(t.model.named_modules())
    for s in sites:
        assert s.module_path in modules, f"{name}: module_path {s.module_path!r} is not a module of the model"

        def hook(mod, args, kwargs, out, layer=s.layer):
            x = args[0] if args else kwargs["hidden_states"]
            y = (out[0] if isinstance(out, (tuple, list)) else out).detach()
            if EXPECTED[name].get("attention_adds_residual"):  # BLOOM adds the residual inside its attention
                y = y - (args[1] if len(args) > 1 else kwargs["residual"]).detach()
            seen[layer] = (x.detach(), y)

        hooks.append(modules[s.module_path].register_forward_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad():
            t.model(input_ids=ids)
    finally:
        for h in hooks:
            h.remove()
    vals = record(t.graph.gm, ids, [n for s in sites for n in (s.input_node, s.output_node)])
    for s in sites:
        x, out = seen[s.layer]
        torch.testing.assert_close(vals[s.input_node], x, atol=1e-6, rtol=0, msg=f"{name} layer {s.layer}: input_node")
        torch.testing.assert_close(vals[s.output_node], out, atol=1e-5, rtol=1e-5, msg=f"{name} layer {s.layer}: output_node")


def _project(x, proj, params, heads=None, factor=1.0):
    """x [B,T,hidden] through the projection rows the site reports -> [B, n, T, D]."""
    w, b = proj.out_matrix(params, heads)
    y = x @ w.T
    if b is not None:
        y = y + b
    n = len(heads) if heads is not None else len(proj.heads)
    return (factor * y).unflatten(-1, (n, -1)).transpose(1, 2)


def _check_qkv(name, graph, sites, record, rope_of, qk_norm_of, q_factor=1.0):
    """Recompute V (every layer), and Q and K where nothing but a shape op or RoPE lies between the
    projection and the attention op: all positions without RoPE, position 0 (cos=1, sin=0) with it.
    Also recompute the output projection from the attention op's result."""
    params = dict(graph.gm.named_parameters(remove_duplicate=False))
    vocab = graph.config.vocab_size
    ids = ids_for((2, 11), vocab, seed=5)
    names = [n for s in sites for n in (s.input_node, s.q_node, s.k_node, s.v_node, s.attn_node, s.output_node)]
    vals = record(graph.gm, ids, names)
    T = ids.shape[1]
    checked = []
    for s in sites:
        x = vals[s.input_node]
        D = s.head_dim

        def at_op(node):
            v = vals[node]
            if v.shape[-2] == D and v.shape[-1] == T:  # eager: K arrives transposed [B, n, D, T]
                v = v.transpose(-1, -2)
            return v

        def kv_heads_in(op_value):
            """KV head read by each head of the op's K/V (repeated for GQA, 1 head for MQA)."""
            group = s.num_heads // op_value.shape[1]
            return [s.kv_map[j * group] for j in range(op_value.shape[1])]

        v_op = at_op(s.v_node)
        v_ref = _project(x, s.v, params, kv_heads_in(v_op))
        torch.testing.assert_close(v_op, v_ref, atol=1e-5, rtol=1e-4, msg=f"{name} layer {s.layer}: V")
        checked.append((s.layer, "v"))
        if not qk_norm_of(s.layer):
            positions = slice(None) if not rope_of(s.layer) else slice(0, 1)
            q_op = at_op(s.q_node)
            q_ref = _project(x, s.q, params, factor=q_factor)
            torch.testing.assert_close(q_op[:, :, positions], q_ref[:, :, positions], atol=1e-5, rtol=1e-4,
                                       msg=f"{name} layer {s.layer}: Q")
            k_op = at_op(s.k_node)
            k_ref = _project(x, s.k, params, kv_heads_in(k_op))
            torch.testing.assert_close(k_op[:, :, positions], k_ref[:, :, positions], atol=1e-5, rtol=1e-4,
                                       msg=f"{name} layer {s.layer}: K")
            checked.append((s.layer, "qk"))
        ctx = vals[s.attn_node]  # [B, H, T, D]
        assert ctx.shape == (ids.shape[0], s.num_heads, T, D)
        w, b = s.o.in_matrix(params)
        out = ctx.transpose(1, 2).flatten(2) @ w.T
        if b is not None:
            out = out + b
        torch.testing.assert_close(vals[s.output_node], out, atol=1e-5, rtol=1e-4, msg=f"{name} layer {s.layer}: O")
    return checked


@pytest.mark.parametrize("name", NAMES)
def test_found_projections_reproduce_attention_inputs(name, tiny, record):
    t = tiny(name)
    sites = t.require_sites()
    exp = EXPECTED[name]
    checked = _check_qkv(name, t.graph, sites, record,
                         rope_of=lambda l: per_layer(exp["rope"], l),
                         qk_norm_of=lambda l: exp["qk_norm"], q_factor=Q_FACTOR.get(name, 1.0))
    assert ("v" in {c[1] for c in checked})


# ------------------------------------------------------------------------------------------------
# stories260K (GGUF, the real teacher)


@pytest.mark.versions
def test_stories_capture_matches_transformers_gguf(stories_teacher, stories_eager):
    g = stories_teacher
    for shape in [(1, 9), (2, 40)]:
        ids = ids_for(shape, 512, seed=shape[1])
        with torch.no_grad():
            diff = (g(ids) - stories_eager(input_ids=ids).logits).abs().max().item()
        assert diff <= 1e-5, f"{shape}: {diff:.3g}"
    assert g.source["kind"] == "gguf" and g.source["gguf_file"] == "stories260K.gguf"
    assert g.max_length == 512
    assert g.tokenizer is not None and g.config.model_type == "llama"


def test_stories_sites(stories_teacher, record):
    sites = stories_teacher.sites
    assert len(sites) == 5
    for i, s in enumerate(sites):
        assert (s.layer, s.num_heads, s.num_kv_heads, s.head_dim, s.hidden_size) == (i, 8, 4, 8, 64)
        assert s.kv_map == [0, 0, 1, 1, 2, 2, 3, 3]
        assert s.rope and not s.fused_qkv and s.kind == "sdpa"
        assert s.scale == pytest.approx(8 ** -0.5)
        assert s.module_path == f"model.layers.{i}.self_attn"
        assert s.q.weight == f"model.layers.{i}.self_attn.q_proj.weight" and s.q.bias is None
        assert s.k.heads == [list(range(8 * j, 8 * j + 8)) for j in range(4)]
        row = s.summary()
        assert (row["heads"], row["kv_heads"], row["head_dim"], row["rope"], row["qk_norm"]) == (8, 4, 8, True, False)
    _check_qkv("stories", stories_teacher, sites, record, rope_of=lambda l: True, qk_norm_of=lambda l: False)


def test_stories_sites_round_trip_through_dict(stories_teacher):
    from surgery.sites import AttentionSite

    for s in stories_teacher.sites:
        assert AttentionSite.from_dict(s.to_dict()) == s


def test_capture_from_a_model_directory(tmp_path, tiny):
    """A directory with config.json + safetensors (no tokenizer) captures to the same logits."""
    model = tiny("llama").model
    model.save_pretrained(tmp_path / "llama")
    g = surgery.capture(tmp_path / "llama")
    assert g.source["kind"] == "dir" and g.tokenizer is None
    assert len(g.sites) == 2
    ids = ids_for((1, 13), 128)
    with torch.no_grad():
        assert (g(ids) - model(input_ids=ids).logits).abs().max().item() <= 1e-5


@pytest.mark.parametrize("offload", [False, True])
def test_a_bf16_capture_keeps_computed_buffers_as_transformers_loads_them(tmp_path, tiny, offload):
    """from_pretrained(dtype=bf16) leaves RoPE's inv_freq float32; capture in bf16 (in memory, or traced on
    meta with the weights in their files) casts the weights and keeps it, so the graph's logits are
    transformers' own bf16 model's, not those of one whose frequencies were rounded to bf16."""
    from transformers import AutoModelForCausalLM

    tiny("llama").model.save_pretrained(tmp_path / "llama")
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "llama", dtype=torch.bfloat16).eval()
    computed = dict(reference.named_non_persistent_buffers())
    assert computed and all(b.dtype == torch.float32 for b in computed.values())
    g = surgery.capture(tmp_path / "llama", dtype=torch.bfloat16, offload=offload)
    held = dict(g.gm.named_buffers())
    kept = [k for k in held if k.endswith("inv_freq")]
    assert kept and all(held[k].dtype == torch.float32 for k in kept)
    assert all(p.dtype == torch.bfloat16 for p in g.gm.parameters() if not p.is_meta)
    ids = ids_for((1, 120), 128)
    with torch.no_grad():
        want = reference(input_ids=ids).logits.float()
        rounded = AutoModelForCausalLM.from_pretrained(tmp_path / "llama", dtype=torch.bfloat16).eval().to(torch.bfloat16)
        assert all(b.dtype == torch.bfloat16 for _, b in rounded.named_non_persistent_buffers())
        assert (rounded(input_ids=ids).logits.float() - want).abs().max().item() > 0  # the rounding shows
        assert (g(ids).float() - want).abs().max().item() == 0


# ------------------------------------------------------------------------------------------------
# inputs the toolkit must refuse with one clear paragraph


def test_model_without_attention_is_refused():
    """A state-space model (Mamba) has nothing to replace: refused with a SurgeryError (it does not
    even export with a dynamic length, so CaptureError is acceptable), never a raw traceback."""
    from transformers import AutoModelForCausalLM, MambaConfig

    cfg = MambaConfig(vocab_size=128, hidden_size=32, state_size=8, num_hidden_layers=1, max_position_embeddings=64)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with pytest.raises(SurgeryError) as info:
        surgery.capture(model)
    assert isinstance(info.value, (CaptureError, NoAttentionError))
    assert_one_paragraph(info.value, "Mamba")


def test_decoder_without_attention_layers_raises_no_attention():
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=128, hidden_size=64, num_hidden_layers=0, num_attention_heads=4, intermediate_size=128,
                      max_position_embeddings=64)
    with pytest.raises(NoAttentionError) as info:
        surgery.capture(AutoModelForCausalLM.from_config(cfg).eval())
    assert_one_paragraph(info.value, "no softmax attention")


def _bert(tmp_path):
    from transformers import AutoModelForCausalLM, BertConfig

    cfg = BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                     max_position_embeddings=64)
    return AutoModelForCausalLM.from_config(cfg).eval()  # BertLMHeadModel, bidirectional (is_decoder=False)


def test_encoder_only_model_is_refused(tmp_path):
    model = _bert(tmp_path)
    with pytest.raises(NoAttentionError) as info:
        surgery.capture(model)
    assert_one_paragraph(info.value, "not causal")
    model.save_pretrained(tmp_path / "bert")
    with pytest.raises(SurgeryError) as info:
        surgery.capture(tmp_path / "bert")
    assert isinstance(info.value, (NoAttentionError, ModelLoadError))
    assert_one_paragraph(info.value)


def test_encoder_directories_without_a_causal_head_give_model_load_error(tmp_path):
    from transformers import DistilBertConfig, T5Config

    DistilBertConfig(vocab_size=128, dim=32, n_layers=1, n_heads=2, hidden_dim=64).save_pretrained(tmp_path / "distilbert")
    with pytest.raises(ModelLoadError) as info:
        surgery.capture(tmp_path / "distilbert")
    assert_one_paragraph(info.value, "distilbert", "not a causal decoder")
    T5Config(vocab_size=128, d_model=32, num_layers=1, num_heads=2, d_ff=64).save_pretrained(tmp_path / "t5")
    with pytest.raises(ModelLoadError) as info:
        surgery.capture(tmp_path / "t5")
    assert_one_paragraph(info.value, "encoder-decoder")


def test_missing_path_names_the_path(tmp_path):
    where = tmp_path / "no" / "such" / "model"
    with pytest.raises(ModelLoadError) as info:
        surgery.capture(str(where))
    assert_one_paragraph(info.value, str(where))


def test_corrupt_gguf(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(bytes(range(256)) * 8)
    with pytest.raises(ModelLoadError) as info:
        surgery.capture(bad)
    assert_one_paragraph(info.value, "x.gguf")
    magic = tmp_path / "y.gguf"
    magic.write_bytes(b"GGUF" + bytes(range(256)) * 4)  # right magic, garbage after it
    with pytest.raises(ModelLoadError) as info:
        surgery.capture(magic)
    assert_one_paragraph(info.value, "y.gguf")


def test_truncated_gguf(tmp_path, stories_path):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(stories_path.read_bytes()[:50_000])
    with pytest.raises(ModelLoadError) as info:
        surgery.capture(cut)
    assert_one_paragraph(info.value, "cut.gguf")


@pytest.mark.versions
def test_a_gguf_is_parsed_once_per_load(stories_path, monkeypatch):
    """transformers parses a GGUF's metadata anew for the config, the weights and the tokenizer;
    load_model hands it the one reader it made, puts gguf.GGUFReader back, and loads the same model."""
    import gguf
    import transformers

    from surgery.core.load import load_model

    made = []

    class Counting(gguf.GGUFReader):
        def __init__(self, path, *args, **kwargs):
            made.append(path)
            super().__init__(path, *args, **kwargs)

    from transformers import modeling_gguf_pytorch_utils as hf_gguf

    parses, name_maps = [], []
    original_parse, original_map = hf_gguf.load_gguf_checkpoint, gguf.get_tensor_name_map

    def counted_parse(*args, **kwargs):
        parses.append(kwargs.get("return_tensors", args[1] if len(args) > 1 else False))
        return original_parse(*args, **kwargs)

    def counted_map(*args):
        name_maps.append(args)
        return original_map(*args)

    monkeypatch.setattr(gguf, "GGUFReader", Counting)
    monkeypatch.setattr(hf_gguf, "load_gguf_checkpoint", counted_parse)
    monkeypatch.setattr(gguf, "get_tensor_name_map", counted_map)
    model, tokenizer, info = load_model(stories_path)
    # one reader; transformers' metadata parsed once for config and tokenizer, once more with the weights; one name table
    assert len(made) == 1 and sorted(parses) == [False, True] and len(name_maps) == 1
    assert gguf.GGUFReader is Counting and hf_gguf.load_gguf_checkpoint is counted_parse and gguf.get_tensor_name_map is counted_map
    assert tokenizer is not None
    reference = transformers.AutoModelForCausalLM.from_pretrained(info["path"], gguf_file=info["gguf_file"])
    assert len(made) > 2 and len(name_maps) > 2  # transformers alone: a parse for each of its readers, a table per submodule
    ours, theirs = model.state_dict(), reference.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in theirs)
    assert model.config.to_dict() == reference.config.to_dict()
    their_tokenizer = transformers.AutoTokenizer.from_pretrained(info["path"], gguf_file=info["gguf_file"])
    assert tokenizer.get_vocab() == their_tokenizer.get_vocab()


def test_read_gguf_parses_what_gguf_parses(stories_path):
    """read_gguf (an ndarray view of the map, faster) gives gguf.GGUFReader's fields and tensors, byte for byte."""
    import gguf

    from surgery.core.gguf_parse import read_gguf

    ours, theirs = read_gguf(stories_path), gguf.GGUFReader(stories_path)
    assert isinstance(ours, gguf.GGUFReader) and list(ours.fields) == list(theirs.fields) and len(ours.tensors) == len(theirs.tensors) > 0
    for key, field in theirs.fields.items():
        mine = ours.fields[key]
        assert (mine.offset, mine.data, mine.types) == (field.offset, field.data, field.types)
        assert [(p.dtype, p.shape, p.tobytes()) for p in mine.parts] == [(p.dtype, p.shape, p.tobytes()) for p in field.parts]
    for mine, tensor in zip(ours.tensors, theirs.tensors):
        assert (mine.name, mine.tensor_type, mine.data_offset, mine.data.dtype, mine.data.shape) == \
            (tensor.name, tensor.tensor_type, tensor.data_offset, tensor.data.dtype, tensor.data.shape)
        assert mine.data.tobytes() == tensor.data.tobytes() and not mine.data.flags.writeable


def test_directory_with_config_but_no_weights(tmp_path):
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=128, hidden_size=64, num_hidden_layers=1, num_attention_heads=4, intermediate_size=128).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError) as info:
        surgery.capture(tmp_path)
    assert_one_paragraph(info.value, str(tmp_path))


def test_not_a_transformers_model():
    with pytest.raises(ModelLoadError) as info:
        surgery.capture(torch.nn.Linear(4, 4))
    assert_one_paragraph(info.value, "Linear")


def test_sequence_longer_than_the_graph_takes(stories_teacher, tiny):
    g = stories_teacher
    with torch.no_grad():
        assert g(torch.zeros(1, 512, dtype=torch.long)).shape == (1, 512, 512)
    with pytest.raises(CaptureError) as info:
        g(torch.zeros(1, 513, dtype=torch.long))
    assert_one_paragraph(info.value, "513", "512")
    small = tiny("llama").require_graph()
    assert small.max_length == 128
    with pytest.raises(CaptureError) as info:
        small(torch.zeros(2, 129, dtype=torch.long))
    assert_one_paragraph(info.value, "128")
    with pytest.raises(CaptureError):
        small(torch.zeros(5, dtype=torch.long))


def test_capture_drops_dtype_asserts_so_autocast_runs(stories):
    """export pins intermediates' dtypes with _assert_tensor_metadata; under CUDA autocast (how
    distillation runs a float32 graph) those fire although nothing is wrong, so capture drops them."""
    graph = stories()
    targets = {n.target for n in graph.gm.graph.nodes if n.op == "call_function"}
    assert torch.ops.aten._assert_tensor_metadata.default not in targets
    ids = torch.randint(0, graph.config.vocab_size, (1, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = graph(ids)
    assert mixed.dtype == torch.bfloat16
    torch.testing.assert_close(mixed.float(), graph(ids), atol=0.5, rtol=0.1)


class _RotaryLM(torch.nn.Module):
    """A toy LM that computes its position angles as transformers' RoPE does: a float32 matmul of
    inv_freq and the positions inside maybe_autocast(enabled=False), which is a no-op context (and
    so leaves nothing in the exported graph) when autocast is off while tracing."""

    def __init__(self, vocab: int = 40, dim: int = 16):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.head = torch.nn.Linear(dim, vocab)
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, dim, 2).float() / dim))

    def get_input_embeddings(self):
        return self.embed

    def forward(self, input_ids):
        pos = torch.arange(input_ids.shape[1], device=input_ids.device).float()
        device = input_ids.device.type
        off = torch.autocast(device, enabled=False) if torch.is_autocast_enabled(device) else contextlib.nullcontext()
        with off:
            angles = (self.inv_freq[:, None].float() @ pos[None, :]).t()
        return self.head(self.embed(input_ids) + torch.cat([angles.cos(), angles.sin()], dim=-1))


def test_positions_stay_float32_under_autocast():
    """export drops the model's autocast(enabled=False) around the RoPE matmul; capture switches
    autocast off again for every autocast-lowered op computed from positions alone, so a bf16
    autocast run matches the eager model's (the unpinned export rounds positions above 256)."""
    from surgery.core.capture import export_model, without_autocast

    torch.manual_seed(0)
    model = _RotaryLM().eval()
    gm = export_model(model, max_length=4096)
    assert any(n.target is without_autocast for n in gm.graph.nodes)
    ids = torch.randint(0, 40, (1, 2048))
    unpinned = torch.export.export(model, (), {"input_ids": ids}, strict=False).module()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        eager, pinned, raw = model(ids), gm(input_ids=ids), unpinned(input_ids=ids)
    good = (pinned.float() - eager.float()).abs().max().item()
    bad = (raw.float() - eager.float()).abs().max().item()
    assert good < 0.05 < bad


class _ToyLM(torch.nn.Module):
    """An embedding of 40 tokens, as export_model needs (it draws ids below the input vocabulary)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(40, 8)

    def get_input_embeddings(self):
        return self.embed


class _GuardedLength(_ToyLM):
    """A forward with a shape guard (length above 4) that torch.export refuses for a range from 1."""

    def forward(self, input_ids):
        x = self.embed(input_ids)
        return x * 2 if input_ids.shape[1] > 4 else x


def test_only_the_guards_that_refuse_one_token_alone_are_dropped():
    """torch 2.11 wrote export's 0/1 assumption into XGLM's input guards (one-token calls failed, torch
    2.13's same graph has no such guard and runs them): a guard on the length alone that fails at 1 and
    holds from 2 to the graph's longest length goes; the length limit, guards that hold everywhere, narrow
    the lengths more or read anything but the length stay."""
    from types import SimpleNamespace

    from surgery.core.capture import drop_length_one_guards

    n = "L['input_ids'].size()[1]"
    limit, everywhere, one = f"2 + {n} <= 130", f"min(16*{n}, 64*{n}) == (16*{n})", f"{n} < min({n}*{n}, 4*{n}*{n})"
    narrower, batch, other = f"{n} >= 3", "L['input_ids'].size()[0] <= 4096", "L['use_cache'] == False"
    program = SimpleNamespace(_guards_code=[limit, everywhere, one, narrower, batch, other])
    assert drop_length_one_guards(program, 128) == 1
    assert program._guards_code == [limit, everywhere, narrower, batch, other]
    assert drop_length_one_guards(SimpleNamespace(_guards_code=[f"{n} > 1 and {n} <= 64"]), 128) == 0  # fails at 65 too
    assert drop_length_one_guards(SimpleNamespace(), 128) == 0  # a torch without _guards_code


def test_a_narrowing_shape_guard_is_announced():
    """One trace, with ranged dynamic hints: a shape guard in forward narrows the lengths the graph
    accepts instead of failing the trace; the caller hears the range, and the graph refuses a length
    outside it by name (a cold start on torch 2.11 paid a second trace when named ranges refused it)."""
    from surgery.core.capture import export_model

    model, told = _GuardedLength().eval(), []
    gm = export_model(model, 64, narrowed=lambda low, high: told.append((low, high)))
    ids = torch.randint(0, 40, (2, 9))
    assert told == [(5, 64)] and torch.equal(gm(input_ids=ids), model(ids))
    with pytest.raises(Exception, match="input_ids.size"):
        gm(input_ids=ids[:, :3])
    told.clear()
    lm = export_model(_RotaryLM().eval(), 64, narrowed=lambda low, high: told.append((low, high)))
    assert told == []  # the whole range: nothing said
    assert lm(input_ids=ids[:1, :1]).shape[:2] == (1, 1)  # batch 1 and length 1 run, though export reports 2 as lowest


class _WholeSlices(_ToyLM):
    """x[:, :, None] and x[:, :] (whole slices under dynamic hints), and a write through a whole slice."""

    def forward(self, input_ids):
        x = self.embed(input_ids)
        y = x[:, :, None].expand(-1, -1, 2, -1).reshape(x.shape[0], x.shape[1], 16)
        buf = torch.zeros_like(y)
        buf[:, :].copy_(y * 3)
        return buf[:, :] + y


def test_whole_slices_are_dropped_and_the_graph_computes_the_same():
    """torch.export keeps whole slices under the dynamic hints capture asks for (it elides them under
    named ranges): capture drops them, so the graph's form does not depend on the torch build, and a
    write through one still lands."""
    from surgery.core.capture import export_model
    from surgery.core.slice_fill import whole_slice

    model = _WholeSlices().eval()
    gm = export_model(model, 64)
    slices = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.slice.Tensor]
    assert not any(whole_slice(n) for n in slices)
    ids = torch.randint(0, 40, (3, 7))
    assert torch.equal(gm(input_ids=ids), model(ids))
