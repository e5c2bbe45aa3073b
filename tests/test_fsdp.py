"""FSDP2 distillation (surgery.train.sharding) on the real stories260K teacher, on the CPU with gloo:
the graph cut by layer computes what the graph computes; one sharded process and two repeat the
plain one-process run; a sharded run's checkpoints resume at another world size; bad options fail
with a fix."""
from __future__ import annotations

import copy
import gc
import importlib
import dataclasses
import json
import os
import socket
import traceback

import pytest
import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from safetensors.torch import load_file

import surgery
from surgery import PassManager
from surgery.core.run import graph_logits
from surgery.errors import DistillError
from surgery.train import DistillConfig, distill
from surgery.train.layer_split import split_by_layer, unit_names
from surgery.train.sharding import exclusive

trainer_module = importlib.import_module("surgery.train.trainer")

from cli_checks import assert_clean_failure, invoke
from forks import skip_unless_forked_ranks_train

TRAIN = " ".join([
    "Once upon a time, there was a little cat named Tom. Tom liked to play with a red ball in the garden.",
    "One day, the ball rolled under a big bush. Tom was sad because he could not find it. His friend, a small",
    "bird, flew down and said, \"I can help you, Tom!\" Lily and her mom went to the park. The sun was warm and",
    "the sky was blue. Lily saw a big slide and ran to it. She went up the steps and slid down fast. Ben had a",
    "blue boat. He took it to the pond every day. One day the wind blew hard and the boat went far away.",
] * 2)
L, G = 32, 4
STEP = L * G


@pytest.fixture(scope="module")
def train_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "train.txt"
    path.write_text(TRAIN)
    return path


@pytest.fixture(scope="module")
def hybrid(stories, tmp_path_factory):
    """stories260K with layers 1, 3, 4 converted to GDN, saved."""
    graph = stories()
    PassManager(["select", "replace"], {"select": {"keep_ratio": 0.5}})(graph)
    return surgery.save(graph, tmp_path_factory.mktemp("hybrid") / "hybrid")


@pytest.fixture(scope="module")
def loaded(hybrid):
    return surgery.load(hybrid)


def fresh(graph):
    return dataclasses.replace(graph, gm=copy.deepcopy(graph.gm), meta=copy.deepcopy(graph.meta))


def config(**changes) -> DistillConfig:
    """Stage l2 for 2 steps, then kl for 3, micro-batches of 2 (one process accumulates two), a
    checkpoint every step: a resume can land inside either stage, with optimizer states to restore.
    clip 0.05: every step's gradient is clipped (their norms are 0.09-13), so the sharded norm counts."""
    base = dict(tokens=5 * STEP, l2_tokens=2 * STEP, stage="both", seq_len=L, global_batch=G, micro_batch=2, save_every=STEP,
                warmup=0.2, lr_l2_new=3e-3, lr_l2_copied=3e-3, lr_kl_new=1e-3, lr_kl_copied=1e-3, lr_kl_rest=1e-4, keep_checkpoints=5, clip=0.05)
    return DistillConfig(**(base | changes))


def scored(train_file) -> dict:
    """Perplexity at the start, after step 2 and at the end: the student a sharded run evaluates
    (and saves) is refreshed from its shards."""
    return dict(eval_text=str(train_file), eval_tokens=256, eval_every=2 * STEP)


def losses(out, key: str = "loss") -> list[float]:
    return [r[key] for r in map(json.loads, (out / "log.jsonl").read_text().splitlines()) if key in r]


def final_weights(out) -> dict:
    return load_file(sorted(out.glob("checkpoint-*"))[-1] / "model.safetensors")


@pytest.fixture(scope="module")
def reference(loaded, train_file, stories_teacher, tmp_path_factory):
    """The plain one-process run every sharded run must repeat."""
    out = tmp_path_factory.mktemp("runs") / "plain"
    distill(fresh(loaded), [train_file], out, config(**scored(train_file)), teacher=stories_teacher, progress=False, device="cpu")
    return out


