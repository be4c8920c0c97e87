"""One process of test_teachers.py's sharded-teacher checks (accelerate launch --multi_gpu --num_processes 2, gloo):
python shard_teacher_worker.py OUT_DIR FLAG...; the flags are the runs' (--shard_teacher true among them), and their
--process_timeout_minutes is the process group's from the start.

Part 1, the forwards: both processes load the shipped tiny teacher twice in float32, shard one copy's layers with
shard_frozen (FSDP2), and score the same rollout (the tiny task's first 4 prompts x G = 2, random response tokens)
with the plain, the lean and the prompt-once forwards, on both copies, in the same order on both processes (a
sharded layer's forward gathers its weights from every process), then evaluate 5 rows (3 on one process, 2 on the
other) 2 rows per generate(), synced_gpus, as evaluation does. After each forward it measures the share of the
sharded layers' weights this process holds (held_fraction). A third copy sharded as the script did before
reshard_after_forward=True (fully_shard(layer, mesh=mesh), each layer a root that keeps its gathered weights)
is measured after one forward: the counter must see it holding the whole teacher again.

Part 2, whole runs: main() twice in this process, with shard_frozen wrapped so that the teacher it shards gets a
forward pre-hook on every sharded layer (each call is one all-gather: the counts must be equal on every process) and
a forward hook that measures held_fraction after every forward of the teacher (scoring, and the generate() steps of
the teacher's evaluation). Run "hooked" (the flags as given: the test's 2-step run) scores through main's
teacher_forward hook (lean_response_logps; held_fraction after each scoring forward, and once more after main()
returns, after the final evaluation); run "one_token" (--max_new_tokens 1 --share_prompt_prefix true) keeps main's
own teacher forward, so the prompt-once decision is the script's.

Writes OUT_DIR/rank<r>.json. Nothing is asserted here: a failed assert on one process would leave the other
waiting at its next all-gather.
"""

import contextlib
import dataclasses
import io
import json
import os
import sys

import torch

import gndpo_eval
import gndpo_fast as fast
import gndpo_minimal as g
import gndpo_teachers as gt


def sharded_layers(model) -> list:
    """The modules shard_frozen shards: the classes the model names in _no_split_modules (look before sharding:
    fully_shard gives each one a class of its own, FSDP<name>)."""
    return [m for m in model.modules() if type(m).__name__ in set(model._no_split_modules)]


def held_fraction(layers: list) -> float:
    """The share of the layers' weights this process holds now, read from the parameters the modules have
    registered at this moment: a DTensor's local shard, or a plain tensor's whole size (FSDP2 registers the
    gathered, unsharded parameters as plain tensors while a layer is unsharded, and the sharded DTensors back when
    it reshards). The denominator is every parameter's global size (a DTensor's numel() is its global one)."""
    params = {id(p): p for m in layers for p in m.parameters()}.values()
    held = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in params)
    return held / sum(p.numel() for p in params)


def count_forwards(layers: list) -> list[int]:
    """A forward pre-hook on every layer; returns the list of their forward counts (updated in place)."""
    counts = [0] * len(layers)
    for i, m in enumerate(layers):
        m.register_forward_pre_hook(lambda module, args, i=i: counts.__setitem__(i, counts[i] + 1))
    return counts


class Tee(io.StringIO):
    """Keeps what is written and passes it on (main()'s log lines, for the test to read)."""

    def write(self, s):
        sys.__stdout__.write(s)
        return super().write(s)


