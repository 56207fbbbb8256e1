"""Render benchmark result files (``docs/benchmarks/results/*.json``) as the Markdown tables beside them.

A result file is one dated run on one kind of machine::

    {"date": "YYYY-MM-DD", "machine": "cpu-zen4-2core", "title": str, "host": {...}, "description": str,
     "tables": [{"title": str, "command": str, "columns": [str], "rows": [[str]], "notes": [str]}]}

``python scripts/render_results.py`` writes ``NAME.md`` beside every ``NAME.json`` (``--check`` only reports the
files whose Markdown differs, exit status 1). ``tests/test_docs.py`` runs the check.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "benchmarks" / "results"


def render(result: dict) -> str:
    """The Markdown page of one result file's content (``result``: the JSON above, parsed)."""
    host = [f"- {key.replace('_', ' ')}: {value}" for key, value in result["host"].items() if value is not None]
    lines = [f"# {result['title']}", "", f"Measured {result['date']} on `{result['machine']}`:", "", *host, "",
             result["description"], ""]
    for table in result["tables"]:
        lines += [f"## {table['title']}", "", "```bash", table["command"], "```", ""]
        lines += ["| " + " | ".join(table["columns"]) + " |", "|" + "---|" * len(table["columns"])]
        lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in table["rows"]]
        lines += [""] + [f"- {note}" for note in table.get("notes", [])] + ([""] if table.get("notes") else [])
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a .md is not its rendering")
    args = parser.parse_args(argv)
    stale = []
    for path in sorted(RESULTS.glob("*.json")):
        page, text = path.with_suffix(".md"), render(json.loads(path.read_text()))
        if not page.exists() or page.read_text() != text:
            stale.append(page.name)
            if not args.check:
                page.write_text(text)
    if args.check and stale:
        print("not rendered from their JSON: " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
