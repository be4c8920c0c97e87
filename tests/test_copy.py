"""Copying GNDPO: the definitions docs/code.md lists, in two tiers (the math, at most 150 lines; the step on your own
rollouts, at most 420 lines with the math, formatted), pasted alone into a blank module, are closed (every name
they use is listed, a builtin or one of the module's imports), read of `args` exactly the fields of the small config
docs/code.md gives, and, fed that config and rollouts that a tiny model sampled with generate() in a loop of the
copier's own, give gndpo_minimal's loss and gradient, and the advantages, loss and gradient of the independent
transcriptions of the paper in tests/test_math.py (so a mistake shared by the script and its copy shows too)."""

import ast
import builtins
import copy
import dis
import os
import re
import types

import pytest
import torch
from accelerate.utils import extract_model_from_parallel as unwrap  # the model inside a DDP wrapper
from adapters import move_b_off_zero
from test_math import spec_global, spec_gspo

import gndpo_minimal as g

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# what the blank module imports: standard library, torch and transformers, nothing else
HEADER = """from __future__ import annotations
import contextlib
import math
import time
from dataclasses import dataclass, field
import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers
"""


def copy_section() -> str:
    """docs/code.md's "Copying GNDPO" section, up to the next "## " heading."""
    with open(os.path.join(ROOT, "docs", "code.md")) as f:
        text = f.read()
    return text.split("## Copying GNDPO", 1)[1].split("\n## ", 1)[0]


def listed_names(tier: str = "") -> list[str]:
    """The bullets of docs/code.md's "Copying GNDPO" section (tier "math": those under its "### The math" heading):
    one definition each, its name in backticks first."""
    section = copy_section()
    if tier == "math":
        section = section.split("### The math", 1)[1].split("\n### ", 1)[0]
    return re.findall(r"^- `([A-Za-z_][A-Za-z0-9_]*)`", section, flags=re.M)


def definitions() -> dict[str, tuple[int, str]]:
    """Every top-level definition of gndpo_minimal.py: name -> (first line, source with decorators)."""
    with open(os.path.join(ROOT, "gndpo_minimal.py")) as f:
        source = f.read()
    lines, out = source.splitlines(), {}
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            name = node.name
        elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
        else:
            continue
        start = min([d.lineno for d in getattr(node, "decorator_list", [])] + [node.lineno])
        out[name] = (start, "\n".join(lines[start - 1 : node.end_lineno]) + "\n")
    return out


def pasted_source(tier: str = "") -> str:
    defs = definitions()
    return HEADER + "\n\n".join(defs[name][1] for name in sorted(listed_names(tier), key=lambda n: defs[n][0]))


def lines_of(names: list[str]) -> int:
    defs = definitions()
    return sum(len(defs[name][1].splitlines()) for name in names)


def config_block() -> str:
    """The section's fenced Python block that builds the copier's config: `args = SimpleNamespace(...)`."""
    blocks = re.findall(r"^```python\n(.*?)^```", copy_section(), flags=re.M | re.S)
    found = [b for b in blocks if re.search(r"^args = SimpleNamespace\(", b, flags=re.M)]
    assert len(found) == 1, "docs/code.md's copy section no longer builds one `args = SimpleNamespace(...)`"
    return found[0]


def documented_args() -> types.SimpleNamespace:
    """The copier's config as docs/code.md builds it: the block run as written."""
    ns: dict = {}
    exec(compile(config_block(), "code.md", "exec"), ns)
    assert isinstance(ns["args"], types.SimpleNamespace)
    return ns["args"]


def fields_read(source: str) -> set[str]:
    """Every field of `args` the code reads: `args.x`, or `getattr(args, "x")`, anywhere in it."""
    fields = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "args":
            fields.add(node.attr)
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "vars"):
            target = node.args[0] if node.args else None
            if isinstance(target, ast.Name) and target.id == "args":
                name = node.args[1] if len(node.args) > 1 else None
                assert isinstance(name, ast.Constant), f"args read by a name not written out: {ast.unparse(node)}"
                fields.add(name.value)
    return fields


