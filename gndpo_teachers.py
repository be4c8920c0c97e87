"""Several teachers and the sharded teacher for gndpo_minimal.py: an optional module, loaded when the flags ask.

Several teachers: --teacher_model name=path,name=path (a mapping in a recipe), and a data column (--teacher_column)
naming each row's teacher. Every teacher scores only its own rows, on the ids and images the student's processor
made. Normalization whitens all tokens together (global) or each teacher's on their own (--advantage_mode
per_teacher, registered in the script's ADVANTAGES), and the metrics line adds each teacher's statistics.
The sharded teacher: --shard_teacher shards one frozen 16-bit teacher's layers over the processes (FSDP2).

gndpo_minimal.py imports this module plainly and plugs SeveralTeachers into the step when --teacher_model names
several; this module imports nothing from the script: register and plug_in read what they need (the prompt encoder,
the whitening, the std from running sums) from the script's module object. The method is GNDPO (arXiv 2606.09091);
several teachers and the self-teacher go beyond the paper.
"""

from __future__ import annotations

import contextlib
import dataclasses
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


ARGS = TeacherArgs  # the script parses these with its own Args
RANGES = {"max_teacher_prompt_length": 1}  # the lowest value, checked by the script


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
# The self-teacher (--teacher_model self): the student's own starting weights, reading privileged context
# ---------------------------------------------------------------------------------------------

SELF = "self"  # --teacher_model's value for the self-teacher
SOURCES = ("own", "other", "none")  # --privileged_source: the row's own context (OPSD), another prompt's (OP2SD), none


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
    user turn's text, so the context sits inside the user turn, before the assistant marker."""
    extra = template.format(context=context)
    if isinstance(prompt, str):
        return prompt + extra
    messages = [dict(m) for m in prompt]
    last = messages[-1]
    if isinstance(last.get("content"), str):
        last["content"] = last["content"] + extra
    else:
        items = list(last.get("content") or [])
        if items and isinstance(items[-1], dict) and items[-1].get("type") == "text":
            items[-1] = {**items[-1], "text": (items[-1].get("text") or "") + extra}
        else:
            items.append({"type": "text", "text": extra.lstrip("\n")})
        last["content"] = items
    return messages


def place_contexts(prompts: list, contexts: list, template: str) -> list:
    """(prompt, images) pairs with each row's context placed by privileged_prompt (a row without one keeps its
    prompt): the teacher's prompts."""
    texts = [None if c is None else context_text(c) for c in contexts]
    return [(q if c is None else privileged_prompt(q, c, template), imgs) for (q, imgs), c in zip(prompts, texts)]


