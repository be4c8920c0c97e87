"""One rank of the multi-process normalization check in test_distributed.py (run it with torchrun, gloo).

Every rank rebuilds the same seeded global batch, keeps its own very uneven share of it, calls
the advantages of that share in "global" mode (the script's normalize_scores), "center", "scale", "group" (gndpo_extras'
ablation_advantages) and "per_teacher" (gndpo_teachers' per_teacher_advantages), each on the script's own statistics,
counts the collective calls made, and saves what it got to OUT_DIR/rank<r>.pt for the test to compare with one
process holding everything.
"""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from gndpo_extras import ablation_advantages  # noqa: E402
from gndpo_minimal import global_sums, normalize_scores, whiten  # noqa: E402
from gndpo_teachers import per_teacher_advantages  # noqa: E402

NUM_TEACHERS = 3


def advantages(scores, mask, mode, group_ids=None, teacher_ids=None):
    """The advantages of one mode as the script's step computes them (ADVANTAGES): global by normalize_scores, the
    ablations by gndpo_extras, per_teacher (of NUM_TEACHERS) by gndpo_teachers, all on the script's whiten."""
    if mode == "global":
        return normalize_scores(scores, mask, mode)
    if mode == "per_teacher":
        return per_teacher_advantages(scores, mask, teacher_ids, NUM_TEACHERS, whiten)
    return ablation_advantages(scores, mask, mode, whiten, global_sums, group_ids)


def global_batch(seed: int = 0, G: int = 2) -> dict:
    """12 responses (6 prompts x G=2) of up to 9 tokens; rows 0-1 hold 3 valid tokens, rows 2-11 many more
    on other scales, so rank 0's tokens are few and unlike rank 1's."""
    gen = torch.Generator().manual_seed(seed)
    B, T = 12, 9
    lengths = torch.tensor([2, 1] + [int(x) for x in torch.randint(5, T + 1, (B - 2,), generator=gen)])
    mask = (torch.arange(T)[None] < lengths[:, None]).long()  # (B, T)
    scores = torch.randn(B, T, generator=gen) * torch.linspace(0.5, 4.0, B)[:, None] + torch.arange(B)[:, None] * 0.3
    scores = scores * mask  # (B, T), 0 off the mask
    group_ids = torch.arange(B) // G  # (B,): G consecutive responses share a prompt
    # (B,) each row's teacher, of 3: rank 0's two rows have teacher 0 only, and teacher 2's rows are all on rank 1
    teacher_ids = torch.tensor([0, 0, 1, 2, 0, 1, 2, 2, 1, 0, 1, 2])
    return {"scores": scores, "mask": mask, "group_ids": group_ids, "teacher_ids": teacher_ids}


# rank 0 holds 2 responses (3 valid tokens), rank 1 the other 10; both hold whole groups of G = 2
SHARES = {0: slice(0, 2), 1: slice(2, 12)}


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    batch = global_batch()
    mine = {k: v[SHARES[rank]] for k, v in batch.items()}

    calls = []
    all_reduce = dist.all_reduce

    def counting_all_reduce(tensor, *args, **kwargs):
        calls.append(str(tensor.dtype))
        return all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = counting_all_reduce
    out = {}
    for name, mask, mode in [
        ("global", mine["mask"], "global"),
        # this rank holds no valid token at all: it must still join the reduction
        ("global_empty_rank0", mine["mask"] * (rank != 0), "global"),
        ("center", mine["mask"], "center"),
        ("scale", mine["mask"], "scale"),
        ("group", mine["mask"], "group"),
    ]:
        calls.clear()
        out[name] = advantages(mine["scores"], mask, mode, mine["group_ids"])
        out[name + "_calls"] = list(calls)
    calls.clear()  # several teachers: each teacher's tokens on their own, all three teachers' sums in one call
    out["per_teacher"] = advantages(mine["scores"], mine["mask"], "per_teacher", teacher_ids=mine["teacher_ids"])
    out["per_teacher_calls"] = list(calls)
    dist.all_reduce = all_reduce
    torch.save(out, os.path.join(os.environ["OUT_DIR"], f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