def global_names(code: types.CodeType) -> set[str]:
    """The global names a compiled module's code reads, in every function and class body (annotations are strings
    under `from __future__ import annotations`, so names only in type hints are not among them)."""
    names = {ins.argval for ins in dis.get_instructions(code) if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME")}
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= global_names(const)
    return names


def test_readme_states_the_lists_own_count_and_lines():
    """README's figures for the copy list are the list's, counted here, not typed by hand and left to drift."""
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    found = re.search(r"lists the (\d+) definitions \((\d+) lines", text)
    math = re.search(r"the math alone is (\d+) definitions \((\d+) lines", text)
    assert found and math, "README no longer states the copy list's size and its math tier's"
    assert (int(found.group(1)), int(found.group(2))) == (len(listed_names()), lines_of(listed_names()))
    assert (int(math.group(1)), int(math.group(2))) == (len(listed_names("math")), lines_of(listed_names("math")))


@pytest.mark.parametrize("tier", ["math", ""], ids=["the math", "the step"])
def test_each_tier_is_closed_and_short(tier):
    names, defs = listed_names(tier), definitions()
    assert len(names) == len(set(names)) and set(names) <= set(defs), set(names) - set(defs)
    assert lines_of(names) <= (150 if tier == "math" else 420), f"the {tier or 'whole'} list holds {lines_of(names)}"
    core = ("distill_scores", "normalize_scores", "policy_loss") + (
        () if tier == "math" else ("Rollout", "ScoredBatch", "score_rollouts", "update_student", "response_logps")
    )
    assert set(core) <= set(names)
    imported = {"math", "torch", "dist", "annotations"} | (
        set() if tier == "math" else {"contextlib", "time", "dataclass", "field", "F", "transformers"}
    )
    used = {n for n in global_names(compile(pasted_source(tier), "pasted.py", "exec")) if not n.startswith("__")}
    missing = used - set(names) - imported - set(dir(builtins))
    assert missing == set(), f"used by the listed definitions but not listed: {sorted(missing)}"
    # no speed-up, several-teacher or diagnostic code comes along: the copier's path is the plain one
    assert not {"PrefixSharing", "SharedPrefix", "head_logps", "draw_tokens", "Sampling", "update_size"} & set(names)


def test_the_documented_config_holds_exactly_the_fields_the_step_reads():
    """docs/code.md's config names every field of `args` the listed definitions read, and no other; each with its
    one-line meaning, at its value in the paper's setting (Args' default)."""
    documented = vars(documented_args())
    read = fields_read(pasted_source())
    assert set(documented) == read, (
        f"read but not documented: {sorted(read - set(documented))}; "
        f"documented but not read: {sorted(set(documented) - read)}"
    )
    defaults = g.RunArgs()
    assert {k: getattr(defaults, k) for k in documented} == documented
    lines = re.findall(r"^    (\w+)=.*?(#.*)?$", config_block(), flags=re.M)
    assert sorted(name for name, _ in lines) == sorted(documented)
    assert all(len(comment) > 10 for _, comment in lines), "a field without its one-line meaning"


def test_the_field_check_sees_attributes_and_getattr():
    source = "def f(args, other):\n    return args.a + getattr(args, 'b') + other.c + SCORES[args.d](args)\n"
    assert fields_read(source) == {"a", "b", "d"}


def copier_rollout(model, processor, prompts, ignore_ids, eos_ids, pad_id):
    """The copier's own sampler: the processor's batch, generate() at temperature 1 over the full distribution, the
    sampling log-probs as any engine reports them (here a no-grad eval forward), the mask up to the end token."""
    processor.tokenizer.padding_side = "left"
    texts = [
        processor.apply_chat_template(
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": q}]}],
            add_generation_prompt=True,
            tokenize=False,
        )
        for q, _ in prompts
    ]
    inputs = dict(processor(text=texts, images=[imgs for _, imgs in prompts], return_tensors="pt", padding=True))
    torch.manual_seed(0)
    with torch.no_grad():
        model.eval()
        out = model.generate(
            **inputs,
            do_sample=True,
            top_k=0,
            top_p=1.0,
            max_new_tokens=6,
            suppress_tokens=ignore_ids.tolist(),
            eos_token_id=eos_ids,
            pad_token_id=pad_id,
        )
        response = out[:, inputs["input_ids"].shape[1] :]
        is_end = torch.isin(response, torch.tensor(eos_ids)).long()
        mask = 1 - ((is_end.cumsum(1) - is_end) > 0).long()
        rollout = g.Rollout(response.masked_fill(mask == 0, pad_id), mask, None, row_inputs=inputs)
        rollout.sampled_logps = g.response_logps(model, rollout, ignore_ids)
        model.train()
    return rollout


@pytest.mark.slow
def test_the_pasted_definitions_train_like_gndpo_minimal(untrained_models):
    from worlds import tiny_world

    ns: dict = {}
    exec(compile(pasted_source(), "pasted.py", "exec"), ns)
    args = g.RunArgs(
        student_model=os.path.join(untrained_models, "student"),
        teacher_model=os.path.join(untrained_models, "teacher"),
        teacher_4bit=False,
        prompts_per_step=4,
        num_generations=2,
        micro_batch_size=8,
        learning_rate=1e-2,
        num_eval_samples=0,
    )
    accelerator, _ = g.make_accelerator(args)  # the copier's loop runs under Accelerate; the pasted module imports none
    processor, student, teachers = g.load_models(args, accelerator, log=lambda msg: None)
    move_b_off_zero(student)  # LoRA's A gets a gradient too
    teacher = teachers["teacher"]  # one teacher: {"teacher": model}
    config, _ = g.generation_configs(processor.tokenizer, student, args)
    ignore_ids = torch.tensor(config.suppress_tokens)
    prompts = [(r["question"], [r["image"]]) for r in tiny_world.make_rows(4, seed=5) for _ in range(2)]
    rollout = copier_rollout(
        unwrap(student),
        processor,
        prompts,
        ignore_ids,
        config.eos_token_id,
        processor.tokenizer.pad_token_id,
    )
    group_ids = [i // 2 for i in range(8)]
    results = {}
    for name, module in (("pasted", types.SimpleNamespace(**ns)), ("gndpo_minimal", g)):
        copied = copy.deepcopy(student)
        optimizer = torch.optim.AdamW([p for p in copied.parameters() if p.requires_grad], lr=1e-2)
        grads = []
        optimizer.register_step_pre_hook(
            lambda opt, a, k, grads=grads: grads.append(
                torch.cat([p.grad.flatten() for group in opt.param_groups for p in group["params"]]).clone()
            )
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
        accelerator.gradient_accumulation_steps = 1
        models = module.Models(copied, teacher, processor, ignore_ids)
        # the pasted step gets the copier's config, exactly as docs/code.md builds it; gndpo_minimal the full Args
        step_args = documented_args() if name == "pasted" else args
        batch = module.score_rollouts(models, [rollout], group_ids, step_args)
        update = module.update_student(models, optimizer, scheduler, accelerator, batch, step_args)
        results[name] = (batch, update, grads[0])
    pasted, ours = results["pasted"], results["gndpo_minimal"]
    torch.testing.assert_close(pasted[0].advantages, ours[0].advantages, rtol=0, atol=0)
    a = pasted[0].advantages[pasted[0].response_mask.bool()]
    assert abs(a.mean().item()) < 1e-5 and a.std().item() == pytest.approx(1.0, abs=1e-3)  # whitened
    assert pasted[1]["loss"] == ours[1]["loss"] and pasted[1]["grad_norm"] == ours[1]["grad_norm"]
    assert ours[2].norm() > 0
    torch.testing.assert_close(pasted[2], ours[2], rtol=0, atol=0)
    # and against the paper's definitions, transcribed in tests/test_math.py, on a forward written out here
    batch, mask = pasted[0], pasted[0].response_mask
    scores = (batch.teacher_logps - batch.student_logps).clamp(-5, 5) * mask  # the clamped log-ratio, 0 off the mask
    torch.testing.assert_close(batch.scores, scores)
    torch.testing.assert_close(batch.advantages, spec_global(scores, mask))
    loss, gradient = transcribed_loss_and_gradient(copy.deepcopy(student), rollout, batch.advantages, ignore_ids)
    assert pasted[1]["loss"] == pytest.approx(loss.item(), rel=1e-5, abs=1e-7)
    assert pasted[1]["grad_norm"] == pytest.approx(gradient.norm().item(), rel=1e-4)
    clip = min(1.0, args.max_grad_norm / (gradient.norm().item() + 1e-6))  # clip_grad_norm_ before the step
    torch.testing.assert_close(pasted[2], gradient * clip, rtol=1e-4, atol=1e-7)


def transcribed_loss_and_gradient(model, rollout, advantages, ignore_ids) -> tuple[torch.Tensor, torch.Tensor]:
    """The on-policy GSPO loss of one update (spec_gspo, the old log-probs the new ones detached) on log-probs from
    a forward of prompt + response written out here (the response's logits, ignored ids at -inf, log_softmax,
    gather), and its gradient over the trainable parameters, flattened in their order."""
    prompt, response = rollout.row_inputs, rollout.response_ids
    per_token = {k for k, v in prompt.items() if torch.is_tensor(v) and v.shape == prompt["input_ids"].shape}
    inputs = {k: torch.cat([v, torch.zeros_like(response)], 1) if k in per_token else v for k, v in prompt.items()}
    inputs |= {  # token types (text) grow by zeros, the ids by the response, the mask by its mask
        "input_ids": torch.cat([prompt["input_ids"], response], 1),
        "attention_mask": torch.cat([prompt["attention_mask"], rollout.response_mask], 1),
    }
    P = prompt["input_ids"].shape[1]
    logits = model(**inputs, use_cache=False).logits[:, P - 1 : -1].float()  # position t predicts token t + 1
    logits[..., ignore_ids] = float("-inf")
    logps = torch.log_softmax(logits, -1).gather(-1, response[..., None]).squeeze(-1)
    loss = spec_gspo(logps, logps.detach(), advantages, rollout.response_mask)
    params = [p for p in model.parameters() if p.requires_grad]
    return loss, torch.cat([grad.flatten() for grad in torch.autograd.grad(loss, params)])
