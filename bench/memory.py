"""Memory of each phase of one GNDPO step, measured, against estimate_memory.py's estimate of the same run.

    python bench/memory.py                     # tiny models and the larger stand-in, LoRA and full fine-tuning,
                                               # each prompt read once or not (docs/bench_results/memory.json)
    python bench/memory.py --quick --json out.json   # the tiny models only (seconds)

What is measured: torch's profiler with profile_memory=True records every allocation and free of the CPU
allocator; a phase's figure is the peak of their running sum while the phase runs, that is the bytes the phase adds
above what was resident when it started (weights, optimizer state, the step's rollouts). The phases are main()'s
own calls, set up by main()'s set-up functions (bench/step_breakdown.py's setup_step):
  check     PrefixSharing.run_checks, the first step's start-up checks (--share_prompt_prefix only)
  rollout   sample_rollouts over the step's prompts
  scoring   the teacher's log-probs of every micro-batch (Models.teacher_logps_of, no grad)
  update    update_student, after a first step has made AdamW's state (resident from then on)
The estimate is estimate_memory.estimate on the same Args with device "cpu" (float32, no CUDA context, pixels on the
host) and the measured step's own lengths (its longest prompt and response), each phase_* likewise above resident.

Workloads: the tiny models (assets/tiny) and a larger random stand-in, the tiny pair with its vocabulary padded
(bench/benchutil.padded_models) so that the student has over 50M parameters, images resized to 448 x 448
(256 image tokens a prompt) and responses of 128 tokens; each with LoRA and full fine-tuning (--lora_r 0), each
prompt read once (--share_prompt_prefix) or not.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
from benchutil import add_json_flag, padded_models, report, tiny_models  # noqa: E402
from step_breakdown import setup_step  # noqa: E402

import gndpo_minimal as g  # noqa: E402
from estimate_memory import estimate  # noqa: E402

PHASES = ("check", "rollout", "scoring", "update")
STAND_IN_VOCAB = 400_000  # the tiny student's 128-wide tied embedding: 51M parameters
WHY_BAND = (0.75, 1.25)  # a stand-in phase outside it says why


def live_peak(fn):
    """(fn(), the peak bytes the CPU allocator held above its level when fn started, by the profiler's records)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        if e.device_type() == torch.device("cpu").type or str(e.device_type()).endswith("CPU"):
            live += e.nbytes()
            peak = max(peak, live)
    return out, peak


def measure(args: g.Args) -> dict:
    """Measured and estimated bytes of each phase of one step of the run `args` describes."""
    setup = setup_step(args, log=lambda msg: None)
    models, acc = setup["models"], setup["accelerator"]
    measured = {}
    sharing = models.sampling.sharing
    if sharing is not None:  # the checks run inside the first step's sample_rollouts
        run_checks = sharing.run_checks

        def checked(*a, **k):
            ok, measured["check"] = live_peak(lambda: run_checks(*a, **k))
            return ok
        sharing.run_checks = checked
    step = lambda i: g.step_prompts(setup["train_ds"], setup["train_keep"], args, i)  # noqa: E731
    batch = g.generate_and_score(models, step(0), args, log=lambda msg: None)  # the checks; then AdamW's state
    g.update_student(models, setup["optimizer"], setup["scheduler"], acc, batch, args, log=lambda msg: None)

    prompts = step(1)
    rollouts, measured["rollout"] = live_peak(lambda: g.sample_rollouts(models, prompts, args))
    del rollouts
    batch = g.generate_and_score(models, prompts, args, log=lambda msg: None)  # the same rollouts (the step's seed)
    with torch.no_grad():
        _, measured["scoring"] = live_peak(lambda: [models.teacher_logps_of(r) for r in batch.rollouts])
    _, measured["update"] = live_peak(lambda: g.update_student(models, setup["optimizer"], setup["scheduler"], acc,
                                                               batch, args, log=lambda msg: None))
    # the longest prompt: from every row's batch, or the distinct prompts' where each prompt is read once
    prompt = max(int((r.row_inputs or r.prompt_inputs)["attention_mask"].sum(1).max()) for r in batch.rollouts)
    response = max(r.response_ids.shape[1] for r in batch.rollouts)
    e = estimate(args, device="cpu", lengths=(prompt, response))
    out = {"prompt_tokens": prompt, "response_tokens": response, "student_params": e["student_params"],
           "phases": {}}
    for phase in PHASES:
        if phase in measured:
            est = e[f"phase_{phase}"]
            out["phases"][phase] = {"estimated_bytes": int(est), "measured_bytes": int(measured[phase]),
                                    "ratio": round(est / measured[phase], 3) if measured[phase] else None}
    return out


def workloads(quick: bool, tmp: str) -> dict[str, g.Args]:
    """{name: Args}: the tiny models (names with `tiny`) and, unless quick, the larger stand-in."""
    student, teacher, _ = tiny_models()
    data = g.Args().dataset_name  # the tiny task's dataset on disk
    base = dict(dataset_name=data, prompts_per_step=4, num_generations=4, max_steps=2, save_steps=0,
                num_eval_samples=0, output_dir=os.path.join(tmp, "run"), overwrite_output_dir=True, logging_steps=0)
    out = {}
    models = {"tiny": (student, teacher, dict(micro_batch_size=16))}
    if not quick:
        s, t = padded_models(student, teacher, STAND_IN_VOCAB, os.path.join(tmp, "stand_in"), image_pixels=448 * 448)
        models["stand_in"] = (s, t, dict(micro_batch_size=8, max_new_tokens=128, min_new_tokens=128,
                                         prompts_per_step=2))
    for name, (s, t, changes) in models.items():
        for train, lora_r in (("lora", 16), ("full", 0)):
            for share in (True, False):
                key = f"{name}_{train}_{'shared' if share else 'plain'}"
                out[key] = g.Args(**{**base, "student_model": s, "teacher_model": t, "lora_r": lora_r,
                                     "learning_rate": 1e-3 if lora_r else 1e-4, "share_prompt_prefix": share,
                                     **changes})
    return out


def run(quick: bool = False) -> dict:
    torch.set_num_threads(1)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, args in workloads(quick, tmp).items():
            results[name] = measure(args)
            print(name, {p: v["ratio"] for p, v in results[name]["phases"].items()}, flush=True)
    for name, r in results.items():
        if "tiny" in name:
            continue
        for phase, v in r["phases"].items():
            if v["ratio"] is None or not WHY_BAND[0] <= v["ratio"] <= WHY_BAND[1]:
                v["why"] = WHY[phase]
    return results


# Why a stand-in phase's estimate can fall outside WHY_BAND: where the estimate is a bound, not a count
WHY = {
    "rollout": "the estimate counts SAMPLER_COPIES (6) float32 (rows, V) rows for one sampling step, most of the "
               "phase's estimate at a 400,000-token vocabulary; SampledTokenLogps, called on generate()'s copy of "
               "the scores, holds 3 such rows at once (measured alone), and the sampler that reads each prompt once "
               "holds fewer, so the bound overstates the phase",
    "scoring": "the estimate counts the teacher forward's widest layer for all rows of a micro-batch, with a 4-bit "
               "teacher's dequantized layer on top; the measured peak is the LM head's chunk, after the layers "
               "have freed their working sets",
    "check": "the estimate is the largest of the checks' forwards at full check length, each a bound as in the "
             "rollout and scoring phases",
    "update": "the estimate counts every layer's saved tensors at their largest sizes (the widest of a block's "
              "inputs for each), a bound on what autograd keeps",
}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the tiny models only")
    add_json_flag(p)
    a = p.parse_args(argv)
    results = run(a.quick)
    headers = ["workload", "phase", "estimated MiB", "measured MiB", "estimate / measured"]
    rows = [[name, phase, f"{v['estimated_bytes'] / 2**20:.1f}", f"{v['measured_bytes'] / 2**20:.1f}", v["ratio"]]
            for name, r in results.items() for phase, v in r["phases"].items()]
    return report({"workloads": results}, [(headers, rows)], a.json)


if __name__ == "__main__":
    main()
