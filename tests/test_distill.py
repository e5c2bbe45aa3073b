"""`surgery distill` on the real stories260K teacher: both stages learn, a resumed run repeats the
uninterrupted one exactly, two gloo processes repeat one process, the result loads and evaluates,
and bad inputs fail with an Error/Fix paragraph before any training."""
from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import pickle
import re
import shutil
import socket
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

import surgery
from surgery import PassManager
import importlib
from surgery.core.run import placeholder_values
from surgery.errors import DistillError
from surgery.train import DistillConfig, distill
from surgery.train.config import lr_factor
from surgery.train.stages import forward_params, gradient_checkpointing, parameter_kinds, tap_module
from surgery.data.text import tokenize
from surgery.eval.perplexity import perplexity
from surgery.data.corpus import TokenCorpus, WindowOrder
from surgery.errors import DataError

from cli_checks import assert_clean_failure, invoke

stages_module = importlib.import_module("surgery.train.stages")  # the stage kl loss calls graph_logits there


# TinyStories-like training text (stories260K is a TinyStories model) and a different paragraph to score.
TRAIN = "\n\n".join([
    "Once upon a time, there was a little cat named Tom. Tom liked to play with a red ball in the garden. One day, "
    "the ball rolled under a big bush. Tom was sad because he could not find it. His friend, a small bird, flew down "
    "and said, \"I can help you, Tom!\" The bird looked under the bush and found the ball. Tom was very happy.",
    "Lily and her mom went to the park. The sun was warm and the sky was blue. Lily saw a big slide and ran to it. "
    "She went up the steps and slid down fast. \"Again!\" she said. Her mom laughed and pushed her on the swing. "
    "Then they ate apples under a tree. Lily gave a piece of her apple to a little duck.",
    "Ben had a blue boat. He took it to the pond every day. One day the wind blew hard and the boat went far away. "
    "Ben ran around the pond. A kind girl named Sue caught the boat with a long stick. \"Here is your boat,\" she "
    "said. Ben said thank you, and they sailed the boat together until the sun went down.",
])
EVAL = ("Sam and his dog Max went for a walk in the woods. They saw a big tree with a hole in it. Max barked at the "
        "hole. A small owl looked out and said hello. Sam smiled and waved. Then they walked home for dinner.")

L, G = 32, 4                     # sequence length and global batch of the runs below
STEP = L * G                     # tokens per optimizer step


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("text")
    (folder / "train.txt").write_text(TRAIN)
    (folder / "eval.txt").write_text(EVAL)
    (folder / "empty.txt").write_text("")
    return folder


@pytest.fixture(scope="module")
def hybrid(stories, tmp_path_factory):
    """stories260K with keep_ratio 0.5 (layers 1, 3, 4 become GDN), saved: what `surgery apply` writes."""
    graph = stories()
    PassManager(["select", "replace"], {"select": {"keep_ratio": 0.5}})(graph)
    return surgery.save(graph, tmp_path_factory.mktemp("hybrid") / "hybrid")


@pytest.fixture(scope="module")
def loaded(hybrid):
    """The saved hybrid loaded once; `fresh(loaded)` hands out independent copies (loading is the slow part)."""
    return surgery.load(hybrid)


def fresh(graph):
    return dataclasses.replace(graph, gm=copy.deepcopy(graph.gm), meta=copy.deepcopy(graph.meta))


def both_config(files, **changes) -> DistillConfig:
    """Stage l2 for 2 steps then kl for 4, micro-batches of 2 (so one process accumulates), a
    checkpoint every 3 steps: resume lands inside the kl stage, with optimizer state to restore."""
    base = dict(tokens=6 * STEP, l2_tokens=2 * STEP, stage="both", seq_len=L, global_batch=G, micro_batch=2,
                save_every=3 * STEP, warmup=0.2, lr_l2_new=3e-3, lr_l2_copied=3e-3, lr_kl_new=1e-3, lr_kl_copied=1e-3,
                lr_kl_rest=1e-4, eval_text=str(files / "eval.txt"), eval_tokens=256)
    return DistillConfig(**(base | changes))


def read_log(out) -> list[dict]:
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]


