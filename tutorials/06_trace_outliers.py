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
# # 6. Outlier states inside reasoning traces: OPD and GNDPO on the trace world
#
# On the default task answers are 6 tokens, so every token is an answer token. GNDPO was built for long reasoning
# traces in which most tokens are agreed on and a few are far off: the *outlier states*. The trace variant of the
# tiny world ([docs/world.md](../docs/world.md#the-trace-variant-long-answers-with-outlier-states-inside)) answers
# each question with a trace of about 37 tokens, then the box:
# `<think>I look at the image. I see three shapes. They are red circles. ...</think>\boxed{red}`. Its student names
# colors and shapes wrongly wherever they appear in the trace, so its disagreements with the teacher sit at a few
# positions in the middle of long, otherwise agreed-on answers.
#
# This notebook runs `main()` twice on that world, once with plain OPD advantages (`advantage_mode="none"`: the
# clamped scores themselves) and once with GNDPO's (`"global"`: the scores whitened over every token of the
# batch), the same seed and prompts. Through `main()`'s hooks it records, at the start, middle and end of
# training, the exact scores and advantages each step used, and shows:
# * the training curves (reverse KL, pre-clip grad norm, response length, greedy accuracy);
# * the advantage distributions of both modes at the three points;
# * the per-token scores of one trace drawn over its text, so the outlier states are visible where they sit.
#
# The settings are small (30 steps of 16 prompts) so that the notebook runs in about two minutes on 2 CPU cores;
# [the study](../docs/studies/README.md) runs 4 modes x 3 seeds for longer.

# %%
import contextlib
import io
import json
import os

from tutorials.notebook_setup import ROOT, quiet_outputs

quiet_outputs()  # before the imports below: no progress bars or harmless warnings in the outputs

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator
from transformers import AutoTokenizer

from gndpo_minimal import RunArgs, distill_scores, main, pad_cat, policy_loss, response_logps
from tutorials.plotting import token_label  # display helpers

