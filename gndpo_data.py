"""Data formats beyond the plain one for gndpo_minimal.py: an optional module beside it, used when the data asks.

The script reads the plain layout itself: a Hub dataset, a save_to_disk folder or one JSONL/JSON/CSV/parquet file, with
an image column and a question column of text. This module reads the others (docs/data.md):
  - chat prompts: TRL's conversational `prompt`/`messages` columns, LLaVA's `conversations` (from/value turns), cut
    after the first user turn, whose assistant turn is the reference answer; `<image>` markers inside the text;
  - other column names at a flag's default: `images`, `prompt`, `messages`, `conversations`, `completion`;
  - image paths relative to the data file's folder (or --image_root), and a folder of split files beside its images;
  - answers given as numbers or as messages.
It imports nothing from the script: what it needs comes in as arguments.
"""

from __future__ import annotations

import os

# the columns looked for when a flag is at its default and its own column is missing
ALSO = {
    "image_column": ("images",),
    "question_column": ("prompt", "messages", "conversations"),
    "answer_column": ("completion",),
}
DATA_FILES = (".parquet", ".jsonl", ".json", ".csv")


def is_chat(cell) -> bool:
    """Whether a cell holds chat messages (a non-empty list of dicts)."""
    return isinstance(cell, (list, tuple)) and bool(cell) and all(isinstance(m, dict) for m in cell)


def message_text(content) -> str | None:
    """The text of a message's content (a string or a list of items), or None when it has none."""
    if isinstance(content, (list, tuple)):
        content = "\n".join(i.get("text") or "" for i in content if isinstance(i, dict) and i.get("type") == "text")
    return content if isinstance(content, str) and content.strip() else None


def split_chat(cell) -> tuple:
    """A prompt cell as (prompt, its answer or None), chat messages cut after the first user turn; never raises."""
    if not is_chat(cell):
        return cell, None
    prompt = []
    for m in cell:
        role = m.get("role") or m.get("from")
        m = {
            "role": {"human": "user", "gpt": "assistant"}.get(role, role) if isinstance(role, str) else role,
            "content": m["content"] if m.get("content") is not None else m.get("value"),
        }
        if prompt and prompt[-1]["role"] == "user":
            return prompt, message_text(m["content"]) if m["role"] == "assistant" else None
        prompt.append(m)
    return prompt, None


def answer_text(cell) -> str | None:
    """A reference answer from an answer cell: text, a number, or messages (TRL's `completion`); None when empty."""
    if is_chat(cell):
        return message_text(cell[0].get("content", cell[0].get("value")))
    return message_text(cell if cell is None else str(cell))


def build_messages(prompt, num_images: int, instruction: str = "") -> list[dict]:
    """The chat to render from a prompt (text or messages), images at its <image> markers or first; ValueError for a
    bad one. The instruction joins the user turn's last text. A text item's `literal_from` (a character index) keeps
    its text from there on whole, markers included (gndpo_teachers places privileged context so)."""
    prompt = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    if not is_chat(prompt) or not isinstance(prompt, list):
        raise ValueError(f"the prompt is {prompt!r}, not text or chat messages")
    if (roles := [m.get("role") for m in prompt])[-1] != "user" or any(r != "system" for r in roles[:-1]):
        raise ValueError(f"a chat prompt must be system turns then a user turn, got the roles {roles}")
    messages, markers = [], 0
    for m in prompt:
        items = [{"type": "text", "text": m["content"]}] if isinstance(m.get("content"), str) else m.get("content")
        if not isinstance(items, (list, tuple)) or not all(isinstance(item, dict) for item in items):
            raise ValueError(f"a {m['role']} message's content is {items!r}, not text or a list of items")
        if m["role"] == "user" and instruction:  # joined to the turn's last text, else a text of its own
            last = items[-1] if items and items[-1].get("type") == "text" else None
            text = instruction if last is None else (last.get("text") or "") + "\n" + instruction
            items = [*items[: len(items) - (last is not None)], {**(last or {}), "type": "text", "text": text}]
        content: list[dict] = []
        for item in items:
            if item.get("type") not in ("text", "image"):
                raise ValueError(f"a message content item of type {item.get('type')!r}, not 'text' or 'image'")
            text = (item.get("text") or "") if item["type"] == "text" else "<image>"
            # a text's part from literal_from on (the self-teacher's privileged context) is text, never a marker
            literal = item.get("literal_from", len(text)) if item["type"] == "text" else len(text)
            pieces = text[:literal].split("<image>")
            pieces[-1] += text[literal:]
            markers += len(pieces) - 1  # an image item counts as one marker; text without markers is kept as it is
            for k, piece in enumerate(pieces):
                content += [{"type": "image"}] if k else []
                if piece.strip() or len(pieces) == 1:
                    content.append({"type": "text", "text": piece if len(pieces) == 1 else piece.strip()})
        messages.append({"role": m["role"], "content": content})
    if markers == 0:
        messages[-1]["content"] = [{"type": "image"}] * num_images + messages[-1]["content"]
    elif markers != num_images:
        raise ValueError(f"the prompt has {markers} <image> markers but the row has {num_images} images")
    return messages


