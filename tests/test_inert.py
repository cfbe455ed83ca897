"""What readers render from a run folder's records, whoever wrote them: report.md shows their text as written, a
report.csv cell starts no spreadsheet formula, and a terminal line holds no control character. Over any text
(Hypothesis); a crafted sweep folder end to end: tests/test_report.py."""

import html
import io
import re
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

from hydra.core.utils import JobReturn, JobStatus
from hypothesis import given
from hypothesis import strategies as st

from src.launch import progress
from src.launch.console import print_error
from src.launch.optuna_sweeper import PRUNED_AFTER, best, trials_table
from src.records import shown
from src.report import csv_cell, markdown_cell

MARKDOWN = "\\`*[]|#~"  # what starts a span, a link, a table cell or a heading in Markdown
# Any text, and text made of what Markdown, HTML, spreadsheets and terminals read.
TEXT = st.text() | st.text("<>&|`*_[]#~\\\n\r\t\x1b\x07=+-@ a1.")


def bare(cell: str) -> str:
    """A cell without its backslash escapes (each a character Markdown shows as itself), read left to right."""
    return re.sub(r"\\.", " ", cell)


def unescaped(cell: str) -> str:
    """What Markdown shows of a cell: its backslash escapes, then its entities, read."""
    return html.unescape(re.sub(r"\\(.)", r"\1", cell))


@given(TEXT)
def test_a_markdown_cell_is_one_line_that_shows_the_text_as_written(text):
    cell = markdown_cell(text)
    assert "<" not in cell and ">" not in cell and "\n" not in cell
    assert all(char.isprintable() for char in cell)
    rest = bare(cell)
    assert not set(rest) & set(MARKDOWN), cell
    # An underscore inside a word emphasises nothing; anywhere else it is escaped.
    assert all(rest[i - 1:i].isalnum() and rest[i + 1:i + 2].isalnum() for i, char in enumerate(rest) if char == "_")
    assert unescaped(cell) == shown(text)


@given(TEXT | st.tuples(st.sampled_from("=+-@\t\r"), TEXT).map("".join))
def test_a_csv_cell_starts_no_formula_unless_it_is_a_number(text):
    cell = csv_cell(text)
    assert cell in (text, "'" + text)
    if cell.startswith(("=", "+", "-", "@", "\t", "\r")):
        float(cell)


@given(st.one_of(st.integers().map(str), st.floats(allow_nan=False, allow_infinity=False).map(repr)))
def test_a_number_stays_a_number_in_a_csv_cell(number):
    assert csv_cell(number) == number and csv_cell(float(number)) == float(number)


def crafted_study(text: str) -> SimpleNamespace:
    """An Optuna study whose file says `text` wherever a trial's attributes and settings hold text."""
    trial = SimpleNamespace(number=0, value=0.5, values=[0.5], params={text: text},
                            state=SimpleNamespace(name="PRUNED"),
                            user_attrs={"folder": text, "val/acc_best": 0.5, PRUNED_AFTER: text})
    return SimpleNamespace(best_trials=[trial], trials=[trial], direction=SimpleNamespace(name="MAXIMIZE"),
                           directions=[SimpleNamespace(name="MAXIMIZE")], user_attrs={},
                           get_trials=lambda deepcopy=True, states=None: [trial])


@given(TEXT)
def test_a_terminal_line_holds_no_control_character(text):
    progress.tally = None  # each example its own sweep
    said: list[str] = []
    lines = progress.Progress(2, say=said.append)
    lines.started(0, text)
    lines.ended(0, text, JobReturn(status=JobStatus.COMPLETED, _return_value=SimpleNamespace(line=text)))
    lines.ended(1, text, JobReturn(status=JobStatus.FAILED, _return_value=ValueError(text)))
    lines.stopped(1, text, text)
    said.append(best(crafted_study(text), Path("sweep") / text))
    assert all(char.isprintable() for line in said for char in line), said


@given(TEXT)
def test_an_error_line_is_one_line_of_printable_characters_whatever_it_quotes(text):
    """Every `error:` line passes `print_error`: a refusal that quotes a record's value (a resume's, say, of
    `optim.schedule` holding \x1e, which Python and terminals take for a line's end) prints it escaped."""
    stream = io.StringIO()
    with mock.patch("sys.stderr", stream):
        print_error(f"optim.schedule={text} is not allowed")
    [line] = stream.getvalue().splitlines()
    assert line.startswith("error: optim.schedule=") and line.isprintable(), line


@given(TEXT)
def test_a_trial_row_keeps_its_cells_whatever_the_study_says(text):
    table = trials_table(crafted_study(text), Path("sweep"))
    [row] = [line for line in table.splitlines() if line.startswith("| 1 |")]
    assert "<" not in table and bare(row).count("|") == 7
