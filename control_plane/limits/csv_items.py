"""POST /limits:bulk as CSV (Content-Type: text/csv): one user per line,

    user,tier,output_tokens_per_second,scope,enforcement,ceiling_output_tokens_per_second

read with Python's csv module (quoted fields may hold commas and doubled quotes; spaces
around a field are dropped). A quote left open runs to the end of the body, so that field
is refused, on the line where the quote opened. An empty field, or one left out at the
end of a line, is null: no tier, no override, inherit the scope, enforcement or ceiling
(so lines of the five columns before the ceiling was one still read alike). Blank lines
are skipped. The first non-blank line is a header, and skipped, when it names the
columns in that order (any case; the first two or more of them: one name alone could be
a user called "user"). Line numbers
are the operator's: 1-based, blank and header lines counted, a quoted line break counted
where it is.

Each field is checked by the JSON body's own rules (BulkItem); every bad line is reported,
not only the first (control_plane.errors.InvalidLines)."""

from __future__ import annotations

import csv
import io
import re
from dataclasses import dataclass

from pydantic import ValidationError

from control_plane.errors import LineProblem, rule_words
from control_plane.limits.plans import UserItem
from control_plane.limits.schemas import BulkItem

COLUMNS = (
    "user",
    "tier",
    "output_tokens_per_second",
    "scope",
    "enforcement",
    "ceiling_output_tokens_per_second",
)
# The columns that hold a whole number of tokens/s.
_NUMBERS = {"output_tokens_per_second": "rate", "ceiling_output_tokens_per_second": "ceiling"}
# The console's names of the third and the last column.
_ALIASES = {"override": "output_tokens_per_second", "ceiling": "ceiling_output_tokens_per_second"}
_WHOLE_NUMBER = re.compile(r"[0-9]+")


@dataclass(frozen=True)
class CsvItems:
    items: list[UserItem]
    # The line each item starts on.
    lines: list[int]
    problems: list[LineProblem]


def _is_header(fields: list[str]) -> bool:
    names = [_ALIASES.get(f.lower(), f.lower()) for f in fields]
    return 2 <= len(names) <= len(COLUMNS) and tuple(names) == COLUMNS[: len(names)]


def parse(text: str) -> CsvItems:
    items: list[UserItem] = []
    lines: list[int] = []
    problems: list[LineProblem] = []
    reader = csv.reader(io.StringIO(text, newline=""), skipinitialspace=True)
    seen_data = False
    next_line = 1
    while True:
        line = next_line
        try:
            row = next(reader)
        except StopIteration:
            break
        except csv.Error as e:
            # A field over csv.field_size_limit(): the rest cannot be trusted.
            problems.append(LineProblem(line, "items", f"not valid CSV ({e})"))
            break
        next_line = reader.line_num + 1
        fields = [f.strip() for f in row]
        if not any(fields):
            continue
        if not seen_data:
            seen_data = True
            if _is_header(fields):
                continue
        if len(fields) > len(COLUMNS):
            problems.append(
                LineProblem(
                    line,
                    "items",
                    f"{len(fields)} fields; at most {len(COLUMNS)} ({','.join(COLUMNS)})",
                )
            )
            continue
        item = _item(line, fields, problems)
        if item is not None:
            items.append(item)
            lines.append(line)
    return CsvItems(items, lines, problems)


def _item(line: int, fields: list[str], problems: list[LineProblem]) -> UserItem | None:
    values: dict[str, object] = {
        name: (value or None) for name, value in zip(COLUMNS, fields, strict=False)
    }
    values["user"] = fields[0]
    found: list[LineProblem] = []
    for column, what in _NUMBERS.items():
        given = values.get(column)
        if not isinstance(given, str):
            continue
        if _WHOLE_NUMBER.fullmatch(given):
            values[column] = int(given)
        else:
            found.append(LineProblem(line, column, f"{what} {given!r} is not a whole number"))
            values.pop(column)
    try:
        item = BulkItem.model_validate(values)
    except ValidationError as e:
        for error in e.errors():
            field = str(error["loc"][0]) if error["loc"] else "items"
            found.append(LineProblem(line, field, rule_words(error)))
    if found:
        problems.extend(found)
        return None
    return UserItem(item.user, item.tier, item.policy)