def step_losses(out) -> list[float]:
    return [r["loss"] for r in read_log(out) if "loss" in r]


def final_weights(out) -> dict:
    last = sorted(out.glob("checkpoint-*"))[-1]
    return load_file(last / "model.safetensors")


@pytest.fixture(scope="module")
def reference(loaded, files, stories_teacher, tmp_path_factory):
    """The uninterrupted one-process run the resume and the two-process tests must reproduce."""
    out = tmp_path_factory.mktemp("runs") / "reference"
    result = distill(fresh(loaded), [files / "train.txt"], out, both_config(files), teacher=stories_teacher, progress=False)
    return out, result


# ------------------------------------------------------------------------------------------------
# pieces


def test_the_default_stage_puts_an_l2_stage_first_where_the_budget_allows():
    """Issue 30's recipe study: by default a run starts with an l2 stage of tokens // 7, where that is at
    least one optimizer step (else it is KL alone); a stage asked for is taken as asked, and --stage both
    on too small a budget is still an error."""
    step = 4 * 32
    assert DistillConfig(tokens=70 * step, seq_len=32, global_batch=4).steps() == [("l2", 10), ("kl", 60)]
    assert DistillConfig(tokens=6 * step, seq_len=32, global_batch=4).steps() == [("kl", 6)]
    assert DistillConfig(tokens=6 * step, l2_tokens=step, seq_len=32, global_batch=4).steps() == [("l2", 1), ("kl", 5)]
    assert DistillConfig(tokens=70 * step, stage="kl", seq_len=32, global_batch=4).steps() == [("kl", 70)]
    with pytest.raises(DistillError, match="Stage l2 has a budget"):
        DistillConfig(tokens=6 * step, stage="both", seq_len=32, global_batch=4).validate()
    default, asked = DistillConfig(tokens=70 * step, seq_len=32, global_batch=4), dict(tokens=70 * step, seq_len=32, global_batch=4)
    assert default.differences(DistillConfig(stage="both", **asked).to_dict()) == []  # --resume compares the stages run
    assert default.differences(DistillConfig(stage="kl", **asked).to_dict()) == ["stage (run: 'kl', now: 'both')"]


def test_window_order_is_a_function_of_seed_step_rank_and_world(stories_teacher, files):
    corpus = TokenCorpus.build([files / "train.txt"], stories_teacher.tokenizer)
    again = TokenCorpus.build([files / "train.txt"], stories_teacher.tokenizer)
    assert again.cache_files == corpus.cache_files and len(corpus) > 10 * L  # cached by content and tokenizer
    order = WindowOrder(corpus, L, G, seed=3)
    n = order.windows
    steps = [order.indices(s) for s in range(2 * n)]
    # every window once per epoch, epochs shuffled differently
    first = [i for s in steps for i in s][:n]
    assert sorted(first) == list(range(n))
    assert [i for s in steps for i in s][n:2 * n] != first
    # ranks split each global batch in order; a fresh object (a resumed run) gives the same batches
    fresh = WindowOrder(corpus, L, G, seed=3)
    for s in (0, 5, 17):
        assert fresh.indices(s, 0, 2) + fresh.indices(s, 1, 2) == order.indices(s)
        assert torch.equal(torch.cat([order.batch(s, 0, 2), order.batch(s, 1, 2)]), order.batch(s))
    assert WindowOrder(corpus, L, G, seed=4).indices(0) != order.indices(0)


def test_teacher_taps_and_flop_counts(stories_teacher, record):
    gm, site = stories_teacher.gm, stories_teacher.sites[1]
    taps = tap_module(gm, [site.input_node, site.output_node])
    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(1))
    x, y = taps(*placeholder_values(taps, ids))
    want = record(gm, ids, [site.input_node, site.output_node])
    assert torch.equal(x, want[site.input_node]) and torch.equal(y, want[site.output_node])
    # the taps stop at layer 1: layers 2-4, the final norm and the LM head are pruned away
    assert not any(n.startswith(("model.layers.2.", "lm_head")) for n, _ in taps.named_parameters())
    total = sum(p.numel() for p in gm.parameters())
    embedding = gm.get_parameter("model.embed_tokens.weight").numel()  # untied here: a lookup table only
    assert forward_params(gm) == total - embedding
    assert 0 < forward_params(taps) < forward_params(gm) / 2


