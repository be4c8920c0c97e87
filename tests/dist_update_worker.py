"""One process of the update check in test_distributed.py: the gradient of update_student's update with the rollout
batch spread over 1 or 2 processes (run with torchrun, gloo).

Every process builds the same global batch: 4 prompts x G = 2 rollouts of the untrained tiny student (seeded),
advantages drawn from a seeded generator, and row 1 fully masked (as if every teacher log-prob of it were not
finite), so that the processes hold different numbers of valid sequences. A process keeps its contiguous share of
the 8 rows (all of them alone, 4 each with two), makes the update, and OUT_DIR/grad<processes>.pt receives the
gradient the optimizer applied (after the all-reduce), read on the main process.

LORA_R (comma-separated, default 16) makes one update per LoRA rank listed, 0 being full fine-tuning, each with a
fresh student (a LoRA one with its B matrices off zero, tests/adapters.py, so that A's gradient is compared too);
GRAD_NAME names their files ({processes} and {lora_r} filled in); MICRO_BATCH_SIZE (default 2) how a process cuts its
rows into micro-batches. Under FSDP2 (tests/test_fsdp.py)
the gradient is gathered from the shards. LEAN=1 makes the update's forward the lean one (lean_response_logps: the
chunked head, which must then be the path taken), else the plain log-softmax gather.
"""

import dataclasses
import os
import sys

import torch
from accelerate.utils import extract_model_from_parallel as unwrap  # the model inside a DDP wrapper

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from adapters import move_b_off_zero  # noqa: E402

import gndpo_fast as fast  # noqa: E402
import gndpo_minimal as g  # noqa: E402
from worlds import tiny_world  # noqa: E402


def main() -> None:
    models_dir = os.environ["MODELS_DIR"]
    ranks = [int(r) for r in os.environ.get("LORA_R", "16").split(",")]
    args = g.RunArgs(
        student_model=os.path.join(models_dir, "student"),
        teacher_model=os.path.join(models_dir, "teacher"),
        prompts_per_step=4,
        num_generations=2,
        micro_batch_size=int(os.environ.get("MICRO_BATCH_SIZE", "2")),
        max_new_tokens=6,
        max_grad_norm=1e9,
        num_eval_samples=0,
        output_dir=os.environ["OUT_DIR"],
        lora_r=ranks[0],
    )
    accelerator, accum = g.make_accelerator(args)
    for lora_r in ranks:
        grad = update_gradient(dataclasses.replace(args, lora_r=lora_r), accelerator, accum)
        if accelerator.is_main_process:
            name = os.environ.get("GRAD_NAME", "grad{processes}.pt").format(
                processes=accelerator.num_processes, lora_r=lora_r
            )
            torch.save(grad, os.path.join(os.environ["OUT_DIR"], name))
    accelerator.wait_for_everyone()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def update_gradient(args: g.Args, accelerator, accum: int) -> torch.Tensor:
    torch.manual_seed(0)  # the same LoRA adapter on every process
    processor, student, _ = g.load_models(dataclasses.replace(args, teacher_4bit=False), accelerator, lambda m: None)
    if args.lora_r:
        move_b_off_zero(student)
    rows = tiny_world.make_rows(4, seed=3)
    prompts = [p for p in ((r["question"], [r["image"]]) for r in rows) for _ in range(2)]  # G copies, one object
    config, _ = g.generation_configs(processor.tokenizer, student, args)
    torch.manual_seed(0)  # the same rollouts on every process
    groups = [i // 2 for i in range(len(prompts))]
    rollout = g.rollout(student, processor, prompts, g.Sampling(config), args)
    mask = rollout.response_mask.clone()
    mask[1] = 0
    advantages = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1)) * mask
    n = len(prompts) // accelerator.num_processes
    mine = slice(accelerator.process_index * n, (accelerator.process_index + 1) * n)
    step = g.StepPrompts(0, 0, prompts[mine], groups[mine], [None] * n)
    micro_batches = g.cut_rollouts(
        processor,
        step,
        [g.Rollout(rollout.response_ids[mine], rollout.response_mask[mine], rollout.sampled_logps[mine])],
        args.micro_batch_size,
        args,
    )
    R = max(r.response_ids.shape[1] for r in micro_batches)
    batch = g.ScoredBatch(
        micro_batches,
        torch.tensor(groups[mine]),
        mask[mine, :R],
        advantages[mine, :R],
        advantages[mine, :R],
        advantages[mine, :R],
        advantages[mine, :R],
        0,
    )
    student, optimizer, scheduler = g.make_optimizer(args, accelerator, student, accum)
    params, grads, step = [p for p in student.parameters() if p.requires_grad], [], optimizer.step

    def record(*a, **k):
        # an FSDP2 shard's full_tensor() is a collective: every process records
        grads.append(torch.cat([getattr(p.grad, "full_tensor", p.grad.clone)().flatten() for p in params]))
        return step(*a, **k)

    optimizer.step = record
    lean = os.environ.get("LEAN") == "1"
    if lean:  # under FSDP2 the head is sharded: the chunked head must run on its unit's gathered weight
        assert fast.head_path(student) == "chunked head", type(unwrap(student).get_output_embeddings())
    models = g.Models(
        student,
        None,
        processor,
        torch.tensor(config.suppress_tokens),
        student_forward=fast.lean_forward(g.sequence_inputs) if lean else g.response_logps,
    )
    update = g.update_student(models, optimizer, scheduler, accelerator, batch, args, log=lambda m: None)
    assert update["skipped_updates"] == 0 and len(grads) == 1
    return grads[0]


if __name__ == "__main__":
    main()