def row_contexts(contexts: list, group_ids: list[int], source: str) -> list:
    """Each row's context under --privileged_source: own (the row's), other (the next distinct prompt's of the
    batch, cyclically: the G rows of one prompt share one context, never their own), none (None)."""
    if source == "none":
        return [None] * len(contexts)
    if source == "own":
        return list(contexts)
    first = {}
    for context, group in zip(contexts, group_ids):
        first.setdefault(group, context)
    groups = list(first)
    if len(groups) < 2:
        raise ValueError("--privileged_source other needs at least 2 distinct prompts on each process")
    shifted = {g: first[groups[(k + 1) % len(groups)]] for k, g in enumerate(groups)}
    return [shifted[g] for g in group_ids]


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
    (never cut to the student's bound). rows: [(prompt, images)]; data: (n,) the rows' columns; lengths(rows) -> (n,)
    token counts."""
    if args.privileged_source == "none":
        return torch.ones(len(rows), dtype=torch.bool)
    contexts = [row.get(args.privileged_column) for row in data]
    return lengths(place_contexts(rows, contexts, args.privileged_template)) <= args.max_teacher_prompt_length


def check_args(script, args, num_processes: int) -> list[str]:
    """The problems with this module's flags in the run's arguments (several teachers, the sharded teacher, the
    self-teacher), each a line naming the flag and the fix."""
    problems = []
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
    if args.privileged_column and args.teacher_model != SELF:
        problems.append("--privileged_column feeds the self-teacher's prompt: it needs --teacher_model self")
    if "{context}" not in args.privileged_template:
        problems.append(f"--privileged_template {args.privileged_template!r} holds no {{context}} placeholder")
    if args.privileged_source not in SOURCES:
        problems.append(f"--privileged_source {args.privileged_source!r} is not one of {SOURCES}")
    if args.teacher_model == SELF and args.privileged_source != "none" and not args.privileged_column:
        problems.append("--teacher_model self reads privileged context: name its column with --privileged_column")
    other = args.privileged_source == "other" and args.teacher_model == SELF
    if other and args.prompts_per_step // max(num_processes, 1) < 2:
        problems.append(
            "--privileged_source other takes another prompt's context: --prompts_per_step needs 2 per process"
        )
    if args.teacher_model == SELF and args.shard_teacher:
        problems.append("--shard_teacher shards a teacher of its own; the self-teacher is the student")
    return problems


def own_teachers(args, teachers: dict, student, load_copy: Callable, accelerator, log=print) -> None:
    """In place, after the script's load_models loaded the named teachers: the self-teacher ({"self": the student, or
    with --lora_r 0 a frozen copy, load_copy()}), the sharded teacher sharded."""
    if args.teacher_model == SELF:  # LoRA: the student itself, its adapter disabled; full fine-tuning: a frozen copy
        teachers["self"] = (
            load_copy().eval().requires_grad_(False).to(accelerator.device) if not args.lora_r else student
        )
    if args.shard_teacher and accelerator.num_processes > 1:
        sharded = shard_frozen(next(iter(teachers.values())), accelerator.device.type, accelerator.num_processes)
        log(f"teacher: {sharded} layers sharded over {accelerator.num_processes} processes (FSDP2)")


class StartingWeights:
    """The self-teacher as the step sees it (the script's Models.teacher): `model`, the student's starting weights.
    lora: the student itself, read with its adapter disabled (no second copy); else a frozen copy."""

    def __init__(self, model, lora: bool):
        self.model, self.lora = model, lora

    @contextlib.contextmanager
    def reading(self):
        """Within it self.model computes as the starting weights, in eval mode (no dropout); restored after."""
        was_training = self.model.training
        adapter_off = self.model.disable_adapter() if self.lora else contextlib.nullcontext()
        try:
            with adapter_off:
                yield self.model.eval()
        finally:
            self.model.train(was_training)


class SelfTeacher:
    """The plug-in behind --teacher_model self (the script's Models.plugins): the teacher is the student's frozen
    starting weights (StartingWeights) reading the student's prompt with the privileged context appended to its user
    turn (privileged_prompt); the response ids are the rollout's own, after that prompt. encode(prompts, device) ->
    a processor batch (the script's encode_prompts, pixels on the host); template and source: --privileged_template
    and --privileged_source."""

    def __init__(self, teacher: StartingWeights, encode: Callable, args):
        self.teacher, self.encode, self.column = teacher, encode, args.privileged_column
        self.template, self.source = args.privileged_template, args.privileged_source

    def prompts(self, prompts: list, contexts: list) -> list:
        return place_contexts(prompts, contexts, self.template)

    def route(self, prompts, rollouts: list) -> list:
        """After sampling: each micro-batch's teacher prompts, encoded (rollout.extra["teacher_inputs"])."""
        if self.source == "none":  # the plain self-teacher reads the student's own prompt
            return rollouts
        contexts = [row.get(self.column) for row in prompts.rows]
        contexts, start = row_contexts(contexts, prompts.group_ids, self.source), 0
        for r in rollouts:
            n = r.response_ids.shape[0]
            rows = self.prompts(prompts.prompts[start : start + n], contexts[start : start + n])
            r.extra["teacher_inputs"] = self.encode(rows, r.response_ids.device)
            start += n
        return rollouts

    def forward(self, forward: Callable) -> Callable:
        """The teacher's scoring forward: forward(model, rollout, ignore_ids) on the teacher's prompts, in the
        starting weights."""

        def self_teacher(teacher: StartingWeights, rollout, ignore_ids: torch.Tensor | None, temperature: float = 1.0):
            if "teacher_inputs" in rollout.extra:  # the distinct prompts are the student's: the teacher reads its own
                extra = {k: v for k, v in rollout.extra.items() if k not in ("prompt_inputs", "prompt_index")}
                rollout = dataclasses.replace(rollout, row_inputs=rollout.extra["teacher_inputs"], extra=extra)
            with teacher.reading() as model:
                return forward(model, rollout, ignore_ids)

        return self_teacher

    def evaluate(self, one: Callable, model, rows: list[tuple]) -> dict:
        """one(model, rows) on the eval rows; the teacher reads each row's own context (row[3]) in its weights."""
        if model is not self.teacher:
            return one(model, rows)
        if self.source != "none":
            contexts = [row[3] if len(row) > 3 else None for row in rows]
            rows = [(*pair, *row[2:]) for pair, row in zip(self.prompts([r[:2] for r in rows], contexts), rows)]
        with self.teacher.reading() as inner:
            return one(inner, rows)


def plug_in(script, models, args, teachers: dict, accelerator, log=print) -> None:
    """The self-teacher or several teachers into the script's Models, in place, when the flags ask: the teacher the
    step sees (StartingWeights, or {name: model}), its scoring forward wrapped, the plug-in appended. teachers: {name:
    model} (the script's load_models); script: the script's module object (encode_prompts, pixels_on_host, spread)."""
    processor, instruction = models.processor, args.instruction
    if args.teacher_model == SELF:  # the starting weights, reading the context

        def encode(rows: list, device) -> dict:  # the teacher's prompts, pixels on the host
            return script.pixels_on_host(script.encode_prompts(processor, rows, instruction), device)

        models.teacher = StartingWeights(accelerator.unwrap_model(models.teacher), lora=args.lora_r > 0)
        plugin = SelfTeacher(models.teacher, encode, args)
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