def kinds_by_name(graph) -> dict[str, str]:
    kinds = parameter_kinds(graph)
    return {n: kinds.get(id(p), "rest") for n, p in graph.gm.named_parameters()}


def test_parameter_groups_and_schedule(loaded):
    kind = kinds_by_name(loaded)  # layers 1, 3, 4 are GDN
    assert kind["model.layers.1.self_attn.q_proj.weight"] == "copied"
    assert kind["model.layers.1.self_attn.o_proj.weight"] == "copied"
    assert kind["model.layers.1.self_attn.A_log"] == "new"
    assert kind["model.layers.1.self_attn.o_norm.weight"] == "new"
    assert kind["model.layers.1.mlp.up_proj.weight"] == "rest"
    assert kind["model.layers.0.self_attn.q_proj.weight"] == "rest"
    factors = [lr_factor(s, 10, 0.2, "cosine", 0.1) for s in range(10)]
    assert factors[:3] == [0.5, 1.0, 1.0] and factors[-1] > 0.1 and all(b < a for a, b in zip(factors[2:], factors[3:]))
    assert [lr_factor(s, 10, 0.0, "constant", 0.0) for s in (0, 9)] == [1.0, 1.0]


def test_gradient_checkpointing_keeps_gradients_and_drops_saved_activations(loaded):
    gdn = fresh(loaded).gdn_modules()[1]
    x = torch.randn(2, 40, gdn.hidden_size, generator=torch.Generator().manual_seed(0))

    def run(enabled):
        gdn.zero_grad(set_to_none=True)
        saved = []
        with gradient_checkpointing([gdn], enabled), torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            assert ("forward" in vars(gdn)) == enabled
            loss = gdn(x).square().mean()
        loss.backward()
        return {n: p.grad.clone() for n, p in gdn.named_parameters()}, len(saved)

    (plain, kept), (checkpointed, kept_checkpointed) = run(False), run(True)
    assert "forward" not in vars(gdn)  # the patch is undone
    assert plain.keys() == checkpointed.keys() and all(torch.equal(plain[k], checkpointed[k]) for k in plain)
    assert kept_checkpointed < kept / 4, (kept_checkpointed, kept)


# ------------------------------------------------------------------------------------------------
# training


def one_batch_config(corpus_tokens: int, stage: str) -> DistillConfig:
    """The global batch holds every window of the corpus, so each step sees the same data and the
    loss must fall from step to step."""
    windows = corpus_tokens // L
    return DistillConfig(tokens=5 * windows * L, stage=stage, seq_len=L, global_batch=windows, warmup=0.0,
                         schedule="constant", lr_l2_new=3e-3, lr_l2_copied=3e-3, lr_kl_new=2e-3, lr_kl_copied=2e-3, lr_kl_rest=2e-4)


@pytest.mark.parametrize("stage", ["kl", "l2"])
def test_loss_decreases(stage, loaded, hybrid, files, stories_teacher, tmp_path):
    start = fresh(loaded)
    corpus = TokenCorpus.build([files / "train.txt"], start.tokenizer)
    result = distill(start, [files / "train.txt"], tmp_path / "run", one_batch_config(len(corpus), stage), teacher=stories_teacher, progress=False)
    losses = step_losses(tmp_path / "run")
    assert len(losses) == 5 and result["steps"] == 5
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert losses[-1] < 0.85 * losses[0], losses
    assert result["tokens_per_s"] > 0 and result["flops_per_s"] > result["tokens_per_s"] * 6 * 1000
    trained = dict(start.gm.named_parameters())
    original = load_file(hybrid / "model.safetensors")
    kind = kinds_by_name(start)
    moved = {kind[n] for n, p in trained.items() if n in original and not torch.equal(p.detach(), original[n])}
    # stage l2 fits the GDN layers only; stage kl moves the rest of the model too
    assert moved == ({"new", "copied"} if stage == "l2" else {"new", "copied", "rest"})


