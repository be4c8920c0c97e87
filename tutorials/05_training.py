# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 5. Training: a short OPD run and a short GNDPO run, side by side
#
# Everything from the previous notebooks, in a loop. `main()` sets up once with `setup(args)` (accelerator, models and
# their `Models` bundle, data, optimizer: a `Run`) and then, every step, calls the step's four functions: `step_prompts`
# (the step's rows, each repeated G times, and the step's seed: a `StepPrompts`), `generate_and_score`
# (`sample_rollouts` then `score_rollouts`: rollouts, teacher scores, advantages: a `ScoredBatch`, notebooks 2-4),
# `update_student` (one GSPO update of the LoRA adapter per batch by default) and `step_metrics` (the line of
# `metrics.jsonl`). Here we call `main()` itself twice with small settings, once with plain OPD advantages
# (`advantage_mode="none"`) and once with GNDPO's global normalization (`"global"`), the same seed and the same prompts,
# then read the `metrics.jsonl` each run writes (one line per step).
#
# The settings are tiny so that the notebook runs in about a minute on a laptop CPU: a demonstration of what to
# look at, not a benchmark: the default run (`accelerate launch gndpo_minimal.py`) takes more and larger steps.

# %%
import contextlib
import io
import json
import os

from tutorials.notebook_setup import ROOT, quiet_outputs

quiet_outputs()  # before the imports below: no progress bars or harmless warnings in the outputs

import matplotlib.pyplot as plt
import pandas as pd
from matplotlib.ticker import MaxNLocator

from gndpo_minimal import RunArgs, main

settings = dict(
    max_steps=20,  # optimizer steps
    prompts_per_step=8,  # B (the default is 32)
    num_generations=4,  # G
    micro_batch_size=32,  # all B x G sequences in one forward pass
    max_train_samples=256,  # the first 256 rows of the train split on disk: the rows prompts are drawn from
    num_eval_samples=64,  # the first 64 rows of the test split, for greedy accuracy ...
    eval_steps=5,  # ... measured every 5 steps
    save_steps=0,  # only the final checkpoint
)
defaults = RunArgs()  # everything not in `settings` keeps the script's default
print(
    f"student {os.path.relpath(defaults.student_model, ROOT)}, "
    f"teacher {os.path.relpath(defaults.teacher_model, ROOT)} (4-bit: {defaults.teacher_4bit}), "
    f"LoRA r={defaults.lora_r}, learning rate {defaults.learning_rate:g}, "
    f"max_grad_norm {defaults.max_grad_norm:g}, loss {defaults.loss_type}"
)


def train(mode):
    """Runs gndpo_minimal.main() with the given advantage mode; returns (summary, per-step metrics)."""
    out = os.path.join(ROOT, "runs", "tutorial", mode)  # runs/ is git-ignored
    log, progress = io.StringIO(), io.StringIO()  # main()'s metrics lines (every logging_steps): kept out of the page
    try:
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(progress):
            summary = main(RunArgs(advantage_mode=mode, output_dir=out, overwrite_output_dir=True, **settings))
    except Exception:
        print(log.getvalue()[-4000:], progress.getvalue()[-4000:], sep="\n")
        raise
    lines = [line.replace(ROOT + os.sep, "") for line in log.getvalue().splitlines() if not line.startswith("step=")]
    print("\n".join(lines))
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return summary, pd.DataFrame([json.loads(line) for line in f])


# %% [markdown]
# ## Plain OPD: advantages = clamped scores

# %%
opd_summary, opd = train("none")

# %% [markdown]
# ## GNDPO: advantages = scores whitened over the whole batch

# %%
gndpo_summary, gndpo = train("global")

# %% [markdown]
# ## What the runs logged
#
# Each line of `metrics.jsonl` is one step. The columns read here:
# * `reverse_kl`: the mean of `student_lp - teacher_lp` over the sampled tokens, a one-sample estimate of
#   KL(student || teacher) on the student's own samples: the quantity distillation drives down;
# * `grad_norm`: the LoRA gradient's norm **before** clipping to `max_grad_norm` (the mean over the step's
#   updates; one update per step here);
# * `clip_frac` and `logp_mismatch`: with one update per rollout batch (`steps_per_generation` and
#   `num_iterations` at 1) the importance ratio is exactly 1, so the clip never acts and `clip_frac` stays 0;
#   `logp_mismatch` is the gap between the log-probs recorded while sampling and the training forward's
#   (notebook 2), about 0 when the scoring inputs are right;
# * `eval_accuracy`: greedy accuracy on the held-out rows, every `eval_steps` steps (before and after training
#   it is in `summary.json`).

# %%
gndpo[
    [
        "step",
        "reverse_kl",
        "score_mean",
        "score_std",
        "score_clamped_frac",
        "adv_std",
        "grad_norm",
        "clip_frac",
        "logp_mismatch",
        "response_length",
    ]
].head(8).round(4)