def assert_same_run(out, ref, rel: float, rtol: float):
    """Same losses and gradient norms step by step, same final weights. Tolerances: float32 in another
    summation order (gradients reduced across ranks, the norm summed over shards) moves losses by
    ~1e-7 relative. AdamW divides each gradient by its own running size, so an element whose
    gradient is ~0 moves by up to the learning rate on rounding alone: a few elements of a
    tensor differ by ~4e-6 after five steps at lr 3e-3 (measured), hence atol 1e-5 on weights."""
    assert losses(out) == pytest.approx(losses(ref), rel=rel)
    assert losses(out, "grad_norm") == pytest.approx(losses(ref, "grad_norm"), rel=10 * rel)
    assert losses(out, "eval_ppl") == pytest.approx(losses(ref, "eval_ppl"), rel=10 * rel)
    assert all(n > 0.05 for n in losses(ref, "grad_norm"))  # clipped every step
    mine, theirs = final_weights(out), final_weights(ref)
    assert mine.keys() == theirs.keys()
    for k in theirs:
        torch.testing.assert_close(mine[k], theirs[k], rtol=rtol, atol=1e-5, msg=k)


def test_split_by_layer_computes_what_the_graph_computes(loaded):
    gm = loaded.gm
    split = split_by_layer(gm, loaded.sites)
    assert [name for name, _ in split.named_children()] == ["pre", "layer_0", "layer_1", "layer_2", "layer_3", "layer_4", "post"]
    names = unit_names(split)
    assert sorted(names.values()) == sorted(n for n, _ in gm.named_parameters())  # every parameter, once
    for unit, child in split.named_children():  # each layer unit holds its decoder block's parameters only
        prefix = f"model.layers.{unit.removeprefix('layer_')}."
        held = [n for n, _ in child.named_parameters()]
        assert all(n.startswith(prefix) for n in held) if unit.startswith("layer_") else not any(n.startswith("model.layers.") for n in held)
    assert split.get_submodule("layer_1.model.layers.1.self_attn") is gm.get_submodule("model.layers.1.self_attn")  # shared, not copied
    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    extra = gm.meta.get("extra_inputs", {})
    assert torch.equal(graph_logits(split, ids, extra), graph_logits(gm, ids))  # the same arithmetic, bit for bit


def test_a_unit_sharing_a_parameter_is_left_to_the_root():
    """Tied weights: a layer unit whose parameter another part also reads cannot be its own FSDP
    unit (its shard would be freed while the other part reads it); the root unit takes it."""
    shared = torch.nn.Linear(4, 4)
    root = torch.nn.Module()
    root.a, root.b, root.c = torch.nn.Sequential(torch.nn.Linear(4, 4)), torch.nn.Sequential(shared), torch.nn.Module()
    root.c.head = shared
    assert exclusive(root, [root.a, root.b]) == [root.a]
    root.c.head = torch.nn.Linear(4, 4)
    assert exclusive(root, [root.a, root.b]) == [root.a, root.b]


