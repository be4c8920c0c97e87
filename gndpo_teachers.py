"""Several teachers, the sharded teacher and the self-teacher for gndpo_minimal.py: an optional module, loaded when
the flags ask.

Several teachers: --teacher_model name=path,name=path (a mapping in a recipe), and a data column (--teacher_column)
naming each row's teacher. Every teacher scores only its own rows, on the ids and images the student's processor
made. Normalization whitens all tokens together (global) or each teacher's on their own (--advantage_mode
per_teacher, registered in the script's ADVANTAGES), and the metrics line adds each teacher's statistics.
The sharded teacher: --shard_teacher shards one frozen 16-bit teacher's layers over the processes (FSDP2).
The self-teacher: --teacher_model self, the student's own weights (--self_teacher_weights: the starting ones, the
current ones or their moving average) reading privileged context in its prompt (OPSD), another prompt's context
(OP2SD's control) or none.

gndpo_minimal.py imports this module plainly and plugs SeveralTeachers into the step when --teacher_model names
several; this module imports nothing from the script: register and plug_in read what they need (the prompt encoder,
the whitening, the std from running sums) from the script's module object. The method is GNDPO (arXiv 2606.09091);
several teachers and the self-teacher go beyond the paper.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import os
import string
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


def _flag(default, help: str):
    return field(default=default, metadata={"help": help})


@dataclass
class TeacherArgs:
    """The flags of several teachers and of the self-teacher (--teacher_model self)."""

    _argument_group_name = "several teachers, the self-teacher (gndpo_teachers.py)"
    teacher_column: str = _flag("teacher", "Several teachers: the column naming each row's teacher.")
    privileged_column: str | None = _flag(None, "Self-teacher: the column of context its prompt holds (answer).")
    privileged_template: str = _flag("\n\nReference solution: {context}", "Appended to the teacher's user turn.")
    privileged_source: str = _flag(
        "own", "own (OPSD) | other: another prompt's (OP2SD) | none: the plain self-teacher."
    )
    max_teacher_prompt_length: int = _flag(
        1024, "Skip (and count) rows whose teacher prompt, context included, is longer."
    )
    self_teacher_weights: str = _flag(
        "start", "Self-teacher: start (the starting weights) | current (the student's) | ema (their moving average)."
    )
    self_teacher_ema_decay: float = _flag(0.999, "ema: the share of the average kept at each step (0: current).")


ARGS = TeacherArgs  # the script parses these with its own Args
RANGES = {"max_teacher_prompt_length": 1, "self_teacher_ema_decay": 0}  # the lowest values, checked by the script


def teacher_paths(value: str) -> dict[str, str]:
    """--teacher_model's name=path pairs, comma-separated, as {name: path}."""
    pairs = [item.split("=", 1) for item in value.split(",") if item.strip()]
    names = [name.strip() for name, _ in pairs]
    if any(len(pair) < 2 for pair in pairs) or any(not name for name in names) or len(set(names)) < len(names):
        raise ValueError(
            f"--teacher_model {value!r}: several teachers are name=path pairs with distinct, non-empty "
            f"names, e.g. color=path/to/a,shape=path/to/b"
        )
    return {name.strip(): path.strip() for name, path in pairs}


def check_teacher_column(ds, column: str, names: list[str], split: str) -> None:
    """Stops unless every row of the split names one of the loaded teachers in `column`: a row routed to no teacher,
    or to one that was not loaded, cannot be scored."""
    if column not in ds.column_names:
        raise ValueError(
            f"several teachers ({', '.join(names)}), but the {split!r} split has no column {column!r} "
            f"naming each row's teacher; its columns are {ds.column_names}: pass --teacher_column"
        )
    values = ds.select_columns([column])[column]
    unknown = [(i, v) for i, v in enumerate(values) if v not in names]
    if unknown:
        counts = {str(v): sum(1 for _, u in unknown if u == v) for v in dict.fromkeys(v for _, v in unknown)}
        raise ValueError(
            f"{len(unknown)} rows of the {split!r} split name no loaded teacher in column {column!r} "
            f"(first: row {unknown[0][0]}; values and counts {counts}); the teachers are {names}: add "
            f"them to --teacher_model as name=path, or fix the rows"
        )


