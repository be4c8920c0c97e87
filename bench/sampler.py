"""The token samplers of the rollouts, timed as generate() calls them: one exact sample per row of (n, V) float32
probabilities (SampledTokenLogps: `(z - lse).exp_()`, suppressed ids at exactly 0), drawn with a torch.Generator.

- multinomial: `torch.multinomial(probs, 1, generator=g)` (--fast_sampler false). For one sample, aten's CPU path is
  itself an exponential race (exponential_, div, argmax) after checks on the probabilities (aminmax, row sums).
- draw_tokens: the two-level inverse CDF (gndpo_fast.py, --fast_sampler: on by default where it imports).
- the exponential race: `argmax(probs / E)` with E ~ Exp(1) i.i.d. per entry, an exact sample (the Gumbel-max trick
  exponentiated: P(argmax = i) = p_i / sum p). Three forms: `race` as written (a fresh noise tensor, the division
  out of place), `race_inplace` (a fresh noise tensor divided into in place: `torch.div(probs, noise, out=noise)`)
  and `race_reused` (one noise buffer kept between calls, as a generate() call's (n, V) shape never changes, divided
  into in place: no allocation). The best of the three at each shape is reported on its own. The noise is drawn in
  probs' dtype, float32, so "float32 noise" and "noise in probs' dtype" are one variant here.

Shapes, both read from the project:
- default world: n = rows per generate() call of the default run on 1 process (Args: generation_batch_size 0 = all
  prompts_per_step x num_generations rollouts at once), V = the tiny student's text vocab_size (assets/tiny).
- paper's shape: V = Qwen2.5-VL-3B's vocab_size (assets/configs), n = generation_batch_size of the 24 GB Qwen2.5-VL-3B
  recipe (rows per generate() call; its micro_batch_size sizes the scoring and update forwards, not the sampler).
Two distributions each: softmax of N(0, 1) logits ("flat") and of 8 x those logits ("peaked": trained models are).

Time: every sampler runs --warmup times, then --repeats timed calls each, in rotation (the order shifts by one each
repeat, so machine load hits all alike); a sampler's time is the median, and the ratios (race / draw_tokens,
multinomial / draw_tokens) are of medians from this one run. Correctness: on a small vocabulary with zero entries,
every sampler's frequencies over --check_draws draws match the probabilities (max abs error and a chi-square bound)
and no zero-probability id is ever drawn, nor in any timed call, nor on sparse rows (3 positive ids of many); a
failure stops the script. Decision rule: the race replaces draw_tokens if its best form is within 10% of draw_tokens'
time (race <= 1.10 x draw_tokens) at both shapes, for both distributions; else draw_tokens stays.

    python bench/sampler.py                  # 30 repeats; writes docs/bench_results/sampler.json, then the
                                             # docs/benchmarks.md block from it
    python bench/sampler.py --quick          # 2 repeats, small checks: a few seconds; no record unless --record
    python bench/sampler.py --render         # only rewrite the docs/benchmarks.md block from the record
    python bench/sampler.py --quick --json out.json   # the printed numbers as one JSON dict too
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
from benchutil import ROOT, add_json_flag, median, report, table, tiny_models  # noqa: E402

from gndpo_fast import draw_tokens  # noqa: E402

RECORD = os.path.join(ROOT, "docs", "bench_results", "sampler.json")
PAGE = os.path.join(ROOT, "docs", "benchmarks.md")
BLOCK = "sampler"  # the page's block: between <!-- reproduce:sampler --> and <!-- /reproduce:sampler -->
PAPER_RECIPE = os.path.join(ROOT, "recipes", "geometry3k_qwen2.5vl_3b.yaml")
PAPER_CONFIG = os.path.join(ROOT, "assets", "configs", "Qwen2.5-VL-3B-Instruct")
THRESHOLD = 1.10  # the race replaces draw_tokens at <= 1.10 x its time, at both shapes
DISTRIBUTIONS = {"flat": 1.0, "peaked": 8.0}  # name -> scale of the N(0, 1) logits
CHECK_PROBS = (0.3, 0.2, 0.15, 0.1, 0.1, 0.08, 0.05, 0.019, 0.001, 0.0)  # the last id can never be drawn


# ---------------------------------------------------------------------------------------------
# The samplers: (n, V) probabilities, generator -> (n, 1) ids
# ---------------------------------------------------------------------------------------------


def multinomial(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    return torch.multinomial(probs, 1, generator=generator)


def race(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """argmax(p / E), E ~ Exp(1): a fresh noise tensor, the division out of place."""
    return (probs / torch.empty_like(probs).exponential_(generator=generator)).argmax(-1, keepdim=True)


def race_inplace(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """The race with the quotient written over the fresh noise tensor (one (n, V) allocation, not two)."""
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return torch.div(probs, noise, out=noise).argmax(-1, keepdim=True)


class ReusedRace:
    """The in-place race on one noise buffer kept between calls (a generate() call keeps its (n, V) shape)."""

    def __init__(self):
        self.noise = None

    def __call__(self, probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        if self.noise is None or self.noise.shape != probs.shape or self.noise.dtype != probs.dtype:
            self.noise = torch.empty_like(probs)
        noise = self.noise.exponential_(generator=generator)
        return torch.div(probs, noise, out=noise).argmax(-1, keepdim=True)


RACES = ("race", "race_inplace", "race_reused")
SAMPLERS = ("multinomial", "draw_tokens", *RACES)


def samplers() -> dict:
    """name -> sampler, fresh (race_reused's buffer is its own)."""
    return {
        "multinomial": multinomial,
        "draw_tokens": draw_tokens,
        "race": race,
        "race_inplace": race_inplace,
        "race_reused": ReusedRace(),
    }


# ---------------------------------------------------------------------------------------------
# The shapes, read from the project
# ---------------------------------------------------------------------------------------------


def text_vocab_size(config) -> int:
    return getattr(config, "text_config", config).vocab_size or config.vocab_size


def default_world() -> dict:
    """n, V and the suppressed ids of the default run's sampler (Args(), 1 process, the tiny student)."""
    import transformers

    import gndpo_minimal as g

    a, processes = g.RunArgs(), 1
    rollouts = a.prompts_per_step * a.num_generations // processes
    student = tiny_models()[0]
    config = transformers.AutoConfig.from_pretrained(student)
    tokenizer = transformers.AutoTokenizer.from_pretrained(student)
    return {
        "label": "default world",
        "n": a.generation_batch_size or rollouts,
        "V": text_vocab_size(config),
        "suppressed_ids": g.vision_token_ids(tokenizer, config),
        "source": f"Args(): prompts_per_step {a.prompts_per_step} x num_generations {a.num_generations} on "
        f"{processes} process, generation_batch_size {a.generation_batch_size} (= all at once); V = "
        f"the text vocab_size of {os.path.relpath(student, ROOT)}",
    }


def paper_shape() -> dict:
    """n, V and the suppressed ids at the paper's vocabulary: Qwen2.5-VL-3B and its 24 GB recipe."""
    from types import SimpleNamespace

    import transformers
    import yaml

    import gndpo_minimal as g

    with open(PAPER_RECIPE) as f:
        recipe = yaml.safe_load(f)
    config = transformers.AutoConfig.from_pretrained(PAPER_CONFIG)
    no_tokenizer = SimpleNamespace(added_tokens_decoder={}, unk_token_id=None)  # the ids the config names
    return {
        "label": "paper's shape",
        "n": recipe["generation_batch_size"],
        "V": text_vocab_size(config),
        "suppressed_ids": g.vision_token_ids(no_tokenizer, config),
        "source": f"generation_batch_size {recipe['generation_batch_size']} of "
        f"{os.path.relpath(PAPER_RECIPE, ROOT)} (rows per generate() call; its micro_batch_size "
        f"{recipe['micro_batch_size']} is the scoring and update forwards'); V = the vocab_size of "
        f"{os.path.relpath(PAPER_CONFIG, ROOT)}",
    }


def make_probs(n: int, V: int, scale: float, suppressed: list[int], seed: int) -> torch.Tensor:
    """float32 softmax(scale * N(0, 1) logits), the suppressed ids at exactly 0 (as SampledTokenLogps makes them)."""
    logits = torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * scale
    if suppressed:
        logits[:, suppressed] = float("-inf")
    return torch.softmax(logits, -1)


# ---------------------------------------------------------------------------------------------
# Timing and checks
# ---------------------------------------------------------------------------------------------


def time_samplers(probs: torch.Tensor, repeats: int, warmup: int, seed: int) -> tuple[dict, int]:
    """({name: [seconds of each timed call]}, how many drawn ids had probability 0 over every call). Each sampler
    has a generator of its own; the timed calls go in rotation, the order shifted by one each repeat."""
    fns = samplers()
    names = list(fns)
    gens = {name: torch.Generator().manual_seed(seed + i) for i, name in enumerate(names)}
    seconds, zero_picks = {name: [] for name in names}, 0
    for r in range(warmup + repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            t0 = time.perf_counter()
            ids = fns[name](probs, gens[name])
            elapsed = time.perf_counter() - t0
            if r >= warmup:
                seconds[name].append(elapsed)
            assert ids.shape == (probs.shape[0], 1), (name, ids.shape)
            zero_picks += int((probs.gather(1, ids) <= 0).sum())
    return seconds, zero_picks


def frequency_check(
    sampler, probs: tuple[float, ...] = CHECK_PROBS, draws: int = 200_000, seed: int = 0, sigmas: float = 6.0
) -> dict:
    """Draws `draws` rows of one small distribution, 2000 a call; the frequencies against the probabilities: the largest
    absolute error (bound: `sigmas` binomial standard deviations of each id), a chi-square over the positive ids
    (bound: df + sigmas * sqrt(2 df)), and how many draws hit a zero-probability id (bound: none)."""
    p = torch.tensor(probs, dtype=torch.float64)
    p = p / p.sum()
    rows, gen = 2000, torch.Generator().manual_seed(seed)  # a call draws `rows` (draw_tokens holds rows x 1024)
    batch, counts = p.float().expand(rows, -1).contiguous(), torch.zeros(len(p), dtype=torch.float64)
    for start in range(0, draws, rows):
        ids = sampler(batch[: min(rows, draws - start)], gen)
        counts += torch.bincount(ids.flatten(), minlength=len(p)).double()
    freq, positive = counts / draws, p > 0
    error = (freq - p).abs()
    bound = sigmas * (p * (1 - p) / draws).sqrt()
    expected = draws * p[positive]
    chi2 = float(((counts[positive] - expected) ** 2 / expected).sum())
    df = int(positive.sum()) - 1
    chi2_bound = df + sigmas * math.sqrt(2 * df)
    zero_picks = int(counts[~positive].sum())
    return {
        "draws": draws,
        "max_abs_error": float(error.max()),
        "max_error_over_bound": float((error / bound)[positive].max()),
        "chi2": chi2,
        "df": df,
        "chi2_bound": chi2_bound,
        "zero_picks": zero_picks,
        "ok": bool((error[positive] <= bound[positive]).all()) and chi2 <= chi2_bound and zero_picks == 0,
    }


def sparse_check(sampler, rows: int, V: int, calls: int, seed: int = 0) -> int:
    """Drawn ids of probability 0 on rows with 3 positive entries among V (the race divides 0 by the noise
    everywhere else): how many over `calls` calls."""
    gen = torch.Generator().manual_seed(seed)
    probs = torch.zeros(rows, V)
    probs.scatter_(1, torch.randint(V, (rows, 3), generator=gen), torch.rand(rows, 3, generator=gen) + 0.01)
    probs /= probs.sum(-1, keepdim=True)
    return sum(int((probs.gather(1, sampler(probs, gen)) <= 0).sum()) for _ in range(calls))


def checks(quick: bool, seed: int) -> dict:
    draws, (rows, V, calls) = (20_000, (64, 4096, 2)) if quick else (200_000, (128, 50_000, 4))
    out = {"probs": list(CHECK_PROBS), "sparse": {"rows": rows, "V": V, "calls": calls}, "samplers": {}}
    for name, fn in samplers().items():
        out["samplers"][name] = dict(
            frequency_check(fn, draws=draws, seed=seed), sparse_zero_picks=sparse_check(fn, rows, V, calls, seed)
        )
    # on the CPU, torch.multinomial(p, 1) is the race (aten: exponential_, div, argmax after its checks): from one
    # generator state both draw the same ids
    probs = make_probs(64, 1000, 1.0, [0], seed)
    out["multinomial_is_the_race"] = bool(
        torch.equal(
            multinomial(probs, torch.Generator().manual_seed(seed)), race(probs, torch.Generator().manual_seed(seed))
        )
    )
    return out


# ---------------------------------------------------------------------------------------------
# Run, report, record
# ---------------------------------------------------------------------------------------------


def ratio_entry(seconds: dict) -> dict:
    """The medians, the ratios of medians against draw_tokens, the best race form, and each repeat's ratios."""
    med = {name: median(v) for name, v in seconds.items()}
    best = min(RACES, key=lambda name: med[name])
    draw = med["draw_tokens"]
    per_repeat = {
        name: [a / b for a, b in zip(seconds[name], seconds["draw_tokens"])] for name in ("multinomial", best, *RACES)
    }
    return {
        "seconds": med,
        "runs_seconds": seconds,
        "best_race": best,
        "ratios": {
            "race / draw_tokens": med["race"] / draw,
            "best race / draw_tokens": med[best] / draw,
            "multinomial / draw_tokens": med["multinomial"] / draw,
            **{f"{name} / draw_tokens": med[name] / draw for name in RACES},
        },
        "per_repeat_ratios": {f"{name} / draw_tokens": v for name, v in per_repeat.items()},
    }


def decide(shapes: dict) -> dict:
    cells = {
        f"{s['label']}, {dist}": d["ratios"]["best race / draw_tokens"]
        for s in shapes.values()
        for dist, d in s["distributions"].items()
    }
    replaces = all(r <= THRESHOLD for r in cells.values())
    worst = max(cells, key=cells.get)
    text = (
        (
            f"the race replaces draw_tokens: its best form is within {THRESHOLD:.2f}x of draw_tokens' time at "
            f"every shape (worst: {worst}, {cells[worst]:.2f}x)"
        )
        if replaces
        else (
            f"draw_tokens stays (an optional speed-up, --fast_sampler): the race's best form takes "
            f"{cells[worst]:.2f}x draw_tokens' time at {worst}, over the {THRESHOLD:.2f}x the rule allows"
        )
    )
    return {
        "rule": f"the race replaces draw_tokens if best race time <= {THRESHOLD:.2f} x draw_tokens time at both "
        "shapes, both distributions",
        "threshold": THRESHOLD,
        "best_race_ratios": cells,
        "race_replaces_draw_tokens": replaces,
        "text": text,
    }


def run(
    quick: bool = False, repeats: int | None = None, warmup: int | None = None, threads: int = 2, seed: int = 0
) -> dict:
    default_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    repeats = repeats or (2 if quick else 30)
    warmup = (0 if quick else 5) if warmup is None else warmup
    out = {
        "threads": torch.get_num_threads(),
        "torch_threads_default": default_threads,
        "repeats": repeats,
        "warmup": warmup,
        "seed": seed,
        "noise_dtype": "float32, the probabilities' dtype (one variant)",
        "samplers": list(SAMPLERS),
        "races": list(RACES),
        "shapes": {},
    }
    for key, shape in (("default_world", default_world()), ("paper_shape", paper_shape())):
        shape["distributions"] = {}
        for dist, scale in DISTRIBUTIONS.items():
            probs = make_probs(shape["n"], shape["V"], scale, shape["suppressed_ids"], seed)
            seconds, zero_picks = time_samplers(probs, repeats, warmup, seed)
            entropy = float(-(probs * probs.clamp_min(1e-30).log()).sum(-1).mean())
            shape["distributions"][dist] = dict(
                logit_scale=scale, entropy_nats=entropy, zero_picks=zero_picks, **ratio_entry(seconds)
            )
        out["shapes"][key] = shape
    out["check"] = checks(quick, seed)
    out["decision"] = decide(out["shapes"])
    return out


def rows_of(out: dict) -> list[list]:
    rows = []
    for s in out["shapes"].values():
        for dist, d in s["distributions"].items():
            r = d["ratios"]
            rows.append(
                [
                    s["label"],
                    f"{s['n']} x {s['V']}",
                    dist,
                    f"{r['race / draw_tokens']:.2f}x",
                    f"{r['best race / draw_tokens']:.2f}x ({d['best_race']})",
                    f"{r['multinomial / draw_tokens']:.2f}x",
                ]
            )
    return rows


HEADERS = [
    "shape",
    "n x V",
    "distribution",
    "race / draw_tokens",
    "best race form / draw_tokens",
    "multinomial / draw_tokens",
]


def check_failures(out: dict) -> list[str]:
    bad = [
        f"{name}: frequencies or zero-probability ids off ({c})"
        for name, c in out["check"]["samplers"].items()
        if not c["ok"] or c["sparse_zero_picks"]
    ]
    bad += [
        f"{s['label']}, {dist}: {d['zero_picks']} zero-probability ids drawn"
        for s in out["shapes"].values()
        for dist, d in s["distributions"].items()
        if d["zero_picks"]
    ]
    return bad


def print_report(out: dict, json_path: str | None, verbose: bool) -> dict:
    c = out["check"]
    check_rows = [
        [
            name,
            f"{v['max_abs_error']:.1e}",
            f"{v['max_error_over_bound']:.2f}",
            f"{v['chi2']:.1f} / {v['chi2_bound']:.1f}",
            v["zero_picks"] + v["sparse_zero_picks"],
            "ok" if v["ok"] and not v["sparse_zero_picks"] else "FAILED",
        ]
        for name, v in c["samplers"].items()
    ]
    timed = [
        [
            name,
            *(f"{1e3 * d['seconds'][name]:.3f}" for s in out["shapes"].values() for d in s["distributions"].values()),
        ]
        for name in SAMPLERS
    ]
    columns = [f"{s['label']} {dist} ms" for s in out["shapes"].values() for dist in s["distributions"]]
    return report(
        out,
        [
            f"token samplers on (n, V) float32 probabilities, {out['threads']} torch thread(s); time = median of "
            f"{out['repeats']} calls after {out['warmup']} warm-up, samplers in rotation; ratios of medians",
            (HEADERS, rows_of(out)),
            *(f"- {s['label']}: n = {s['n']}, V = {s['V']} ({s['source']})" for s in out["shapes"].values()),
            "",
            "medians (ms; absolute times on a shared machine say little, the ratios above are the result):",
            (["sampler", *columns], timed),
            "",
            f"exactness: {c['samplers']['race']['draws']} draws of {len(c['probs'])} ids (one at probability 0); "
            f"sparse rows {c['sparse']['rows']} x {c['sparse']['V']} with 3 positive ids, {c['sparse']['calls']} calls",
            (
                ["sampler", "max abs error", "error / 6-sigma bound", "chi2 / bound", "zero-probability picks", ""],
                check_rows,
            ),
            "",
            f"decision ({out['decision']['rule']}): {out['decision']['text']}",
        ],
        json_path,
        verbose,
    )


def machine(threads: int) -> dict:
    """reproduce.machine()'s fields, the threads being those this script set (not a fresh process's)."""
    import reproduce

    return {
        "cores": os.cpu_count(),
        "cpu_model": reproduce.cpu_model(),
        "isa": reproduce.cpu_isa(),
        "threads": {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"), "torch_num_threads": threads},
        "torch_threads_default": torch.get_num_threads(),
        "load_average_before": list(os.getloadavg()),
        "platform": platform.platform(),
    }


def write_record(out: dict, path: str, command: str, seconds: float, before: dict) -> dict:
    """The result as bench/reproduce.py records one: commit, clean, command, machine, date, seconds, rounds, result."""
    import reproduce

    record = {
        "name": "sampler",
        "commit": reproduce.git("rev-parse", "HEAD"),
        "clean": reproduce.code_is_clean(),
        "command": command,
        "machine": before,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "seconds": seconds,
        "rounds": {
            key: {dist: d["runs_seconds"] for dist, d in s["distributions"].items()} for key, s in out["shapes"].items()
        },
        "result": out,
    }
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:  # as reproduce.py writes its records
        json.dump(record, f, indent=1)
        f.write("\n")
    return record


def render(record: dict) -> str:
    """The page's block from the record: the ratios, the decision, where they were measured."""
    import reproduce

    res, m = record["result"], record["machine"]

    def cell(d: dict, key: str, name: str) -> str:
        """A ratio of medians, then the range of the repeats' ratios."""
        values = d["per_repeat_ratios"][f"{name} / draw_tokens"]
        return f"{d['ratios'][key]:.2f}x ({min(values):.2f}-{max(values):.2f})"

    rows = [
        [
            s["label"],
            f"{s['n']} x {s['V']}",
            dist,
            cell(d, "race / draw_tokens", "race"),
            f"{cell(d, 'best race / draw_tokens', d['best_race'])}, `{d['best_race']}`",
            cell(d, "multinomial / draw_tokens", "multinomial"),
        ]
        for s in res["shapes"].values()
        for dist, d in s["distributions"].items()
    ]
    headers = [
        "shape",
        "n x V",
        "distribution",
        "race / draw_tokens (per repeat)",
        "best race form / draw_tokens",
        "multinomial / draw_tokens",
    ]
    checked, threads = res["check"]["samplers"], res["threads"]
    exact = "every sampler's" if not check_failures(res) else "NOT every sampler's (see the JSON)"
    same = "draws" if res["check"]["multinomial_is_the_race"] else "does NOT draw"
    return "\n".join(
        [
            table(headers, rows),
            "",
            f"Medians of {res['repeats']} calls after {res['warmup']} warm-up, samplers in rotation, {threads} torch "
            f"thread{'' if threads == 1 else 's'}. Exactness: over {checked['race']['draws']} draws, {exact} "
            f"frequencies are within 6 standard deviations of the probabilities (the race's largest error: "
            f"{checked['race']['max_abs_error']:.1e}) with no zero-probability id drawn; `torch.multinomial` {same} "
            f"the race's ids from the same generator state.",
            "",
            f"**Decision:** {res['decision']['text']}.",
            "",
            f"*`python bench/sampler.py` remakes `docs/bench_results/sampler.json` and this block; commit "
            f"{record['commit'][:7]}{'' if record['clean'] else ' (uncommitted changes)'} on {record['date'][:10]}; "
            f"{m['cores']} cores ({m['cpu_model']}; {reproduce.isa_text(m)}; {reproduce.threads_text(m)}); load "
            f"average {m['load_average_before'][0]:.1f} at the start; a machine that may be shared with other jobs.*",
        ]
    )


def render_page(record: dict, page: str = PAGE) -> bool:
    """Rewrites the page's block from the record; False where the page has no such block."""
    with open(page) as f:
        text = f.read()
    start_mark, end_mark = f"<!-- reproduce:{BLOCK} -->\n", f"<!-- /reproduce:{BLOCK} -->"
    if start_mark not in text:
        return False
    start = text.index(start_mark) + len(start_mark)
    end = text.index(end_mark, start)
    with open(page, "w") as f:
        f.write(text[:start] + render(record) + "\n" + text[end:])
    return True


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="2 timed calls, no warm-up, small checks: a few seconds.")
    p.add_argument("--repeats", type=int, help="Timed calls per sampler (default 30; 2 with --quick).")
    p.add_argument("--warmup", type=int, help="Untimed calls per sampler first (default 5; 0 with --quick).")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2).")
    p.add_argument("--seed", type=int, default=0)
    add_json_flag(p)
    p.add_argument(
        "--record",
        metavar="PATH",
        help="Write the record (commit, machine, date, rounds, result) here "
        f"(default {os.path.relpath(RECORD, ROOT)}, none with --quick; '' for none).",
    )
    p.add_argument("--render", action="store_true", help="Only rewrite docs/benchmarks.md's block from the record.")
    a = p.parse_args(argv)
    if a.render:
        with open(a.record or RECORD) as f:
            record = json.load(f)
        print("rewrote", PAGE if render_page(record) else f"nothing: {PAGE} has no {BLOCK} block")
        return record["result"]
    before = machine(a.threads)
    t0 = time.time()
    out = run(a.quick, a.repeats, a.warmup, a.threads, a.seed)
    print_report(out, a.json, verbose=True)
    failures = check_failures(out)
    assert not failures, "a sampler is not exact: " + "; ".join(failures)
    record_path = a.record if a.record is not None else None if a.quick else RECORD  # "": none
    if record_path:
        command = " ".join(["python", "bench/sampler.py", *(argv if argv is not None else sys.argv[1:])])
        record = write_record(out, record_path, command, time.time() - t0, before)
        if os.path.abspath(record_path) == RECORD and render_page(record):
            print("rewrote", PAGE)
    return out


if __name__ == "__main__":
    main()
