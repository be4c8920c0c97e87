"""One process of test_teachers.py's sharded-teacher check (accelerate launch --multi_gpu --num_processes 2, gloo).

Both processes load the shipped tiny teacher twice in float32, shard one copy's layers with shard_frozen (FSDP2),
and score the same rollout (the tiny task's first 4 prompts x G = 2, random response tokens) with the plain, the lean
and the prompt-once forwards, on both copies, in the same order on both processes (a sharded layer's forward gathers
its weights from every process). Writes OUT_DIR/rank<r>.json: the largest |difference| per forward and the share of
the sharded layers' weights that this process holds.
"""

import json
import os
import sys

import torch

import gndpo_minimal as g


def main(out_dir: str) -> None:
    args = g.Args(teacher_4bit=False, shard_teacher=True, max_new_tokens=6, num_generations=2)
    accelerator, _ = g.make_accelerator(args)
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(args.student_model)
    whole = g.load_teacher(args, torch.float32, accelerator.device)
    sharded = g.load_teacher(args, torch.float32, accelerator.device)
    layers = [m for m in sharded.modules() if type(m).__name__ in set(sharded._no_split_modules)]
    n_sharded = g.shard_frozen(sharded, accelerator.device.type, accelerator.num_processes)
    local = sum(p.to_local().numel() for m in layers for p in m.parameters())
    full = sum(p.numel() for m in layers for p in m.parameters())

    ds, keep, _ = g.prepare_split(g.load_split(args, "train"), args, processor, "train", limit=8, log=None)
    rows = [ds[i] for i in keep[:4]]
    prompts = [(r[args.question_column], g.row_images(r, args.image_column)) for r in rows for _ in range(2)]
    groups = [i for i in range(4) for _ in range(2)]
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(20, 200, (8, 6), generator=gen)
    mask = (torch.arange(6)[None] < torch.tensor([6, 5, 4, 6, 3, 6, 2, 5])[:, None]).long()
    rollout = g.encode_rollout_prompts(processor, g.Rollout(ids, mask, torch.zeros(8, 6)), prompts, groups, args,
                                       True, True)
    ignore = torch.tensor(g.vision_token_ids(processor.tokenizer, whole.config))
    result = {"sharded_layers": n_sharded, "local_layer_fraction": local / full}
    with torch.no_grad():
        for name, forward in (("plain", g.response_logps), ("lean", g.lean_response_logps),
                              ("shared", g.SharedPrefix.logps)):
            a, b = forward(whole, rollout, ignore), forward(sharded, rollout, ignore)
            result[f"{name}_max_difference"] = (a - b)[mask.bool()].abs().max().item()
    with open(os.path.join(out_dir, f"rank{accelerator.process_index}.json"), "w") as f:
        json.dump(result, f)
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main(sys.argv[1])