def route_to_teachers(rollouts: list, teachers: list[str], names: list[str], encode: Callable) -> list:
    """Each micro-batch's rows by teacher, in place: rollout.extra gets "teachers" ((n,) each row's name),
    "teacher_ids" ((n,) its index in `names`, the loaded teachers' order) and "by_teacher" ({name: ((k,) row
    positions, a rollout of those k rows)}). A micro-batch of one teacher is its own part; the rows of a mixed one
    are sliced and encode(part, rows) encodes their prompts again (rows: positions in the step's rows), so that a
    teacher's forward reads its own rows only. teachers: (rows of the step,) each row's teacher name."""
    start = 0
    for r in rollouts:
        n = r.response_ids.shape[0]
        mine = teachers[start : start + n]
        r.extra.update(teachers=mine, teacher_ids=torch.tensor([names.index(t) for t in mine]), by_teacher={})
        for name in dict.fromkeys(mine):  # in order of first appearance
            rows = [i for i, t in enumerate(mine) if t == name]
            index = torch.tensor(rows, device=r.response_ids.device)
            if len(rows) == n:
                part = dataclasses.replace(r, extra={**r.extra, "teachers": [name] * n, "by_teacher": None})
            else:
                R = max(1, int(r.response_mask[index].sum(1).max()))
                part = dataclasses.replace(
                    r,
                    response_ids=r.response_ids[index, :R],
                    response_mask=r.response_mask[index, :R],
                    sampled_logps=r.sampled_logps[index, :R],
                    row_inputs=None,
                    extra={"teachers": [name] * len(rows)},
                )
                part = encode(part, [start + i for i in rows], r.row_inputs is not None, "prompt_index" in r.extra)
            r.extra["by_teacher"][name] = (index, part)
        start += n
    return rollouts


def routed_forward(forward: Callable) -> Callable:
    """A teacher scoring forward for Models.teacher_forward, (teachers {name: model}, rollout, ignore_ids) -> (n, R)
    float32: each row's log-probs from its own teacher, forward(model, part, ignore_ids) on that teacher's rows only
    (rollout.extra["by_teacher"], route_to_teachers)."""

    def several(teachers: dict, rollout, ignore_ids: torch.Tensor | None) -> torch.Tensor:
        if not rollout.extra.get("by_teacher"):
            raise ValueError("several teachers: each rollout needs its rows by teacher (route_to_teachers)")
        out = torch.zeros(rollout.response_ids.shape, device=rollout.response_ids.device)  # (n, R)
        for name, (rows, part) in rollout.extra["by_teacher"].items():
            out[rows, : part.response_ids.shape[1]] = forward(teachers[name], part, ignore_ids)
        return out

    return several


def evaluate_each(evaluate: Callable, models: dict, rows: list[tuple]) -> dict:
    """evaluate(model, rows) -> {accuracy, format_rate, rows} on each teacher's rows (row[3]: its name) with
    models[name]: accuracy and format_rate over all rows together, accuracy_per_teacher {name: accuracy}, and rows
    [(index in `rows`, answer, correct, teacher name)] in order."""
    where = {name: [i for i, row in enumerate(rows) if row[3] == name] for name in models}
    parts = {name: evaluate(model, [rows[i] for i in where[name]]) for name, model in models.items() if where[name]}
    counts = {name: len(where[name]) for name in parts}
    total = sum(counts.values())
    records = sorted((where[name][i], answer, ok, name) for name in parts for i, answer, ok in parts[name]["rows"])
    return {
        key: sum(parts[name][key] * counts[name] for name in parts) / total for key in ("accuracy", "format_rate")
    } | {"accuracy_per_teacher": {name: parts[name]["accuracy"] for name in sorted(parts)}, "rows": records}


def teacher_sums(batch) -> dict:
    """This process's token count, KL, score and advantage sums over each teacher's valid tokens, keyed name/what
    (a ScoredBatch whose extra holds teacher_ids and teacher_names)."""
    out = {}
    for k, name in enumerate(batch.extra["teacher_names"]):
        mask = batch.response_mask.bool() & (batch.extra["teacher_ids"] == k)[:, None]
        scores, advantages = batch.scores[mask].double(), batch.advantages[mask].double()
        out.update(
            {
                f"{name}/tokens": float(mask.sum()),
                f"{name}/kl": (batch.student_logps[mask] - batch.teacher_logps[mask]).sum().item(),
                f"{name}/score_sum": scores.sum().item(),
                f"{name}/score_sq_sum": (scores**2).sum().item(),
                f"{name}/adv_sum": advantages.sum().item(),
                f"{name}/adv_sq_sum": (advantages**2).sum().item(),
            }
        )
    return out


def teacher_metrics(r: dict, names: list[str], spread: Callable) -> dict:
    """The metrics line's teacher/<name>/ keys from teacher_sums reduced over processes; spread(n, sum, sum of
    squares) is the script's std from running sums, so each teacher's stds are the whole batch's kind."""
    out = {}
    for name in names:
        n, key = max(r[f"{name}/tokens"], 1.0), f"teacher/{name}/"
        out.update(
            {
                key + "reverse_kl": r[f"{name}/kl"] / n,
                key + "score_mean": r[f"{name}/score_sum"] / n,
                key + "score_std": spread(n, r[f"{name}/score_sum"], r[f"{name}/score_sq_sum"]),
                key + "adv_mean": r[f"{name}/adv_sum"] / n,
                key + "adv_std": spread(n, r[f"{name}/adv_sum"], r[f"{name}/adv_sq_sum"]),
                key + "tokens": int(r[f"{name}/tokens"]),
            }
        )
    return out