# %%
def accuracy_curve(summary, metrics):
    """(steps, accuracies): before training, every eval_steps, and after training."""
    evals = metrics.dropna(subset=["eval_accuracy"]) if "eval_accuracy" in metrics else metrics.iloc[:0]
    steps = [0, *evals["step"], summary["steps"]]
    return steps, [summary["student_accuracy_before"], *evals["eval_accuracy"], summary["student_accuracy_after"]]


runs = {"OPD (none)": (opd_summary, opd, "#c44e52"), "GNDPO (global)": (gndpo_summary, gndpo, "#4c72b0")}
fig, axes = plt.subplots(1, 3, figsize=(16, 4.3))
for label, (summary, metrics, color) in runs.items():
    axes[0].plot(metrics["step"], metrics["reverse_kl"], "o-", ms=3, color=color, label=label)
    axes[1].plot(metrics["step"], metrics["grad_norm"], "o-", ms=3, color=color, label=label)
    axes[2].plot(*accuracy_curve(summary, metrics), "o-", color=color, label=label)
axes[0].set_title("Reverse KL(student || teacher) on the sampled tokens")
axes[0].set_ylabel("reverse KL (nats per token)")
axes[1].axhline(defaults.max_grad_norm, color="black", ls="--", lw=1, label="clipped to this")
axes[1].set_yscale("log")
axes[1].set_title("Gradient norm before clipping")
axes[1].set_ylabel("pre-clip gradient norm")
axes[2].axhline(opd_summary["teacher_accuracy"], color="grey", ls=":", label="teacher")
axes[2].set_ylim(-0.02, 1.02)
axes[2].set_title(f"Greedy accuracy on {settings['num_eval_samples']} held-out rows")
axes[2].set_ylabel("accuracy")
for ax in axes:
    ax.set_xlabel("optimizer step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(fontsize=9)
fig.tight_layout()
plt.show()

# %%
pd.DataFrame(
    {
        label: {
            "teacher accuracy": summary["teacher_accuracy"],
            "student accuracy before": summary["student_accuracy_before"],
            "student accuracy after": summary["student_accuracy_after"],
            "reverse KL, first 5 steps": metrics["reverse_kl"].head(5).mean(),
            "reverse KL, last 5 steps": metrics["reverse_kl"].tail(5).mean(),
            "grad norm median": metrics["grad_norm"].median(),
            "grad norm max / median": metrics["grad_norm"].max() / metrics["grad_norm"].median(),
            "steps clipped (grad norm > max_grad_norm)": int((metrics["grad_norm"] > defaults.max_grad_norm).sum()),
        }
        for label, (summary, metrics, _) in runs.items()
    }
).round(3)

# %% [markdown]
# **What just happened and why it matters.** Both runs drew the same prompts with the same seed and differ only
# in how scores become advantages. Twenty steps of 8 prompts already move greedy accuracy on the 64 held-out rows
# (see the table; one seed, so a few rows either way are noise), while the reverse KL swings from step to step
# with the 8 prompts each step draws (both runs draw the same ones, so they swing together): over so few steps
# its trend is hidden in that noise. The default run's 90 steps of 32 prompts bring it from about 1 to under 0.1
# (`docs/bench_results/default_run.json`).
#
# On this task the two modes behave alike. Responses are 6 tokens and the clamp at +-5 bounds every score, so the raw
# scores already have a standard deviation of about 1 to 1.5 (`score_std` above) and whitening changes their scale by
# less than 2x; the grad norms differ in level (GNDPO's advantages have unit variance in every batch), and neither
# run needed clipping here. GNDPO's point is that the size of an update should not follow the raw scores: OPD's
# advantages are the scores themselves, so a batch with many outlier tokens makes its gradient larger, while
# whitening divides every batch's scores by their own standard deviation. These two runs hold no such batch: in the
# plot the two grad norms rise and fall together, step for step, GNDPO's mostly the lower and both below the clip,
# so they cannot show GNDPO holding where OPD grows. [The OPD vs GNDPO study](../docs/studies/README.md) compares
# the two with a student that is confidently wrong (over three seeds, OPD's median grad norm is about twice GNDPO's
# and its largest one 1.6-2.2 against GNDPO's 0.9-1.3: `docs/studies/opd_vs_gndpo_confident.md`) and over three
# seeds with the default settings (`python studies/compare_opd_gndpo.py` reruns it);
# `docs/studies/outlier_interaction.md` tests, registered before its runs, whether outliers enlarge OPD's update
# more than GNDPO's.
#
# From here: `python gndpo_minimal.py --help` lists every setting; `--steps_per_generation` and `--num_iterations`
# make several updates per rollout batch, where the ratio moves away from 1 and `clip_frac` shows the clip acting;
# and the files in `recipes/` train real Qwen2.5-VL and InternVL3.5 students on Geometry3K with the same script.
