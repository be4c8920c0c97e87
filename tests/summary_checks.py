"""What a run's evaluation figures must satisfy whatever its models learned: each is a count of the rows evaluated."""

import pytest

EVAL_KEYS = (
    "teacher_accuracy",
    "teacher_format_rate",
    "student_accuracy_before",
    "student_format_rate_before",
    "student_accuracy_after",
    "student_format_rate_after",
)


def assert_eval_counts(summary: dict, rows: int, require_think: bool = False) -> None:
    """The run evaluated `rows` rows, and each accuracy and format rate of its summary is a whole number of those
    rows divided by `rows` (a row counted twice, a padding row counted, or another divisor shows). A right answer
    is a boxed answer, so no accuracy exceeds the format rate of the same evaluation; with require_think a
    well-formed answer needs a <think> block too, which a right answer may lack, so the comparison is left out."""
    assert summary["eval_rows"] == rows
    for key in EVAL_KEYS:
        count = summary[key] * rows
        assert count == pytest.approx(round(count), abs=1e-9) and 0 <= round(count) <= rows, (key, summary[key])
    if not require_think:
        for key in EVAL_KEYS[::2]:
            assert summary[key] <= summary[key.replace("accuracy", "format_rate")], (key, summary)