def per_teacher_advantages(
    scores: torch.Tensor,
    response_mask: torch.Tensor,
    teacher_ids: torch.Tensor,
    num_teachers: int,
    whiten: Callable,
    eps: float = 1e-8,
    all_reduce: bool = True,
) -> torch.Tensor:
    """--advantage_mode per_teacher: each teacher's tokens whitened with that teacher's statistics over the global
    batch. scores, response_mask (B, T); teacher_ids (B,) in 0..num_teachers-1, the same num_teachers on every
    process; whiten(scores, mask, count, total, total_sq, eps) is the script's. Returns (B, T), 0 off the mask.
    Raises ValueError unless every teacher that has tokens has at least 2."""
    mask = response_mask.to(torch.float64)
    s = scores.double() * mask
    ids = teacher_ids.to(s.device)
    zeros = torch.zeros(num_teachers, dtype=torch.float64, device=s.device)
    sums = torch.stack([zeros.index_add(0, ids, x.sum(1)) for x in (mask, s, s * s)])  # (3, K) by teacher
    if all_reduce and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(sums)
    if ((sums[0] > 0) & (sums[0] < 2)).any() or sums[0].sum() < 2:
        raise ValueError(
            f"per_teacher normalization needs at least 2 valid response tokens of every teacher that has any, got "
            f"{sums[0].long().tolist()} by teacher: raise max_new_tokens or prompts_per_step"
        )
    return whiten(scores, mask, *(x[ids][:, None] for x in sums), eps)


def register(script) -> None:
    """per_teacher into the script's ADVANTAGES: (scores, mask, group_ids, extra, args) -> advantages, extra holding
    the batch's teacher_ids and teacher_names (SeveralTeachers.batch_extra); the script's whiten."""

    def per_teacher(scores, mask, group_ids, extra, args):
        if "teacher_ids" not in extra:
            raise ValueError("per_teacher normalization needs several teachers: each row's teacher (teacher_ids)")
        return per_teacher_advantages(scores, mask, extra["teacher_ids"], len(extra["teacher_names"]), script.whiten)

    script.ADVANTAGES["per_teacher"] = per_teacher


class SeveralTeachers:
    """The plug-in behind several teachers (the script's Models.plugins). teachers {name: model}; column: the data
    column naming each row's teacher; encode(part, prompts, group_ids, row_prompts, distinct) encodes a routed part's
    prompts again (plug_in's: every row's, or through gndpo_fast's prompt sharing); spread(n, sum, sum of squares) is
    the script's std from running sums."""

    def __init__(self, teachers: dict, column: str, encode: Callable, spread: Callable):
        self.teachers, self.names, self.column, self.encode, self.spread = (
            teachers,
            list(teachers),
            column,
            encode,
            spread,
        )

    def forward(self, forward: Callable) -> Callable:
        """The teacher scoring forward that scores each row with its own teacher (routed_forward)."""
        return routed_forward(forward)

    def route(self, prompts, rollouts: list) -> list:
        """After sampling: each micro-batch's rows by teacher (route_to_teachers; prompts.rows: each row's data)."""

        def encode(part, rows, *flags):  # rows: positions in the step's rows
            return self.encode(part, [prompts.prompts[i] for i in rows], [prompts.group_ids[i] for i in rows], *flags)

        teachers = [row[self.column] for row in prompts.rows]
        return route_to_teachers(rollouts, teachers, self.names, encode)

    def batch_extra(self, rollouts: list) -> dict:
        """What per_teacher and the metrics read from a scored batch: the names, and (n,) each row's teacher index."""
        ids = torch.cat([r.extra["teacher_ids"] for r in rollouts]).to(rollouts[0].response_ids.device)
        return {"teacher_names": self.names, "teacher_ids": ids}

    def metric_sums(self, batch) -> dict:
        return teacher_sums(batch)

    def metrics(self, r: dict, batch) -> dict:
        return teacher_metrics(r, self.names, self.spread)

    def evaluate(self, one: Callable, model, rows: list[tuple]) -> dict:
        """one(model, rows) on each teacher's rows: the teachers each with their own, the student on all of them;
        accuracy_per_teacher, and the metrics line's teacher/<name>/eval_accuracy."""
        result = evaluate_each(one, model if model is self.teachers else dict.fromkeys(self.names, model), rows)
        result["metrics"] = {f"teacher/{k}/eval_accuracy": v for k, v in result["accuracy_per_teacher"].items()}
        return result