def forwards(flags: list[str]) -> dict:
    """Part 1: the sharded forwards against the whole teacher's, what each process holds after each one, and the
    old sharding's copy. flags: the runs' (their --process_timeout_minutes is the process group's, for part 2's first
    run too)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoProcessor

    args = dataclasses.replace(g.parse_args(flags), max_new_tokens=6, num_generations=2, num_eval_samples=5)
    accelerator, _ = g.make_accelerator(args)
    processor = AutoProcessor.from_pretrained(args.student_model)
    whole = g.load_teacher(args, torch.float32, accelerator.device)
    sharded = g.load_teacher(args, torch.float32, accelerator.device)
    layers = sharded_layers(sharded)
    n_sharded = gt.shard_frozen(sharded, accelerator.device.type, accelerator.num_processes)
    local = sum(p.to_local().numel() for m in layers for p in m.parameters())
    full = sum(p.numel() for m in layers for p in m.parameters())
    counts = count_forwards(layers)
    result = {
        "sharded_layers": n_sharded,
        "local_layer_fraction": local / full,
        "held_fraction": {"before": held_fraction(layers)},
    }

    ds, keep, _ = g.prepare_split(g.load_split(args, "train"), args, processor, "train", limit=8, log=None)
    rows = [ds[i] for i in keep[:4]]
    prompts = [(r[args.question_column], g.row_images(r, args.image_column)) for r in rows for _ in range(2)]
    groups = [i for i in range(4) for _ in range(2)]
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(20, 200, (8, 6), generator=gen)
    mask = (torch.arange(6)[None] < torch.tensor([6, 5, 4, 6, 3, 6, 2, 5])[:, None]).long()
    sharing = fast.PrefixSharing(g.response_logps, g.logps_tolerance, script=g)  # every row's, distinct ones
    rollout = sharing.encode(processor, g.Rollout(ids, mask, torch.zeros(8, 6)), prompts, groups, args)
    ignore = torch.tensor(g.vision_token_ids(processor.tokenizer, whole.config))
    with torch.no_grad():
        for name, forward in (
            ("plain", g.response_logps),
            ("lean", fast.lean_forward(g.sequence_inputs)),
            ("shared", fast.SharedPrefix.logps),
        ):
            a, b = forward(whole, rollout, ignore), forward(sharded, rollout, ignore)
            result["held_fraction"][name] = held_fraction(layers)
            result[f"{name}_max_difference"] = (a - b)[mask.bool()].abs().max().item()
        eval_rows = g.load_eval_rows(args, processor, None)
        greedy = g.generation_configs(processor.tokenizer, whole, args)[1]
        result["eval_rows"] = len(eval_rows)
        two = dataclasses.replace(args, generation_batch_size=2)  # 5 rows: 3 and 2 per process, 2 calls each
        run_eval = lambda model, synced: gndpo_eval.evaluate(  # noqa: E731
            model, processor, eval_rows, two, accelerator, greedy, g.encode_prompts, synced_gpus=synced
        )
        result["eval_whole"], result["eval_sharded"] = run_eval(whole, False), run_eval(sharded, True)
        result["held_fraction"]["generate"] = held_fraction(layers)
        result["forwards"] = list(counts)

        # the sharding before the fix: each layer a root with the default reshard_after_forward (False for a root)
        old = g.load_teacher(args, torch.float32, accelerator.device)
        old_layers = sharded_layers(old)
        mesh = init_device_mesh(accelerator.device.type, (accelerator.num_processes,))
        for layer in old_layers:
            fully_shard(layer, mesh=mesh)
        result["old_held_fraction"] = {"before": held_fraction(old_layers)}
        g.response_logps(old, rollout, ignore)
        result["old_held_fraction"]["plain"] = held_fraction(old_layers)
    del old, old_layers
    accelerator.wait_for_everyone()
    return result


@contextlib.contextmanager
def keeping_the_process_group():
    """main() ends by destroying the process group (finish_run): within this it stays, for the next main() to use
    (making a second one on the launcher's store is not reliable)."""
    destroy = torch.distributed.destroy_process_group
    torch.distributed.destroy_process_group = lambda group=None: None
    try:
        yield
    finally:
        torch.distributed.destroy_process_group = destroy


def run(flags: list[str], hooked: bool, last: bool) -> dict:
    """Part 2: one main() run; the teacher's per-layer forward counts, held_fraction after every teacher forward
    (its largest), after each scoring forward through the teacher_forward hook (hooked), and after main() returns,
    the run's summary and its log. The last run ends the process group."""
    seen = {}
    shard_frozen = gt.shard_frozen

    def wrapped(model, device_type, num_processes):
        layers = sharded_layers(model)  # before fully_shard renames their classes (FSDP<name>)
        n = shard_frozen(model, device_type, num_processes)
        seen.update(layers=layers, counts=count_forwards(layers), largest=0.0, model_forwards=0)

        def after(module, args, output):
            seen["largest"] = max(seen["largest"], held_fraction(layers))
            seen["model_forwards"] += 1

        model.register_forward_hook(after)
        return n

    scoring = []

    def teacher_forward(teacher, rollout, ignore_ids, temperature=1.0):
        out = fast.lean_forward(g.sequence_inputs)(teacher, rollout, ignore_ids, temperature)
        scoring.append(held_fraction(seen["layers"]))
        return out

    args = g.parse_args(flags)
    group = contextlib.nullcontext() if last else keeping_the_process_group()
    gt.shard_frozen = wrapped
    try:
        with contextlib.redirect_stdout(Tee()) as log, group:
            summary = g.main(args, teacher_forward=teacher_forward if hooked else None)
    finally:
        gt.shard_frozen = shard_frozen
    return {
        "summary": summary,
        "log": log.getvalue(),
        "forwards": seen["counts"],
        "model_forwards": seen["model_forwards"],
        "largest_held_fraction": seen["largest"],
        "scoring_held_fractions": scoring,
        "held_fraction_after_main": held_fraction(seen["layers"]),
    }


def main(out_dir: str, flags: list[str]) -> None:
    result = forwards(flags)
    result["hooked"] = run([*flags, "--output_dir", os.path.join(out_dir, "hooked")], hooked=True, last=False)
    result["one_token"] = run(
        [
            *flags,
            "--max_new_tokens",
            "1",
            "--share_prompt_prefix",
            "true",
            "--output_dir",
            os.path.join(out_dir, "one_token"),
        ],
        hooked=False,
        last=True,
    )
    with open(os.path.join(out_dir, f"rank{os.environ['RANK']}.json"), "w") as f:  # main() ended the process group
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