@pytest.mark.parametrize("stage", ["kl", "l2"])
def test_bf16_autocast_trains(stage, loaded, files, stories_teacher, tmp_path):
    """The CUDA recipe (float32 master weights, bf16 autocast, bf16 teacher) on CPU autocast: the
    graph runs with mixed dtypes (export's dtype asserts would refuse it) and the loss still falls."""
    start = fresh(loaded)
    corpus = TokenCorpus.build([files / "train.txt"], start.tokenizer)
    config = dataclasses.replace(one_batch_config(len(corpus), stage), autocast=True, tokens=3 * (len(corpus) // L) * L)
    distill(start, [files / "train.txt"], tmp_path / "run", config, teacher=stories_teacher, progress=False)
    losses = step_losses(tmp_path / "run")
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses
    assert all(p.dtype == torch.float32 for p in start.gm.parameters())


def test_resume_repeats_the_uninterrupted_run(reference, loaded, files, stories_teacher, tmp_path):
    ref_out, ref = reference
    assert ref["steps"] == 6 and [r["stage"] for r in read_log(ref_out) if "stage" in r] == ["l2"] * 2 + ["kl"] * 4
    out = tmp_path / "run"

    def crash(record):
        if record["step"] == 4:
            raise KeyboardInterrupt  # the process dies after step 4; the last checkpoint is step 3

    with pytest.raises(KeyboardInterrupt):
        distill(fresh(loaded), [files / "train.txt"], out, both_config(files), teacher=stories_teacher, progress=False, on_step=crash)
    assert [p.name for p in sorted(out.glob("checkpoint-*"))] == ["checkpoint-00000003"]
    assert [r["step"] for r in read_log(out)] == [0, 1, 2, 3, 4]
    # the resumed process starts from the checkpoint on disk, whatever model it is handed
    result = distill(loaded, [files / "train.txt"], out, both_config(files), teacher=stories_teacher, progress=False, resume=True)
    assert result["steps"] == 6
    assert [r["step"] for r in read_log(out)] == [0, 1, 2, 3, 4, 5, 6]  # step 4 of the dead run was dropped
    assert step_losses(out) == step_losses(ref_out)  # exactly: same data, same state, same arithmetic
    mine, theirs = final_weights(out), final_weights(ref_out)
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert read_log(out)[-1]["eval_ppl"] == read_log(ref_out)[-1]["eval_ppl"]
    # a finished run resumed again has nothing left to do
    again = distill(loaded, [files / "train.txt"], out, both_config(files), teacher=stories_teacher, progress=False, resume=True)
    assert again["steps"] == 6 and again["tokens_per_s"] is None and again["eval_ppl"] == result["eval_ppl"]


class Planted:
    """Unpickling this runs a shell command: what a planted trainer_state.pt could do."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch '{self.marker}'",))


def test_resume_never_unpickles_a_planted_trainer_state(reference, loaded, files, stories_teacher, tmp_path):
    """Trainer state is JSON + safetensors: a pickle planted in a run directory (beside the state, or
    as an old-format trainer_state.pt) is never loaded by --resume, which resumes cleanly or refuses."""
    ref_out, _ = reference
    pickle.loads(pickle.dumps(Planted(tmp_path / "proof")))
    assert (tmp_path / "proof").exists()  # the payload does run when unpickled
    marker = tmp_path / "executed"

    def copy_of_reference(name, *drop):
        out = tmp_path / name
        shutil.copytree(ref_out, out, symlinks=True)
        for path in drop:
            shutil.rmtree(out / path)
        for checkpoint in out.glob("checkpoint-*"):
            torch.save({"rng": Planted(marker)}, checkpoint / "trainer_state.pt")
        return out

    def resume(out):
        return distill(loaded, [files / "train.txt"], out, both_config(files), teacher=stories_teacher, progress=False, resume=True)

    assert resume(copy_of_reference("finished"))["complete"] and not marker.exists()
    unfinished = copy_of_reference("unfinished", "checkpoint-00000006")
    assert resume(unfinished)["steps"] == 6 and not marker.exists()
    assert step_losses(unfinished) == step_losses(ref_out)
    old = copy_of_reference("old-format", "checkpoint-00000006")
    for state in old.glob("checkpoint-*/trainer_state.*"):
        if state.suffix != ".pt":
            state.unlink()
    with pytest.raises(DistillError, match="older version") as info:
        resume(old)
    assert "new run" in info.value.fix and not marker.exists()


def test_force_keeps_the_replaced_run_until_the_new_one_has_a_checkpoint(loaded, files, stories_teacher, tmp_path, monkeypatch):
    """--force over an earlier run moves it aside; a new run that fails before its first checkpoint
    leaves it there (.OUT.old-PID), one that writes a checkpoint deletes it."""
    out = tmp_path / "run"
    config = DistillConfig(tokens=2 * STEP, stage="kl", seq_len=L, global_batch=G)
    distill(fresh(loaded), [files / "train.txt"], out, config, teacher=stories_teacher, progress=False)
    first = final_weights(out)

    def broken(*args, **kwargs):
        raise torch.OutOfMemoryError("out of memory (planted)")

    monkeypatch.setattr(stages_module, "graph_logits", broken)
    with pytest.raises(DistillError):
        distill(fresh(loaded), [files / "train.txt"], out, config, teacher=stories_teacher, force=True, progress=False)
    monkeypatch.undo()
    aside = [p for p in tmp_path.iterdir() if p.name.startswith(".run.old-")]
    assert len(aside) == 1 and all(torch.equal(first[k], v) for k, v in final_weights(aside[0] / "run").items())
    distill(fresh(loaded), [files / "train.txt"], out, config, teacher=stories_teacher, force=True, progress=False)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".run.old-")]
    assert (out / "last").exists()


def test_time_limit_stops_with_a_checkpoint_and_resume_repeats_the_run(reference, loaded, files, stories_teacher, tmp_path):
    """A run sliced by time_limit (here: out of time after every step) stops cleanly at each step
    boundary with a checkpoint, and resuming slice after slice gives the uninterrupted run. Three
    one-step slices cover the stage switch (step 2 -> 3) and a save point (3); each resume rebuilds
    the hybrid from disk (a capture), so the last resume, without a limit, runs steps 4-6."""
    ref_out, _ = reference
    out = tmp_path / "run"
    sliced = both_config(files, time_limit=1e-9)
    first = distill(fresh(loaded), [files / "train.txt"], out, sliced, teacher=stories_teacher, progress=False)
    assert first["stopped"] == "time_limit" and not first["complete"] and first["steps"] == 1
    assert [p.name for p in sorted(out.glob("checkpoint-*"))] == ["checkpoint-00000001"]
    for slices in (2, 3):  # each resume trains one more step: the stage switch (step 2 -> 3) and a save point
        result = distill(loaded, [files / "train.txt"], out, sliced, teacher=stories_teacher, progress=False, resume=True)
        assert result["stopped"] == "time_limit" and not result["complete"] and result["steps"] == slices
        assert sorted(out.glob("checkpoint-*"))[-1].name == f"checkpoint-{slices:08d}"
    result = distill(loaded, [files / "train.txt"], out, both_config(files), teacher=stories_teacher, progress=False, resume=True)
    assert result["complete"] and result["stopped"] is None and result["steps"] == 6
    assert step_losses(out) == step_losses(ref_out)
    mine, theirs = final_weights(out), final_weights(ref_out)
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)
    with pytest.raises(DistillError, match="time_limit"):
        both_config(files, time_limit=-1).validate()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_gloo_processes_repeat_one_process(reference, hybrid, files, tmp_path):
    """torchrun, 2 CPU processes, the CLI: each takes half of every global batch (one micro-batch),
    where the reference accumulated two micro-batches in one process. The first launch is cut by
    --time-limit after one step (both ranks must agree to stop, or the run hangs); --resume finishes it."""
    ref_out, _ = reference
    out = tmp_path / "ddp"
    c = both_config(files)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(_free_port()), "-m", "surgery.cli.app", "distill", "--model", hybrid,
           "--data", files / "train.txt", "--tokens", c.tokens, "--l2-tokens", c.l2_tokens, "--stage", "both", "--seq-len", L,
           "--batch-size", G, "--micro-batch", 2, "--save-every", c.save_every, "--warmup", c.warmup, "--lr-rest", c.lr_kl_rest,
           "--set", "lr_l2_new=3e-3", "--set", "lr_l2_copied=3e-3", "--set", "lr_kl_new=1e-3", "--set", "lr_kl_copied=1e-3",
           "--eval-text", files / "eval.txt", "--eval-tokens", 256, "--out", out, "--device", "cpu", "--json"]
    env = dict(os.environ, OMP_NUM_THREADS="1")

    def launch(*extra):
        port = ["--master-port", str(_free_port())]
        args = [str(a) for a in cmd[:cmd.index("--master-port")] + port + cmd[cmd.index("--master-port") + 2:] + list(extra)]
        proc = subprocess.run(args, capture_output=True, text=True, env=env, timeout=240)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        summaries = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
        assert len(summaries) == 1 and summaries[0]["world"] == 2  # rank 0 alone reports
        return summaries[0]

    first = launch("--time-limit", "1e-9")
    assert first["stopped"] == "time_limit" and first["steps"] == 1
    assert launch("--resume")["complete"]
    assert json.loads((out / "distill.json").read_text())["world"] == 2
    assert step_losses(out) == pytest.approx(step_losses(ref_out), rel=1e-5)
    mine, theirs = final_weights(out), final_weights(ref_out)
    for k in theirs:
        torch.testing.assert_close(mine[k], theirs[k], rtol=1e-4, atol=1e-6, msg=k)


def test_distilled_checkpoint_loads_and_evaluates(reference, files, stories_teacher):
    ref_out, ref = reference
    loaded = surgery.load(ref["checkpoint"])
    assert ref["checkpoint"].endswith("checkpoint-00000006") and (ref_out / "last").resolve().name == "checkpoint-00000006"
    assert len(list(ref_out.glob("checkpoint-*"))) == 2  # keep_checkpoints
    assert loaded.layer_kinds == ["attention", "gdn", "attention", "gdn", "gdn"]
    assert loaded.meta["distill"]["step"] == 6 and loaded.meta["distill"]["config"]["stage"] == "both"
    ids = tokenize(loaded.tokenizer, EVAL)[:256]
    ppl = perplexity(loaded, ids)["perplexity"]
    log = read_log(ref_out)
    assert ppl == pytest.approx(log[-1]["eval_ppl"], rel=1e-9)  # the run scored the weights it saved
    assert ppl < log[0]["eval_ppl"]  # distillation helped
    assert log[0]["teacher_ppl"] == pytest.approx(perplexity(stories_teacher, ids)["perplexity"], rel=1e-9)
    assert all(math.isfinite(r["tokens_per_s"]) and r["flops_per_s"] > 0 for r in log[1:])


# ------------------------------------------------------------------------------------------------
# command line and errors


@pytest.fixture(scope="module")
def runner():
    return CliRunner()


def test_cli_distills_with_the_teacher_named_in_the_recipe(runner, hybrid, files, tmp_path):
    out = tmp_path / "cli"
    args = ["distill", "--model", hybrid, "--data", files / "train.txt", files / "train.txt", "--tokens", "0.256k",
            "--seq-len", L, "--batch-size", G, "--stage", "kl", "--out", out, "--json"]
    result = invoke(runner, *args)
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)  # stdout: the JSON alone; progress stays on stderr (a line each 5% of 2 steps)
    assert summary["steps"] == 2 and summary["tokens"] == 256 and summary["checkpoint"].endswith("checkpoint-00000002")
    assert re.search(r"^distill: 256/256 tokens \(100%\), step 2/2 \(kl\), loss [\d.]+", result.stderr, re.M), result.stderr
    run = json.loads((out / "distill.json").read_text())
    assert run["teacher"].endswith("stories260K.gguf") and len(run["data"]) == 2
    recipe = json.loads((out / "checkpoint-00000002" / "recipe.json").read_text())
    assert recipe["results"]["distill"]["tokens"] == 256 and recipe["source"]["gguf_file"] == "stories260K.gguf"
    assert_clean_failure(invoke(runner, *args), "already exists", "--resume")

    # the run directory itself opens as its latest checkpoint (eval, generate, diff, inspect)
    ppl = invoke(runner, "eval", "--model", out, "--text", files / "train.txt", "--chunk", L, "--json")
    assert ppl.exit_code == 0, ppl.output
    direct = invoke(runner, "eval", "--model", out / "checkpoint-00000002", "--text", files / "train.txt", "--chunk", L, "--json")
    assert json.loads(ppl.stdout.strip().splitlines()[-1])["perplexity"] == json.loads(direct.stdout.strip().splitlines()[-1])["perplexity"]
    empty = tmp_path / "empty-run"
    empty.mkdir()
    (empty / "distill.json").write_text("{}")
    assert_clean_failure(invoke(runner, "eval", "--model", empty, "--text", files / "train.txt"), "no checkpoint yet")


def test_bad_inputs_fail_with_a_fix(runner, reference, loaded, hybrid, files, stories_teacher, tmp_path, stories_path, monkeypatch):
    ref_out, _ = reference
    common = ["--data", files / "train.txt", "--tokens", 10 * STEP, "--seq-len", L, "--batch-size", G]
    not_hybrid = tmp_path / "plain"
    not_hybrid.mkdir()
    assert_clean_failure(invoke(runner, "distill", "--model", not_hybrid, *common, "--out", tmp_path / "a"), "not a saved hybrid", "surgery apply")
    assert_clean_failure(invoke(runner, "distill", "--model", stories_path, *common, "--out", tmp_path / "b"), "not a saved hybrid")
    assert_clean_failure(invoke(runner, "distill", "--model", hybrid, "--data", tmp_path / "nope.txt", *common[2:], "--out", tmp_path / "c"), "nope.txt", "--data")
    assert_clean_failure(invoke(runner, "distill", "--model", hybrid, "--data", files / "train.txt", "--tokens", 100, "--out", tmp_path / "d"), "less than one optimizer step")
    assert_clean_failure(invoke(runner, "distill", "--model", hybrid, *common, "--out", tmp_path / "e", "--resume"), "holds no distillation run")
    # resuming the reference run with another learning rate or other data is refused
    changed = invoke(runner, "distill", "--model", hybrid, *common, "--out", ref_out, "--resume", "--stage", "both")
    assert_clean_failure(changed, "differs from the run", "tokens")
    with pytest.raises(DistillError, match="lr_kl_rest"):
        distill(loaded, [files / "train.txt"], ref_out, both_config(files, lr_kl_rest=0.0), teacher=stories_teacher, resume=True, progress=False)
    with pytest.raises(DistillError, match="other training data"):
        distill(loaded, [files / "eval.txt"], ref_out, both_config(files), teacher=stories_teacher, resume=True, progress=False)
    # a micro-batch that does not fit names the knobs that make it fit
    real = stages_module.graph_logits

    # (torch's allocator error, and Triton's launcher error when an autotuning launch finds no room)
    for error in (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 12.00 GiB."), RuntimeError("Triton Error [CUDA]: out of memory")):
        def no_room(gm, ids, *extra, error=error):
            if torch.is_grad_enabled():  # training forwards; evaluations (no grad) still run
                raise error
            return real(gm, ids, *extra)

        monkeypatch.setattr(stages_module, "graph_logits", no_room)
        with pytest.raises(DistillError, match="micro-batch of 2 x 32 tokens") as info:
            distill(fresh(loaded), [files / "train.txt"], tmp_path / f"h{type(error).__name__}", both_config(files, stage="kl", l2_tokens=None),
                    teacher=stories_teacher, progress=False)
        assert "--micro-batch (e.g. 1" in info.value.fix and "--grad-checkpoint" in info.value.fix
        monkeypatch.undo()
    # data problems found once the tokenizer is known
    with pytest.raises(DataError, match="holds no tokens"):
        distill(fresh(loaded), [files / "empty.txt"], tmp_path / "f", both_config(files), teacher=stories_teacher, progress=False)
    with pytest.raises(DataError, match="one sequence needs"):
        distill(fresh(loaded), [files / "eval.txt"], tmp_path / "g", both_config(files, seq_len=512, global_batch=1, micro_batch=None, tokens=2048, l2_tokens=512, save_every=0),
                teacher=stories_teacher, progress=False)