def shard_frozen(model, device_type: str, num_processes: int) -> int:
    """Shards a frozen model's layers over the processes with FSDP2 (fully_shard), in place: each process keeps 1/N
    of every decoder layer and vision block (the classes the model names in _no_split_modules) and gathers a layer's
    weights for its forward only. The embeddings and the LM head stay whole. Each layer is its own FSDP root, and a
    root keeps its gathered weights after a forward by default: reshard_after_forward=True frees them after every
    forward. Every process must then run the model's forward as many times as the others (the script's teacher
    scoring reads every row's prompt for that). Returns the number of modules sharded."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    kinds = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in kinds]
    if not layers:
        raise ValueError(
            f"--shard_teacher: {type(model).__name__} names no layer classes (_no_split_modules) to "
            f"shard; run without --shard_teacher"
        )
    mesh = init_device_mesh(device_type, (num_processes,))
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    return len(layers)


# ---------------------------------------------------------------------------------------------
# The self-teacher (--teacher_model self): the student's own weights, reading privileged context
# ---------------------------------------------------------------------------------------------

SELF = "self"  # --teacher_model's value for the self-teacher
SOURCES = ("own", "other", "none")  # --privileged_source: the row's own context (OPSD), another prompt's (OP2SD), none
WEIGHTS = ("start", "current", "ema")  # --self_teacher_weights: the starting weights, the student's, their average


def context_text(context) -> str | None:
    """A privileged context cell as text: a string, a number, or chat messages (their text contents joined, roles
    named; never str() of the list); None when it holds no text."""
    if isinstance(context, (list, tuple)):
        parts = []
        for m in context:
            content = m.get("content", m.get("value")) if isinstance(m, dict) else m
            if isinstance(content, (list, tuple)):
                content = "\n".join(i.get("text") or "" for i in content if isinstance(i, dict))
            role = m.get("role") or m.get("from") if isinstance(m, dict) else None
            if isinstance(content, str) and content.strip():
                parts.append(f"{role}: {content}" if role and len(context) > 1 else content)
        context = "\n".join(parts)
    text = None if context is None else str(context)
    return text if text and text.strip() else None


def privileged_prompt(prompt, context: str, template: str):
    """The teacher's prompt: `prompt` (text or chat messages) with template.format(context=context) appended to its
    user turn's text, so the context sits inside the user turn, before the assistant marker. What is appended stays
    text where it holds "<image>": a chat whose text item marks it literal (literal_from, which gndpo_data's
    build_messages never splits at markers); a text prompt stays text where nothing appended holds one."""
    extra = template.format(context=context)
    if isinstance(prompt, str) and "<image>" not in extra:
        return prompt + extra
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
    last = messages[-1]
    content = last.get("content")
    items = [{"type": "text", "text": content}] if isinstance(content, str) else list(content or [])
    if items and isinstance(items[-1], dict) and items[-1].get("type") == "text":
        text = items[-1].get("text") or ""
        items[-1] = {**items[-1], "text": text + extra, "literal_from": len(text)}
    else:
        items.append({"type": "text", "text": extra.lstrip("\n"), "literal_from": 0})
    last["content"] = items
    return messages


def place_contexts(prompts: list, contexts: list, template: str) -> list:
    """(prompt, images) pairs with each row's context placed by privileged_prompt (a row without one keeps its
    prompt): the teacher's prompts."""
    texts = [None if c is None else context_text(c) for c in contexts]
    return [(q if c is None else privileged_prompt(q, c, template), imgs) for (q, imgs), c in zip(prompts, texts)]


def row_contexts(contexts: list, group_ids: list[int], source: str, fits: Callable | None = None) -> tuple[list, dict]:
    """Each row's context under --privileged_source, and what OP2SD could not place. own: the row's; none: None;
    other (OP2SD, context without privilege): the context of the next prompt of the batch, cyclically, whose context
    text differs from the prompt's own and whose teacher prompt, that context placed, fits (fits([(row, context)]) ->
    [bool], row: the prompt's first row; None: every one fits); the G rows of a prompt share it. A prompt no other
    prompt's context serves gets None: its rows are dropped from the step. Returns ((n,) each row's context, counts:
    other's {"missing": prompts left without one, "too_long": contexts passed over for their length})."""
    if source != "other":
        return (list(contexts) if source == "own" else [None] * len(contexts)), {}
    texts = [(context_text(c) or "").strip() for c in contexts]
    first = {}  # each prompt's first row
    for row, group in enumerate(group_ids):
        first.setdefault(group, row)
    groups = list(first)
    if len(groups) < 2:
        raise ValueError("--privileged_source other needs at least 2 distinct prompts on each process")
    n = len(groups)
    along = {g: iter([first[groups[(k + d) % n]] for d in range(1, n)]) for k, g in enumerate(groups)}  # the cycle
    refused = {g: {texts[first[g]]} for g in groups}  # the texts a prompt cannot take: its own, those too long
    chosen, counts, pending = {}, {"missing": 0, "too_long": 0}, groups
    while pending:
        asks = []  # (prompt, the row whose context it would take)
        for g in pending:
            row = next((row for row in along[g] if texts[row] not in refused[g]), None)
            if row is None:  # back at itself
                chosen[g] = None
                counts["missing"] += 1
            else:
                asks.append((g, row))
        fit = fits([(first[g], contexts[row]) for g, row in asks]) if fits and asks else [True] * len(asks)
        pending = []
        for (g, row), ok in zip(asks, fit):
            if ok:
                chosen[g] = contexts[row]
            else:  # passed over, and every later context of the same text with it
                counts["too_long"] += 1
                refused[g].add(texts[row])
                pending.append(g)
    return [chosen[g] for g in group_ids], counts


