"""Prometheus' text exposition format, read into samples (layer L4, standard library only).

``asyncrpc.top`` runs where the group's metrics are read, often a laptop without
``prometheus-client``; the format's text subset that a worker serves (``name{labels}
value``, ``#`` comments) is small enough to read here rather than to need that package.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ExpositionError", "Sample", "parse"]


class ExpositionError(ValueError):
    """A line that is not in the text exposition format."""


@dataclass(frozen=True, slots=True)
class Sample:
    """One line of a scrape: ``name{labels} value``."""

    name: str
    labels: dict[str, str]
    value: float


_ESCAPES = {"\\": "\\", '"': '"', "n": "\n"}


def _labels(text: str, start: int) -> tuple[dict[str, str], int]:
    """The labels from ``text[start]`` (just past ``{``) and the index past ``}``."""
    labels: dict[str, str] = {}
    i = start
    while True:
        while i < len(text) and text[i] in " ,":
            i += 1
        if i < len(text) and text[i] == "}":
            return labels, i + 1
        eq = text.find("=", i)
        if eq < 0 or eq + 1 >= len(text) or text[eq + 1] != '"':
            raise ExpositionError(f"a label without a quoted value: {text!r}")
        key, i, value = text[i:eq].strip(), eq + 2, []
        # A value ends at the first quote that is not escaped.
        while i < len(text) and text[i] != '"':
            if text[i] == "\\" and i + 1 < len(text):
                value.append(_ESCAPES.get(text[i + 1], "\\" + text[i + 1]))
                i += 2
            else:
                value.append(text[i])
                i += 1
        if i >= len(text):
            raise ExpositionError(f"an unterminated label value: {text!r}")
        labels[key] = "".join(value)
        i += 1


def _line(line: str) -> Sample:
    brace = line.find("{")
    space = line.find(" ")
    if brace >= 0 and (space < 0 or brace < space):
        name = line[:brace]
        labels, end = _labels(line, brace + 1)
        rest = line[end:]
    else:
        name, _, rest = line.partition(" ")
        labels = {}
    fields = rest.split()
    if not name or not fields:
        raise ExpositionError(f"a sample without a value: {line!r}")
    try:
        value = float(fields[0])  # float() reads "+Inf", "-Inf" and "NaN" too
    except ValueError:
        raise ExpositionError(f"a value that is not a number: {line!r}") from None
    return Sample(name, labels, value)  # a timestamp (fields[1]) is not needed here


def parse(text: str) -> list[Sample]:
    """The samples of one scrape, in order; comments and blank lines are skipped.

    Args:
        text: the body of a ``/metrics`` reply.

    Returns:
        Every sample of the scrape.

    Raises:
        ExpositionError: a line is not in the format.
    """
    return [_line(line) for raw in text.splitlines() if (line := raw.strip()) and line[0] != "#"]