def split_files(name: str, split: str, strict: bool = True) -> list[str]:
    """A folder's data files of a split (train.jsonl, data/train-00000-of-00002.parquet), so that `datasets` sees no
    image folder beside them; [] for a folder it reads itself (a saved dataset, a README with configs)."""
    readme = os.path.join(name, "README.md")
    if (
        any(os.path.isfile(os.path.join(name, f)) for f in ("dataset_dict.json", "state.json"))
        or os.path.isfile(readme)
        and "\nconfigs:" in open(readme, encoding="utf-8", errors="replace").read()
    ):
        return []
    by_split: dict[str, list[str]] = {}
    for sub in (name, os.path.join(name, "data")):
        for path in [os.path.join(sub, f) for f in sorted(os.listdir(sub))] if os.path.isdir(sub) else []:
            stem, ext = os.path.splitext(os.path.basename(path))
            if ext in DATA_FILES and stem != "metadata" and os.path.isfile(path):
                by_split.setdefault(stem.split("-")[0], []).append(path)  # train-00000-of-00002
    if strict and by_split and split not in by_split:
        raise ValueError(f"Unknown split {split!r}. Should be one of {list(by_split)}.")
    return by_split.get(split, [])


def relative_path(value) -> bool:
    """Whether an image cell is a relative path (a string, or {'path'} without bytes): one to look up in roots."""
    path = value.get("path") if isinstance(value, dict) and value.get("bytes") is None else value
    return isinstance(path, str) and bool(path) and not os.path.isabs(path) and "://" not in path


def resolve_image(value, roots: list[str]):
    """An image cell whose relative path is made absolute: the first of roots that holds the file (else the first)."""
    if not relative_path(value):
        return value
    path = value["path"] if isinstance(value, dict) else value
    full = next((c for c in (os.path.join(r, path) for r in roots) if os.path.exists(c)), os.path.join(roots[0], path))
    return {"bytes": None, "path": full} if isinstance(value, dict) else full


def images_not_found(cell, roots: list[str], where: str, split: str, flag_prefix: str = "--") -> None:
    """Stops naming row 0's image that is not found (cell: its image column's raw value) and where it was looked
    for: no row having its image file means a wrong folder, not bad rows."""
    paths = [v.get("path") if isinstance(v, dict) else v for v in (cell if isinstance(cell, list) else [cell])]
    path = next(p for p in paths if isinstance(p, str) and not os.path.exists(resolve_image(p, roots)))
    raise ValueError(
        f"the images of the {split!r} split were not found: row 0's image {path!r} was looked for in {where}. "
        f"Pass {flag_prefix}image_root with the folder that the image paths are relative to"
    )


def image_roots(image_root: str | None, name: str, split: str, flag_prefix: str = "--") -> tuple[list[str], str]:
    """(the folders a relative image path is looked up in, in order; where they come from, for messages): image_root,
    else the data file's folder, then the current directory (paths relative to either keep working)."""
    if image_root:
        return [root := os.path.abspath(image_root)], f"{root} ({flag_prefix}image_root)"
    cwd = os.getcwd()
    files = [name] if os.path.isfile(name) else split_files(name, split, strict=False) if os.path.isdir(name) else []
    folder = os.path.dirname(os.path.abspath(files[0])) if files else os.path.isdir(name) and os.path.abspath(name)
    roots = [folder, cwd] if folder and folder != cwd else [cwd]
    where = " and ".join(f"{r} (the {'current directory' if r == cwd else 'data file folder'})" for r in roots)
    return roots, where


def normalize_rows(examples: dict, columns: dict, names: dict, roots: list[str]) -> dict:
    """Raw rows (a dict of columns) under the script's column names (names: {flag: name}): split_chat's prompts,
    image lists with their relative paths resolved, answers as text (from the answer column, else the chat)."""
    prompts = examples[columns["question_column"]]
    answers = examples[columns["answer_column"]] if columns["answer_column"] else [None] * len(prompts)
    out = {names[flag]: [] for flag in ALSO}
    for cell, images, answer in zip(prompts, examples[columns["image_column"]], answers):
        prompt, chat_answer = split_chat(cell)
        images = list(images) if isinstance(images, (list, tuple)) else [images]
        out[names["question_column"]].append(prompt)
        out[names["image_column"]].append([resolve_image(v, roots) for v in images])
        out[names["answer_column"]].append(answer_text(answer) or chat_answer)
    return out


def describe(split: str, columns: dict, chat: bool) -> str:
    """The log line that says where a split's prompts, images and answers come from."""
    answers = (
        f"answers from {columns['answer_column']!r}"
        if columns["answer_column"]
        else "answers from the first assistant turn"
        if chat
        else "no answers"
    )
    prompts = f"prompts from column {columns['question_column']!r} ({'chat messages' if chat else 'text'})"
    return f"{split}: {prompts}, images from {columns['image_column']!r}, {answers}"