# why the script's prepare_split skips a row for the self-teacher, and the flag that fixes it
SKIPS = {"no_privileged_context": "--privileged_column", "teacher_prompt_too_long": "--max_teacher_prompt_length"}


def data_columns(ds, args, split: str, error=ValueError) -> dict:
    """{flag: column} of the split's columns these options read: the rows' teachers (each naming a loaded one), the
    self-teacher's context. error: what a missing context column raises (the script's UsageError)."""
    columns = {}
    if "=" in args.teacher_model and len(names := list(teacher_paths(args.teacher_model))) > 1:
        check_teacher_column(ds, args.teacher_column, names, split)
        columns["teacher_column"] = args.teacher_column
    if args.privileged_column:
        if args.privileged_column not in ds.column_names:
            raise error(
                f"the {split!r} split has no column {args.privileged_column!r} (--privileged_column); its columns "
                f"are {ds.column_names}: pass --privileged_column with the one that holds the context"
            )
        columns["privileged_column"] = args.privileged_column
    return columns


def row_skips(args) -> dict:
    """SKIPS where the self-teacher reads privileged context, else none: the reasons prepare_split counts."""
    return SKIPS if args.privileged_column else {}


def check_row(row: dict, args) -> None:
    """ValueError for a row without privileged context (the self-teacher reads one)."""
    if context_text(row.get(args.privileged_column)) is None:
        raise ValueError(f"no privileged context in column {args.privileged_column!r}")


def teacher_prompts_fit(rows: list, data: list, args, lengths: Callable) -> torch.Tensor:
    """(n,) bool: the self-teacher's prompt of each row, its own context placed, fits --max_teacher_prompt_length
    (never cut to the student's bound): OPSD's training prompts and every evaluation's (OP2SD's borrowed contexts are
    checked where SelfTeacher.route places them). rows: [(prompt, images)]; data: (n,) the rows' columns;
    lengths(rows) -> (n,) token counts."""
    if args.privileged_source == "none":
        return torch.ones(len(rows), dtype=torch.bool)
    contexts = [row.get(args.privileged_column) for row in data]
    return lengths(place_contexts(rows, contexts, args.privileged_template)) <= args.max_teacher_prompt_length


# the self-teacher's flags, each refused without --teacher_model self when it is not at its default
SELF_FLAGS = (
    "privileged_column",
    "privileged_template",
    "privileged_source",
    "max_teacher_prompt_length",
    "self_teacher_weights",
    "self_teacher_ema_decay",
)


def template_problem(template: str) -> str | None:
    """Why --privileged_template cannot place a context, or None: it holds one {context} field and no other ({{ and
    }} are literal braces)."""
    try:
        names = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as e:
        return f"--privileged_template {template!r} is not a format string ({e}): write a literal brace as {{{{ or }}}}"
    if names != ["context"]:
        fields = ", ".join("{" + name + "}" for name in names) or "none ({{context}} is the text {context}, not one)"
        return (
            f"--privileged_template {template!r} must hold one {{context}} placeholder and no other; it holds {fields}"
        )
    return None


def check_args(script, args, num_processes: int) -> list[str]:
    """The problems with this module's flags in the run's arguments (several teachers, the sharded teacher, the
    self-teacher), each a line naming the flag and the fix."""
    problems = list(filter(None, [moving_average_resume(script, args)]))
    many = "=" in args.teacher_model and len(teacher_paths(args.teacher_model)) > 1
    if args.advantage_mode == "per_teacher" and not many:
        problems.append(
            "--advantage_mode per_teacher whitens each teacher's tokens on their own: it needs several teachers "
            "(--teacher_model name=path,name=path)"
        )
    if args.shard_teacher and (many or args.teacher_4bit):
        problems.append(
            "--shard_teacher shards one 16-bit or float32 teacher with FSDP2, which cannot shard bitsandbytes' 4-bit "
            "weights: pass --teacher_4bit false and a single --teacher_model"
        )
    if "=" in args.teacher_model and SELF in teacher_paths(args.teacher_model).values():
        problems.append("--teacher_model self is one teacher, the student itself: it does not mix with several")
    if args.teacher_model != SELF:  # set, they would be ignored
        given = [f"--{flag}" for flag in SELF_FLAGS if getattr(args, flag) != getattr(TeacherArgs, flag)]
        if given:
            are, need = ("are", "they need") if len(given) > 1 else ("is", "it needs")
            problems.append(f"{', '.join(given)} {are} the self-teacher's: {need} --teacher_model self")
        return problems
    problems += filter(None, [template_problem(args.privileged_template)])
    if args.privileged_source not in SOURCES:
        problems.append(f"--privileged_source {args.privileged_source!r} is not one of {SOURCES}")
    if args.privileged_source != "none" and not args.privileged_column:
        problems.append("--teacher_model self reads privileged context: name its column with --privileged_column")
    if args.privileged_source == "other" and args.prompts_per_step // max(num_processes, 1) < 2:
        problems.append(
            "--privileged_source other takes another prompt's context: --prompts_per_step needs 2 per process"
        )
    if args.shard_teacher:
        problems.append("--shard_teacher shards a teacher of its own; the self-teacher is the student")
    if args.self_teacher_weights not in WEIGHTS:
        problems.append(f"--self_teacher_weights {args.self_teacher_weights!r} is not one of {WEIGHTS}")
    if args.self_teacher_ema_decay > 1:
        problems.append(f"--self_teacher_ema_decay must be in [0, 1], got {args.self_teacher_ema_decay}")
    elif args.self_teacher_weights != "ema" and args.self_teacher_ema_decay != TeacherArgs.self_teacher_ema_decay:
        problems.append("--self_teacher_ema_decay is the moving average's: it needs --self_teacher_weights ema")
    ema0 = args.self_teacher_weights == "ema" and args.self_teacher_ema_decay == 0
    if args.privileged_source == "none" and (args.self_teacher_weights == "current" or ema0):
        problems.append(
            "--privileged_source none with the current weights: the teacher is the student reading its own prompt, "
            "so every score is rounding noise (which global whitening scales up): use start or ema, or a context"
        )
    return problems