TRACE = os.path.join(ROOT, "assets", "trace")
STEPS = int(os.environ.get("TUTORIAL_STEPS", 30))  # the test suite runs the notebook shorter (6 steps)
settings = dict(
    student_model=os.path.join(TRACE, "student"),
    teacher_model=os.path.join(TRACE, "teacher"),
    dataset_name=os.path.join(TRACE, "data"),
    max_new_tokens=38,  # the traces' longest (assets/trace/world.json)
    require_think=True,  # well-formed = <think>...</think> then \boxed{}
    max_steps=STEPS,  # optimizer steps
    prompts_per_step=16,  # B (the default is 32)
    num_generations=4,  # G
    micro_batch_size=64,  # all B x G sequences in one forward pass
    num_eval_samples=64,  # the first 64 rows of the test split, for greedy accuracy ...
    eval_steps=STEPS // 3,  # ... measured three times
    save_steps=0,  # only the final checkpoint
)
CAPTURED = (1, settings["max_steps"] // 2, settings["max_steps"])  # start, middle, end
tokenizer = AutoTokenizer.from_pretrained(settings["student_model"])
eos_ids = {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")}
defaults = RunArgs()
print(
    f"trace world: B = {settings['prompts_per_step']} prompts x G = {settings['num_generations']} samples per step, "
    f"{settings['max_steps']} steps, learning rate {defaults.learning_rate:g}, "
    f"score clamp +-{defaults.score_clip:g}, max_grad_norm {defaults.max_grad_norm:g}; capturing steps {CAPTURED}"
)

# %% [markdown]
# ## Recording what each step used
#
# `main(args, on_step, teacher_forward, loss_fn)` has three hooks: `on_step(step)` is called before each step with its
# number; `teacher_forward(teacher, rollout, ignore_ids)` replaces the teacher's scoring call and receives every
# micro-batch as a `Rollout` (its sampled `response_ids`, `response_mask`, the student's `sampled_logps` and the encoded
# prompts); and `loss_fn(logps, old_logps, advantages, mask, ...)` is the policy loss, which receives the advantages
# that `generate_and_score` computed for that micro-batch. Wrapping the last two around the script's own
# `response_logps` (the plain forward: without the hook, the run uses gndpo_fast.py's lean forward, `--lean_logps auto`,
# the same log-probs without the full (n, R, V) float32 logits, or the forward that reads each prompt once only where a
# check on the first step found it equal) and `policy_loss` changes nothing in the run and lets us keep, at the captured
# steps, the tokens, their scores (recomputed from the same log-probs with the script's `distill_scores`) and the
# advantages exactly as the update saw them.


# %%
def train(mode):
    """Runs gndpo_minimal.main() with the given advantage mode; returns (summary, per-step metrics, captures).

    captures[step] = dict of (n, R) tensors: ids, mask, scores, advantages (all micro-batches of the step)."""
    now, raw = {"step": 0}, {}

    def on_step(step):
        now["step"] = step

    def recording_teacher_forward(teacher, rollout, ignore_ids):
        teacher_lp = response_logps(teacher, rollout, ignore_ids)
        if now["step"] in CAPTURED:
            kept = {k: getattr(rollout, k).cpu() for k in ("response_ids", "response_mask", "sampled_logps")}
            raw.setdefault(now["step"], {"micro_batches": [], "advantages": []})["micro_batches"].append(
                kept | {"teacher": teacher_lp.cpu()}
            )
        return teacher_lp

    def recording_loss(logps, old_logps, advantages, mask, *rest):
        if now["step"] in CAPTURED:
            raw[now["step"]]["advantages"].append(advantages.detach().cpu())
        return policy_loss(logps, old_logps, advantages, mask, *rest)

    out = os.path.join(ROOT, "runs", "tutorial_trace", mode)  # runs/ is git-ignored
    log, progress = io.StringIO(), io.StringIO()  # main()'s metrics lines and warnings: kept out of the page
    try:
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(progress):
            summary = main(
                RunArgs(advantage_mode=mode, output_dir=out, overwrite_output_dir=True, **settings),
                on_step=on_step,
                teacher_forward=recording_teacher_forward,
                loss_fn=recording_loss,
            )
    except Exception:
        print(log.getvalue()[-4000:], progress.getvalue()[-4000:], sep="\n")
        raise
    print(
        f"{mode}: teacher accuracy {summary['teacher_accuracy']:.3f}; "
        f"student {summary['student_accuracy_before']:.3f} "
        f"-> {summary['student_accuracy_after']:.3f} (format {summary['student_format_rate_after']:.3f}) on "
        f"{settings['num_eval_samples']} held-out rows, {summary['wall_seconds']:.0f} s"
    )
    captures = {}
    for step, r in raw.items():
        cat = lambda key, r=r: pad_cat([c[key] for c in r["micro_batches"]])  # micro-batches -> (n, R)
        mask = cat("response_mask")
        captures[step] = {
            "ids": cat("response_ids"),
            "mask": mask.bool(),
            "advantages": pad_cat(r["advantages"]),
            "scores": distill_scores(cat("teacher"), cat("sampled_logps"), mask, defaults.score_clip),
        }
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return summary, pd.DataFrame([json.loads(line) for line in f]), captures


# %% [markdown]
# ## Plain OPD: advantages = clamped scores

# %%
opd_summary, opd, opd_cap = train("none")

# %% [markdown]
# ## GNDPO: advantages = scores whitened over the whole batch

# %%
gndpo_summary, gndpo, gndpo_cap = train("global")
same = torch.equal(opd_cap[1]["ids"], gndpo_cap[1]["ids"])
print(f"step 1 sampled the same tokens in both runs (same seed, same starting student): {same}")
print(
    "OPD's advantages are its clamped scores:",
    all(torch.equal(c["advantages"] * c["mask"], c["scores"]) for c in opd_cap.values()),
)

# %% [markdown]
# ## Training curves
#
# `score_clamped_frac` is the share of sampled tokens whose score sits at the clamp (|teacher - student| >= 5):
# the outlier states. The dashed line in the grad-norm panel is `max_grad_norm`: a step above it is cut back.


# %%
def accuracy_curve(summary, metrics):
    """(steps, accuracies): before training, every eval_steps, and after training."""
    evals = metrics.dropna(subset=["eval_accuracy"]) if "eval_accuracy" in metrics else metrics.iloc[:0]
    return [0, *evals["step"], summary["steps"]], [
        summary["student_accuracy_before"],
        *evals["eval_accuracy"],
        summary["student_accuracy_after"],
    ]


runs = {"OPD (none)": (opd_summary, opd, "#c44e52"), "GNDPO (global)": (gndpo_summary, gndpo, "#4c72b0")}
fig, axes = plt.subplots(1, 5, figsize=(21, 3.9))
for label, (summary, metrics, color) in runs.items():
    axes[0].plot(metrics["step"], metrics["reverse_kl"], "o-", ms=3, color=color, label=label)
    axes[1].plot(metrics["step"], metrics["grad_norm"], "o-", ms=3, color=color, label=label)
    axes[2].plot(metrics["step"], metrics["score_clamped_frac"], "o-", ms=3, color=color, label=label)
    axes[3].plot(metrics["step"], metrics["response_length"], "o-", ms=3, color=color, label=label)
    axes[4].plot(*accuracy_curve(summary, metrics), "o-", color=color, label=label)
axes[0].set(title="Reverse KL on the sampled tokens", ylabel="nats per token")
axes[1].axhline(defaults.max_grad_norm, color="black", ls="--", lw=1, label="max_grad_norm")
axes[1].set(title="Gradient norm before clipping", ylabel="pre-clip grad norm", yscale="log")
axes[2].set(title="Tokens at the score clamp", ylabel="share of sampled tokens")
axes[3].set(title="Mean response length", ylabel="tokens")
axes[4].axhline(opd_summary["teacher_accuracy"], color="grey", ls=":", label="teacher")
axes[4].set(
    title=f"Greedy accuracy ({settings['num_eval_samples']} held-out rows)", ylabel="accuracy", ylim=(-0.02, 1.02)
)
for ax in axes:
    ax.set_xlabel("optimizer step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(fontsize=8)
fig.tight_layout()
plt.show()

# %%
pd.DataFrame(
    {
        label: {
            "student accuracy before": summary["student_accuracy_before"],
            "student accuracy after": summary["student_accuracy_after"],
            "format rate after": summary["student_format_rate_after"],
            "reverse KL, first 5 steps": metrics["reverse_kl"].head(5).mean(),
            "reverse KL, last 5 steps": metrics["reverse_kl"].tail(5).mean(),
            "grad norm median": metrics["grad_norm"].median(),
            "grad norm max": metrics["grad_norm"].max(),
            "steps clipped (grad norm > max_grad_norm)": int((metrics["grad_norm"] > defaults.max_grad_norm).sum()),
            "tokens at the clamp, first 5 -> last 5": f"{metrics['score_clamped_frac'].head(5).mean():.3f} -> "
            f"{metrics['score_clamped_frac'].tail(5).mean():.3f}",
            "response length, first 5 -> last 5": f"{metrics['response_length'].head(5).mean():.1f} -> "
            f"{metrics['response_length'].tail(5).mean():.1f}",
        }
        for label, (summary, metrics, _) in runs.items()
    }
).round(3)

# %% [markdown]
# ## Advantage distributions at the start, middle and end of training
#
# Every valid token of the captured steps (B x G responses), as each run's update saw it. Red: tokens whose score
# sits at the clamp (the outlier states), blue: the rest. The y axis is logarithmic, so the few outliers show.

# %%
fig, axes = plt.subplots(2, len(CAPTURED), figsize=(16, 6.6), sharex="row")
for row, (name, caps) in enumerate([("OPD (none)", opd_cap), ("GNDPO (global)", gndpo_cap)]):
    for ax, step in zip(axes[row], CAPTURED):
        c = caps[step]
        outlier = c["mask"] & (c["scores"].abs() >= defaults.score_clip)
        a = c["advantages"]
        ax.hist(
            [a[c["mask"] & ~outlier].numpy(), a[outlier].numpy()],
            bins=40,
            stacked=True,
            color=["#4c72b0", "#c44e52"],
            label=["other tokens", "tokens at the clamp"],
        )
        ax.set_yscale("log")
        ax.set_ylim(bottom=0.7)
        ax.set_title(
            f"{name}, step {step}: std {a[c['mask']].std():.2f}, {int(outlier.sum())} of "
            f"{int(c['mask'].sum())} tokens at the clamp",
            fontsize=9,
        )
        ax.set_xlabel("advantage")
    axes[row][0].set_ylabel("tokens (log scale)")
axes[0][-1].legend(fontsize=8)
fig.tight_layout()
plt.show()


# %%
def advantage_stats(caps):
    rows = {}
    for step, c in caps.items():
        a, m = c["advantages"], c["mask"]
        outlier = m & (c["scores"].abs() >= defaults.score_clip)
        rows[f"step {step}"] = {
            "score mean": c["scores"][m].mean().item(),
            "score std": c["scores"][m].std().item(),
            "advantage mean": a[m].mean().item(),
            "advantage std": a[m].std().item(),
            "advantage min": a[m].min().item(),
            "advantage max": a[m].max().item(),
            "share of tokens at the clamp": outlier.sum().item() / m.sum().item(),
            "share of sum |A| at the clamp": (a[outlier].abs().sum() / a[m].abs().sum()).item(),
        }
    return pd.DataFrame(rows).T


pd.concat({"OPD (none)": advantage_stats(opd_cap), "GNDPO (global)": advantage_stats(gndpo_cap)}).round(3)

# %% [markdown]
# ## The scores of one trace, drawn over its text
#
# One response sampled at step 1 (the same in both runs): each bar is one token's score
# `clamp(teacher_lp - student_lp, -5, 5)`, which is OPD's advantage, and the dots are GNDPO's advantage for the same
# token. Below it, a response of the last step of each run.


# %%
def draw_trace(ax, cap, i, title, other=None):
    """Bars: the scores of response i of a capture, labelled by token; dots: another mode's advantages."""
    m = cap["mask"][i]
    ids, scores = cap["ids"][i][m].tolist(), cap["scores"][i][m].numpy()
    x = np.arange(len(ids))
    colors = ["#c44e52" if abs(s) >= defaults.score_clip else "#4c72b0" if s < 0 else "#55a868" for s in scores]
    ax.bar(x, scores, color=colors)
    handles = [
        Patch(color="#c44e52", label="score at the clamp"),
        Patch(color="#4c72b0", label="negative score"),
        Patch(color="#55a868", label="positive score"),
    ]
    low = scores.min()
    if other is not None:
        adv = other["advantages"][i][m].numpy()
        handles += ax.plot(x, adv, "o", color="black", ms=4, label="GNDPO advantage")
        low = min(low, adv.min())
    ax.legend(handles=handles, fontsize=8, loc="upper right", ncol=len(handles))
    ax.axhline(0, color="black", lw=0.6)
    for y in (-defaults.score_clip, defaults.score_clip):
        ax.axhline(y, color="grey", ls="--", lw=0.8)
    ax.set_xticks(x, [token_label(tokenizer, t, eos_ids) for t in ids], rotation=90, fontsize=8)
    ax.set_xlim(-0.6, len(ids) - 0.4)
    ax.set_ylim(min(-5.6, low - 0.4), 5.6)
    ax.set_ylabel("per-token value")
    ax.set_title(title, fontsize=10)


def worst_response(cap):
    """The response with the most tokens at the clamp (the first of them on a tie)."""
    return int(((cap["scores"].abs() >= defaults.score_clip) & cap["mask"]).sum(1).argmax())


first = worst_response(opd_cap[1])
last = CAPTURED[-1]
fig, axes = plt.subplots(3, 1, figsize=(15, 10.5))
draw_trace(axes[0], opd_cap[1], first, "step 1: a response with outlier states (red bars: at the clamp)", gndpo_cap[1])
draw_trace(
    axes[1],
    opd_cap[last],
    worst_response(opd_cap[last]),
    f"OPD run, step {last}: its response with the most tokens at the clamp (bars: scores = advantages)",
)
draw_trace(
    axes[2],
    gndpo_cap[last],
    worst_response(gndpo_cap[last]),
    f"GNDPO run, step {last}: its response with the most tokens at the clamp (bars: scores; dots: advantages)",
    gndpo_cap[last],
)
fig.tight_layout()
plt.show()
print(
    "step-1 response:", tokenizer.decode(opd_cap[1]["ids"][first][opd_cap[1]["mask"][first]], skip_special_tokens=True)
)

# %% [markdown]
# **What to look for.**
# * In the trace, nearly every token's score is close to 0: the student and the teacher agree on the template
#   ("I look at the image. I see ... The question asks ..."). The red bars are the outlier states: mostly the color
#   or shape word the student names wrongly, inside the trace, in its restatement and in the box, and words the
#   teacher would not say after a sampled slip. OPD pushes on them with the clamped score itself (-5), while
#   GNDPO's advantage for the same token is the score minus the batch mean, divided by the batch's spread: the
#   outlier keeps its place among the tokens (it is still by far the most negative), only the scale changes, and
#   the agreed-on tokens get a small positive advantage from the mean shift. In the table above that shift is
#   why the clamped tokens carry a smaller share of the batch's total |advantage| under GNDPO than under OPD
#   (0.450 against 0.841 at step 1, 0.292 against 0.533 at step 30).
# * Over training, the scores shrink as the student adopts the teacher's words: fewer tokens sit at the clamp
#   (OPD's run: 153, 105 and 47 at steps 1, 15 and 30) and OPD's advantage distribution narrows with the scores
#   (std 1.290, 1.116, 0.848). GNDPO's advantages keep std 1.000 at every step, so what whitening does to the
#   outliers turns around as the scores' std falls below 1: it shrinks a clamped -5 while the std is above 1
#   (-3.615 at step 1, score std 1.290; -4.321 at step 15, 1.101) and enlarges it once the std is below 1
#   (-6.582 at step 30, 0.743: beyond the clamp, the leftmost red bars of the histograms and the dots of the last
#   trace). Late in training the few remaining disagreements get larger advantages than the outliers had at
#   the start.
# * Neither mode's gradient shrinks over these 30 steps: in the grad-norm panel both rise, and their medians are
#   close (0.358 OPD, 0.337 GNDPO; one GNDPO step, at 1.095, is over the clip). This notebook does not plot the
#   update itself. The study measured it: under AdamW, which divides most of a gradient's scale out per
#   parameter, both modes' update sizes fall alike over a run and their medians stay within 12% of each other
#   ([docs/studies/when_normalization_matters.md](../docs/studies/when_normalization_matters.md),
#   [docs/studies/self_distillation.md](../docs/studies/self_distillation.md)).
# * Whether that matters for accuracy or stability is what the study measures over 4 modes x 3 seeds:
#   [docs/studies/README.md](../docs/studies/README.md).
