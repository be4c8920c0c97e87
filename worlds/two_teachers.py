"""The two-domain tiny world: several teachers, one expert per kind of question (recipes/tiny_two_teachers.yaml).

Nothing here is part of the algorithm. It builds, from the tiny world (worlds/tiny_world.py, assets/tiny), offline:
  * two domains that share one tokenizer: `color` questions ("What color are the shapes?") and `shape` questions
    ("What shape are they?"). The tiny task's count questions are left out of this world's data, so that every
    row belongs to exactly one expert;
  * an expert teacher per domain, each a short SFT of the tiny world's teacher (assets/tiny/teacher) in which the
    other domain's answers are always renamed (EXPERT_SWAP, a derangement other than the student's): the color
    expert names colors right and shapes wrong, the shape expert the reverse;
  * the dataset, assets/two_teachers/data/{train,test}.parquet: the tiny world's splits (same seeds and images)
    without their count rows, with a `teacher` column naming each row's domain, which is its expert's name.
The student is the tiny world's (assets/tiny/student: weak at both colors and shapes) and the generalist baseline
is the tiny world's teacher (good at both); neither is copied here.

    python -m worlds.two_teachers --out assets/two_teachers --seed 0     # the experts (minutes) and the data
    python -m worlds.two_teachers --out assets/two_teachers --data_only  # the dataset alone

out/world.json holds every model's greedy accuracy per domain on held-out rows of each domain.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from worlds import tiny_world
from worlds.tiny_world import COLORS, DATA_SPLITS, SHAPES, STUDENT_SWAP, greedy_accuracy, make_rows, reloaded_model, sft

ROOT = tiny_world.ROOT
TINY = os.path.join(ROOT, "assets", "tiny")
DOMAINS = ("color", "shape")
# What an expert answers in the other domain: each name moved one step back along the student's misconception
# (the inverse derangement), so an expert's wrong answers are not the student's.
EXPERT_SWAP = {v: k for k, v in STUDENT_SWAP.items()}
OTHER = {"color": list(SHAPES), "shape": list(COLORS)}  # the names each expert gets wrong


def domain_rows(n: int, seed: int) -> list[dict]:
    """The tiny world's n rows drawn from `seed`, without the count questions (about two thirds remain)."""
    return [r for r in make_rows(n, seed) if r["kind"] in DOMAINS]


def write_dataset(out: str) -> dict[str, str]:
    """out/<split>.parquet for the tiny world's splits (DATA_SPLITS) without count rows, with the teacher column."""
    import datasets

    features = datasets.Features(
        {
            "image": datasets.Image(),
            "question": datasets.Value("string"),
            "answer": datasets.Value("string"),
            "kind": datasets.Value("string"),
            "teacher": datasets.Value("string"),
        }
    )
    os.makedirs(out, exist_ok=True)
    paths = {}
    for split, (n, seed) in DATA_SPLITS.items():
        rows = [
            {
                "image": r["image"],
                "question": r["question"],
                "answer": r["answer"],
                "kind": r["kind"],
                "teacher": r["kind"],
            }
            for r in domain_rows(n, seed)
        ]
        paths[split] = os.path.join(out, f"{split}.parquet")
        datasets.Dataset.from_list(rows, features=features).to_parquet(paths[split])
    return paths


def accuracy_per_domain(model, processor, rows: list[dict]) -> dict[str, float]:
    """Greedy accuracy on each domain's rows, against the true answers."""
    return {d: round(greedy_accuracy(model, processor, [r for r in rows if r["kind"] == d]), 4) for d in DOMAINS}


def build_expert(domain: str, out: str, eval_rows: list[dict], steps: int, lr: float, seed: int):
    """The tiny teacher fine-tuned so that the other domain's answers are always renamed (EXPERT_SWAP)."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(os.path.join(TINY, "teacher"))
    model = reloaded_model(os.path.join(TINY, "teacher"))
    swap = {name: EXPERT_SWAP[name] for name in OTHER[domain]}  # only the other domain's names
    torch.manual_seed(seed)
    sft(model, processor, eval_rows, swap=swap, swap_prob=1.0, steps=steps, lr=lr, seed=seed, target=0.97, log_every=50)
    path = os.path.join(out, f"teacher_{domain}")
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path, processor


def build(out: str, seed: int = 0, steps: int = 400, lr: float = 1e-3) -> dict:
    from transformers import AutoProcessor

    eval_rows = domain_rows(600, seed + 2)  # held out from the splits' seeds, like the tiny world's evaluation
    report = {
        "seed": seed,
        "eval_rows": {d: sum(r["kind"] == d for r in eval_rows) for d in DOMAINS},
        "student": os.path.relpath(os.path.join(TINY, "student"), ROOT),
        "generalist": os.path.relpath(os.path.join(TINY, "teacher"), ROOT),
        "accuracy": {},
    }
    processor = AutoProcessor.from_pretrained(os.path.join(TINY, "teacher"))
    for name in ("student", "teacher"):
        label = "generalist" if name == "teacher" else name
        report["accuracy"][label] = accuracy_per_domain(reloaded_model(os.path.join(TINY, name)), processor, eval_rows)
    for domain in DOMAINS:
        t0 = time.time()
        print(f"the {domain} expert ...", flush=True)
        path, processor = build_expert(domain, out, eval_rows, steps, lr, seed)
        report["accuracy"][f"teacher_{domain}"] = accuracy_per_domain(reloaded_model(path), processor, eval_rows)
        report[f"teacher_{domain}_build_seconds"] = round(time.time() - t0)
        print(f"  {domain} expert: {report['accuracy'][f'teacher_{domain}']} -> {path}", flush=True)
    with open(os.path.join(out, "world.json"), "w") as f:
        json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="assets/two_teachers")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=400, help="SFT steps per expert (stops early at 0.97)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--data_only", action="store_true", help="only (re)write the dataset in <out>/data")
    a = parser.parse_args()
    print("dataset:", write_dataset(os.path.join(a.out, "data")), flush=True)
    if not a.data_only:
        print(json.dumps(build(a.out, a.seed, a.steps, a.lr), indent=2))