def moving_average_resume(script, args) -> str | None:
    """A resume from a checkpoint saved with the self-teacher's moving average by a run without it, or the reverse, as
    a line: Accelerate would fail to load its states (it restores the objects registered for checkpointing by count)."""
    resume = args.resume_from_checkpoint
    found = script.list_checkpoints(args.output_dir) if resume == "latest" else [(0, resume)]
    state = os.path.join(found[-1][1], "trainer_state.json") if resume and found else ""
    if not os.path.isfile(state):  # a fresh start, or a checkpoint the script refuses itself
        return None
    with open(state) as f:
        saved = json.load(f)["args"]
    averaged = [a.get("teacher_model") == SELF and a.get("self_teacher_weights") == "ema" for a in (saved, vars(args))]
    if averaged[0] == averaged[1]:
        return None
    flags = f"--teacher_model {saved.get('teacher_model')} --self_teacher_weights {saved.get('self_teacher_weights')}"
    which = "which this run keeps" if averaged[1] else "which this run does not keep"
    return (
        f"{os.path.dirname(state)} was saved {'with' if averaged[0] else 'without'} the self-teacher's moving average "
        f"(--self_teacher_weights ema), {which}: resume with its {flags}, or start over in another --output_dir"
    )


def own_teachers(args, teachers: dict, student, accelerator, log=print) -> None:
    """In place, after the script's load_models loaded the named teachers: the self-teacher ({"self": the model its
    weights are read from, SelfWeights}), the sharded teacher sharded. The self-teacher's model is the student itself,
    but for full fine-tuning (--lora_r 0) under start and ema: a frozen copy of the student as loaded, in its own
    dtype (float32 master weights under mixed precision), run under its autocast, so that it computes as the student
    does (a copy loaded in the compute dtype would not: bf16 weights)."""
    if args.teacher_model == SELF:
        full_copy = not args.lora_r and args.self_teacher_weights in ("start", "ema")
        teachers["self"] = (
            copy.deepcopy(student).eval().requires_grad_(False).to(accelerator.device) if full_copy else student
        )
    if args.shard_teacher and accelerator.num_processes > 1:
        sharded = shard_frozen(next(iter(teachers.values())), accelerator.device.type, accelerator.num_processes)
        log(f"teacher: {sharded} layers sharded over {accelerator.num_processes} processes (FSDP2)")


class MovingAverage:
    """--self_teacher_weights ema: average <- decay * average + (1 - decay) * theta for each trained tensor theta of
    the student, after every step (update); it starts at the starting weights. averages {name: tensor}: LoRA, float32
    copies of the adapter's tensors; full fine-tuning, the frozen copy's own. trained {name: the student's trained
    parameter}. Accelerate saves it in every checkpoint and restores it on resume (register_for_checkpointing)."""

    def __init__(self, averages: dict, trained: dict, decay: float):
        self.averages, self.trained, self.decay = averages, trained, decay

    @torch.no_grad()
    def update(self) -> None:
        for name, average in self.averages.items():  # lerp with weight 1 (decay 0) returns theta exactly
            average.lerp_(self.trained[name].detach().to(average.dtype), 1.0 - self.decay)

    @contextlib.contextmanager
    def swapped_in(self):
        """Within it the trained tensors hold the average (in their own dtype); after it, their own values, bit for
        bit."""
        saved = {name: p.detach().clone() for name, p in self.trained.items()}
        try:
            with torch.no_grad():
                for name, p in self.trained.items():
                    p.copy_(self.averages[name])
            yield
        finally:
            with torch.no_grad():
                for name, p in self.trained.items():
                    p.copy_(saved[name])

    def state_dict(self) -> dict:
        return dict(self.averages)

    def load_state_dict(self, state: dict) -> None:
        if state.keys() != self.averages.keys():
            raise ValueError(
                "the checkpoint's moving average (--self_teacher_weights ema) holds other tensors than this run "
                "trains: resume with the flags the checkpoint was saved with"
            )
        with torch.no_grad():
            for name, average in self.averages.items():
                average.copy_(state[name])


