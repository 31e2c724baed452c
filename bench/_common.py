"""Helpers shared by the benchmark scripts (sizes on the command line, human-readable sizes)."""

from __future__ import annotations

import argparse
import re

MiB = 1 << 20
GiB = 1 << 30


def parse_size(text: str) -> int:
    """``2M``, ``64MiB``, ``1G``, ``512K``; a bare number is MiB."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"bad size {text!r} (use e.g. 2M, 64MiB, 1G; a bare number is MiB)")
    unit = {"": MiB, "k": 1 << 10, "m": MiB, "g": GiB, "t": 1 << 40}[m.group(2).lower()]
    n = int(float(m.group(1)) * unit)
    if n <= 0:
        raise argparse.ArgumentTypeError(f"size {text!r} must be > 0")
    return n


def parse_sizes(text: str) -> list[int]:
    return [parse_size(s) for s in text.split(",") if s.strip()]


def human(n: int) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def emit(header: list[str], body: str, notes: list[str], markdown: bool, out: str | None) -> None:
    """Print the table and its notes; with ``out``, also write header, table and notes to that file."""
    footer = [("- " if markdown else "note: ") + n for n in notes]
    print()
    print(body)
    print()
    print("\n".join(footer))
    if out:
        with open(out, "w", encoding="utf-8") as f:
            f.write("\n".join(("    " + h) if markdown else h for h in header) + "\n\n")
            f.write(body + "\n\n" + "\n".join(footer) + "\n")
        print(f"wrote {out}")


def render(headers, right, rows: list[list[str]], markdown: bool) -> str:
    """A plain-text (aligned, a blank line between groups of the first column) or markdown table."""
    if markdown:
        out = ["| " + " | ".join(headers) + " |",
               "|" + "|".join("---:" if i in right else "---" for i in range(len(headers))) + "|"]
        out += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(out)
    widths = [max(len(headers[i]), *(len(r[i]) for r in rows)) for i in range(len(headers))]

    def line(cells):
        return "  ".join(c.rjust(w) if i in right else c.ljust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    out = [line(headers), line(["-" * w for w in widths])]
    prev = None
    for r in rows:
        if prev is not None and r[0] != prev:
            out.append("")
        prev = r[0]
        out.append(line(r))
    return "\n".join(out)