def test_tied_embeddings_train_under_fsdp(stories_teacher, train_file, tmp_path):
    """A tied embedding / LM head: the graph reads it as lm_head.weight, the student lists it as
    model.embed_tokens.weight; the sharded run still trains it, and repeats the plain run."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                                                         num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=64)).eval()
    teacher = surgery.capture(model, max_length=64, device="cpu")
    teacher.tokenizer = stories_teacher.tokenizer
    student = teacher.branch()
    PassManager(["select", "replace"], {"select": {"keep_ratio": 0.5}})(student)
    c = dict(stage="kl", l2_tokens=None, tokens=3 * STEP, lr_kl_rest=1e-3)
    for name, changes in (("plain", {}), ("fsdp", {"fsdp": True})):
        distill(fresh(student), [train_file], tmp_path / name, config(**c, **changes), teacher=teacher, progress=False, device="cpu")
    assert_same_run(tmp_path / "fsdp", tmp_path / "plain", rel=1e-6, rtol=1e-5)
    before, after = student.gm.get_parameter("model.embed_tokens.weight"), final_weights(tmp_path / "fsdp")
    assert not torch.equal(before, after.get("model.embed_tokens.weight", after.get("lm_head.weight")))  # it trained


def test_one_sharded_process_repeats_the_plain_run(reference, loaded, train_file, stories_teacher, tmp_path, monkeypatch):
    """world 1, no torchrun (distill makes its own process group), with CPU offload and per-layer
    activation checkpointing: the FSDP code path end to end, the same numbers as the plain run."""
    out, seen = tmp_path / "fsdp1", []
    real = trainer_module.shard_student

    def spy(student, stage, place, config, autocast):
        sharded = real(student, stage, place, config, autocast)
        units = [m for m in sharded.root.modules() if isinstance(m, FSDPModule)]
        seen.append((stage, len(units), all(isinstance(p, DTensor) for p in sharded.root.parameters())))
        return sharded

    monkeypatch.setattr(trainer_module, "shard_student", spy)
    result = distill(fresh(loaded), [train_file], out, config(**scored(train_file), fsdp=True, fsdp_offload=True, grad_checkpoint=True),
                     teacher=stories_teacher, progress=False, device="cpu")
    assert result["complete"] and result["world"] == 1 and not torch.distributed.is_initialized()
    # stage l2: the 3 GDN layers and their root; stage kl: the 5 decoder layers and the root
    assert seen == [("l2", 4, True), ("kl", 6, True)]
    assert len(losses(out, "eval_ppl")) == 4  # start, steps 2 and 4, the end
    assert_same_run(out, reference, rel=1e-6, rtol=1e-5)


def test_bf16_sharded_weights_train_like_autocast(loaded, train_file, stories_teacher, tmp_path):
    """fsdp_mixed (bf16 weights gathered for compute, float32 reduction), the CUDA default, here on
    the CPU: the losses of bf16 autocast without FSDP within bf16 rounding (8 bits of mantissa: ~1e-2
    after a few steps); without autocast it is refused before any model loads."""
    kl = dict(stage="kl", l2_tokens=None, tokens=3 * STEP, autocast=True)
    distill(fresh(loaded), [train_file], tmp_path / "plain", config(**kl), teacher=stories_teacher, progress=False, device="cpu")
    distill(fresh(loaded), [train_file], tmp_path / "mixed", config(**kl, fsdp=True, fsdp_mixed=True), teacher=stories_teacher, progress=False, device="cpu")
    plain, mixed = losses(tmp_path / "plain"), losses(tmp_path / "mixed")
    assert len(mixed) == 3 and mixed == pytest.approx(plain, rel=2e-2) and mixed != plain  # != : bf16 weights were used
    with pytest.raises(DistillError, match="needs bf16 autocast") as info:
        distill(fresh(loaded), [train_file], tmp_path / "refused", config(**kl | {"autocast": False}, fsdp=True, fsdp_mixed=True), teacher=stories_teacher, device="cpu")
    assert "autocast=true" in info.value.fix and not (tmp_path / "refused").exists()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def on_ranks(world: int, run) -> None:
    """run() in `world` forked processes joined by gloo, as torchrun would start them (the environment
    variables placement() reads). Forked, they inherit the loaded models: no import, no capture."""
    port, context = free_port(), torch.multiprocessing.get_context("fork")

    def main(rank):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
        try:
            run()
        except BaseException:
            traceback.print_exc()
            os._exit(1)
        os._exit(0)

    procs = [context.Process(target=main, args=(rank,)) for rank in range(world)]
    gc.collect()  # a process group an earlier test destroyed, collected in a child, would wait on the parent's threads forever
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert codes == [0] * world, codes


def test_two_sharded_processes_and_resume_across_world_sizes(reference, loaded, train_file, stories_teacher, tmp_path):
    """2 processes (cut by time_limit after step 1, inside stage l2) -> 1 process (steps 2-3: the l2
    optimizer state saved from 2 shards goes into 1, then stage kl; killed after step 3) -> 2
    processes again (steps 4-5: the kl state of one process split in two): the plain run, within
    float32 tolerance."""
    skip_unless_forked_ranks_train()
    out = tmp_path / "fsdp2"
    on_ranks(2, lambda: distill(fresh(loaded), [train_file], out, config(**scored(train_file), fsdp=True, time_limit=1e-9), teacher=stories_teacher, progress=False, device="cpu"))
    assert len(losses(out)) == 1 and json.loads((out / "distill.json").read_text())["world"] == 2

    def crash(record):
        if record["step"] == 3:
            raise KeyboardInterrupt  # after step 3's checkpoint

    with pytest.raises(KeyboardInterrupt):
        distill(loaded, [train_file], out, config(**scored(train_file), fsdp=True), teacher=stories_teacher, resume=True, progress=False, device="cpu", on_step=crash)
    assert not torch.distributed.is_initialized()  # the group it made is gone, even after a crash
    assert sorted(p.name for p in out.glob("checkpoint-*"))[-1] == "checkpoint-00000003"
    on_ranks(2, lambda: distill(loaded, [train_file], out, config(**scored(train_file), fsdp=True), teacher=stories_teacher, resume=True, progress=False, device="cpu"))
    assert_same_run(out, reference, rel=1e-5, rtol=1e-4)


def test_a_sharded_teacher_repeats_the_run(reference, loaded, train_file, stories_teacher, stories_path, tmp_path, monkeypatch):
    """fsdp_teacher: stage kl's teacher sharded too (frozen, a unit per decoder layer). One process and
    two repeat the plain run; a caller's teacher Graph is left whole and running, a teacher the run
    captured itself (from a path) drops its full weights, keeping only the shards."""
    seen, real_shard = [], trainer_module.shard_teacher

    def shard(teacher, place, release):
        root = real_shard(teacher, place, release)
        units = [m for m in root.modules() if isinstance(m, FSDPModule)]
        sharded = all(isinstance(p, DTensor) and not p.requires_grad for p in root.parameters())
        seen.append((len(units), sharded, release, {p.device.type for p in teacher.gm.parameters()}))
        return root

    monkeypatch.setattr(trainer_module, "shard_teacher", shard)
    c = config(**scored(train_file), fsdp=True, fsdp_teacher=True)
    distill(fresh(loaded), [train_file], tmp_path / "graph", c, teacher=stories_teacher, progress=False, device="cpu")
    assert seen == [(6, True, False, {"cpu"})]  # the 5 decoder layers and the root; the caller's Graph keeps its weights
    assert_same_run(tmp_path / "graph", reference, rel=1e-6, rtol=1e-5)
    distill(fresh(loaded), [train_file], tmp_path / "path", c, teacher=stories_path, progress=False, device="cpu")
    assert seen[1:] == [(6, True, True, {"meta"})]  # captured by the run: only the shards stay
    assert_same_run(tmp_path / "path", reference, rel=1e-6, rtol=1e-5)
    monkeypatch.undo()
    skip_unless_forked_ranks_train()  # the one-process checks above ran
    on_ranks(2, lambda: distill(fresh(loaded), [train_file], tmp_path / "two", c, teacher=stories_teacher, progress=False, device="cpu"))
    assert json.loads((tmp_path / "two" / "distill.json").read_text())["world"] == 2
    assert_same_run(tmp_path / "two", reference, rel=1e-5, rtol=1e-4)


def test_bad_fsdp_options_fail_with_a_fix(hybrid, train_file, tmp_path):
    with pytest.raises(DistillError, match="fsdp_offload only applies to a sharded run") as info:
        config(fsdp_offload=True).validate()
    assert "--fsdp" in info.value.fix
    with pytest.raises(DistillError, match="fsdp_mixed"):
        config(fsdp_mixed=True).validate()
    with pytest.raises(DistillError, match="fsdp_teacher only applies to a sharded run"):
        config(fsdp_teacher=True).validate()
    with pytest.raises(DistillError, match="compile is not supported with fsdp"):
        config(fsdp=True, compile=True).validate()
    from typer.testing import CliRunner

    result = invoke(CliRunner(), "distill", "--model", hybrid, "--data", train_file, "--tokens", 5 * STEP, "--seq-len", L,
                    "--batch-size", G, "--out", tmp_path / "run", "--fsdp-offload")
    assert_clean_failure(result, "fsdp_offload", "--fsdp")
    assert not (tmp_path / "run").exists()
    # the command line trains sharded (one process: a group of its own)
    result = invoke(CliRunner(), "distill", "--model", hybrid, "--data", train_file, "--tokens", STEP, "--seq-len", L,
                    "--batch-size", G, "--stage", "kl", "--out", tmp_path / "run", "--fsdp", "--fsdp-offload", "--device", "cpu", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout.strip().splitlines()[-1])["steps"] == 1
    assert json.loads((tmp_path / "run" / "distill.json").read_text())["config"]["fsdp_offload"] is True


def test_a_head_split_hybrid_trains_sharded_as_it_trains_plain(stories, train_file, stories_teacher, tmp_path):
    """select.granularity=head (layers 1 and 3 keep some KV heads): stage l2 shards each split's module and
    fits its GDN to the converted heads' share, stage kl shards the decoder layers, which call the split's
    parts; with per-layer checkpointing, the same numbers as the plain run."""
    graph = stories()
    heads = {"0": [0, 1, 2, 3], "1": [0, 3], "2": [0, 1, 2, 3], "3": [1], "4": [0, 1, 2, 3]}
    PassManager(["select", "replace"], {"select": {"granularity": "head", "policy": "keep", "heads": heads}})(graph)
    assert graph.layer_kinds == ["attention", "split", "attention", "split", "attention"]
    plain, sharded = tmp_path / "plain", tmp_path / "fsdp"
    distill(fresh(graph), [train_file], plain, config(), teacher=stories_teacher, progress=False, device="cpu")
    result = distill(fresh(graph), [train_file], sharded, config(fsdp=True, grad_checkpoint=True), teacher=stories_teacher,
                     progress=False, device="cpu")
    assert result["complete"]
    assert_same_run(sharded, plain, rel=1e-6, rtol=1e-5)