class SelfWeights:
    """The self-teacher as the step sees it (the script's Models.teacher): `model` read as --self_teacher_weights
    says. start: LoRA, the student itself with its adapter disabled (no second copy); full fine-tuning, a frozen copy
    of the starting weights. current: the student as it is. ema: LoRA, the student with its adapter's tensors swapped
    for their moving average while it reads; full fine-tuning, a frozen copy whose trained tensors are the average
    (average: the MovingAverage). precision: () -> the student's autocast under mixed precision, so that the teacher
    computes as the student does."""

    def __init__(
        self,
        model,
        lora: bool,
        weights: str = "start",
        precision: Callable = contextlib.nullcontext,
        average: MovingAverage | None = None,
    ):
        self.model, self.lora, self.weights, self.precision, self.average = model, lora, weights, precision, average

    @contextlib.contextmanager
    def reading(self):
        """Within it self.model computes as the teacher's weights, in eval mode (no dropout) and the student's
        precision; restored after."""
        was_training = self.model.training
        adapter_off = (
            self.model.disable_adapter() if self.lora and self.weights == "start" else contextlib.nullcontext()
        )
        averaged = self.average.swapped_in() if self.lora and self.average else contextlib.nullcontext()
        try:
            with adapter_off, averaged, self.precision():
                yield self.model.eval()
        finally:
            self.model.train(was_training)

    def words(self) -> str:
        """What the teacher reads, for the log."""
        where = {
            "start": ("starting", "its adapter disabled" if self.lora else "a frozen copy"),
            "current": ("current", "its adapter enabled" if self.lora else "the student itself"),
            "ema": (
                "moving-average",
                "its adapter's average swapped in" if self.lora else "a copy holding the average",
            ),
        }[self.weights]
        decay = f", decay {self.average.decay:g}" if self.average else ""
        return f"the student's {where[0]} weights ({where[1]}{decay})"


class SelfTeacher:
    """The plug-in behind --teacher_model self (the script's Models.plugins): the teacher is the student's weights as
    --self_teacher_weights says (SelfWeights) reading the student's prompt with the privileged context appended to its
    user turn (privileged_prompt); the response ids are the rollout's own, after that prompt. encode(prompts, device)
    -> a processor batch (the script's encode_prompts, pixels on the host); lengths(prompts) -> (n,) their token
    counts; args: --privileged_template, --privileged_source and --max_teacher_prompt_length."""

    def __init__(self, teacher: SelfWeights, encode: Callable, lengths: Callable, args):
        self.teacher, self.encode, self.lengths, self.column = teacher, encode, lengths, args.privileged_column
        self.template, self.source, self.bound = (
            args.privileged_template,
            args.privileged_source,
            args.max_teacher_prompt_length,
        )
        self.counts = {}  # this step's, from row_contexts (OP2SD's missing and too long), for the metrics line

    def prompts(self, prompts: list, contexts: list) -> list:
        return place_contexts(prompts, contexts, self.template)

    def fits(self, prompts: list, asks: list) -> list[bool]:
        """Whether each (row, context) of asks, that context placed in that row's prompt, fits the teacher's bound."""
        placed = self.prompts([prompts[row] for row, _ in asks], [context for _, context in asks])
        return (self.lengths(placed) <= self.bound).tolist()

    def route(self, prompts, rollouts: list) -> list:
        """After sampling: each micro-batch's teacher prompts, encoded (rollout.extra["teacher_inputs"]); rows OP2SD
        found no context for are dropped (their response mask zeroed: no token of theirs is scored or trained)."""
        if self.source == "none":  # the plain self-teacher reads the student's own prompt
            return rollouts
        contexts = [row.get(self.column) for row in prompts.rows]
        contexts, self.counts = row_contexts(
            contexts, prompts.group_ids, self.source, lambda asks: self.fits(prompts.prompts, asks)
        )
        start = 0
        for r in rollouts:
            n = r.response_ids.shape[0]
            mine = contexts[start : start + n]
            dropped = torch.tensor([c is None for c in mine], device=r.response_mask.device)
            r.response_mask[dropped] = 0
            r.extra["teacher_inputs"] = self.encode(
                self.prompts(prompts.prompts[start : start + n], mine), r.response_ids.device
            )
            start += n
        return rollouts

    def forward(self, forward: Callable) -> Callable:
        """The teacher's scoring forward: forward(model, rollout, ignore_ids) on the teacher's prompts, in the
        teacher's weights."""

        def self_teacher(teacher: SelfWeights, rollout, ignore_ids: torch.Tensor | None, temperature: float = 1.0):
            if "teacher_inputs" in rollout.extra:  # the distinct prompts are the student's: the teacher reads its own
                extra = {k: v for k, v in rollout.extra.items() if k not in ("prompt_inputs", "prompt_index")}
                rollout = dataclasses.replace(rollout, row_inputs=rollout.extra["teacher_inputs"], extra=extra)
            with teacher.reading() as model:
                return forward(model, rollout, ignore_ids)

        return self_teacher

    def metric_sums(self, batch) -> dict:
        return {f"other_context_{k}": float(v) for k, v in self.counts.items()}

    def metrics(self, r: dict, batch) -> dict:
        """OP2SD's keys: other_context_missing (prompts left without another context: rows dropped) and
        other_context_too_long (contexts passed over for their length), over all processes."""
        return {f"other_context_{k}": int(r[f"other_context_{k}"]) for k in self.counts}

    def after_step(self, run, metrics: dict) -> None:
        """After the step's update: the moving average moves (ema); OP2SD's steps that left a prompt without another
        context, counted (other_context_missing_steps, in the metrics line and summary.json)."""
        if self.teacher.average is not None:
            self.teacher.average.update()
        if self.source == "other":
            key = "other_context_missing_steps"
            run.counters[key] = run.counters.get(key, 0) + int(metrics["other_context_missing"] > 0)
            metrics[key] = run.counters[key]

    def evaluate(self, one: Callable, model, rows: list[tuple]) -> dict:
        """one(model, rows) on the eval rows; the teacher reads each row's own context (row[3]) in its weights."""
        if model is not self.teacher:
            return one(model, rows)
        if self.source != "none":
            contexts = [row[3] if len(row) > 3 else None for row in rows]
            rows = [(*pair, *row[2:]) for pair, row in zip(self.prompts([r[:2] for r in rows], contexts), rows)]
        with self.teacher.reading() as inner:
            return one(inner, rows)


def self_teacher(script, models, args, accelerator) -> tuple[SelfTeacher, str]:
    """The self-teacher into the script's Models (plug_in): the weights the step reads (SelfWeights; ema: the moving
    average, registered for Accelerate's checkpoints), the plug-in that places the contexts, and the words for the
    start-up line."""
    processor, instruction = models.processor, args.instruction
    student, model = accelerator.unwrap_model(models.student), accelerator.unwrap_model(models.teacher)
    average = None
    if args.self_teacher_weights == "ema":
        if script.weights_are_sharded(accelerator):
            raise script.UsageError(
                "--self_teacher_weights ema keeps the average of whole tensors, which FSDP shards: use start or "
                "current, or launch without FSDP"
            )
        trained = {name: p for name, p in student.named_parameters() if p.requires_grad}
        copies = dict(model.named_parameters()) if model is not student else {}
        averages = {name: copies.get(name, p.detach().float().clone()) for name, p in trained.items()}
        average = MovingAverage(averages, trained, args.self_teacher_ema_decay)
        accelerator.register_for_checkpointing(average)
    models.teacher = SelfWeights(model, args.lora_r > 0, args.self_teacher_weights, models.sampling.precision, average)
    autocast = str(script.compute_dtype(accelerator) or "none").removeprefix("torch.")
    words = f"self-teacher: {models.teacher.words()}, in the student's compute precision (autocast {autocast})"

    def encode(rows: list, device) -> dict:  # the teacher's prompts, pixels on the host
        return script.pixels_on_host(script.encode_prompts(processor, rows, instruction), device)

    def lengths(rows: list) -> torch.Tensor:  # (n,) each teacher prompt's tokens, images included
        return script.encode_prompts(processor, rows, instruction)["attention_mask"].sum(1)

    return SelfTeacher(models.teacher, encode, lengths, args), words


def plug_in(script, models, args, teachers: dict, accelerator, log=print) -> str | None:
    """The self-teacher or several teachers into the script's Models, in place, when the flags ask: the teacher the
    step sees (SelfWeights, or {name: model}), its scoring forward wrapped, the plug-in appended. teachers: {name:
    model} (the script's load_models); script: the script's module object (encode_prompts, pixels_on_host, spread,
    compute_dtype, weights_are_sharded, UsageError). Returns the self-teacher's words for the start-up line."""
    processor, instruction = models.processor, args.instruction
    words = None
    if args.teacher_model == SELF:  # the student's weights, reading the context
        plugin, words = self_teacher(script, models, args, accelerator)
    elif len(teachers) > 1:  # each row routed to its own teacher, scored by it alone

        def encode(part, rows, group_ids, *flags):  # (row_prompts, distinct): its prompts encoded again
            if models.sampling.sharing is not None:  # gndpo_fast's prompt sharing; without it, every row's only
                return models.sampling.sharing.encode(processor, part, rows, group_ids, args, *flags)
            inputs = script.encode_prompts(processor, rows, instruction)
            part.row_inputs = script.pixels_on_host(inputs, part.response_ids.device)
            return part

        models.teacher = teachers
        plugin = SeveralTeachers(teachers, args.teacher_column, encode, script.spread)
    else:
        return
    models.teacher_forward = plugin.forward(models.teacher_forward or script.response_logps)
    models.plugins.append(plugin)
    return words
