"""MkDocs hook: the configuration reference (``docs/reference/configuration.md``) generated from the code.

The page holds a title, an introduction and the marker :data:`MARKER`; :func:`on_page_markdown` replaces the
marker with :func:`render_reference`: a section per ``EngineConfig`` field (its flag, type, default and
description, from ``jaxllm.config.field_docs``, the text ``--help`` prints), grouped as the typed sub-configs group
them, then the keys of the ``speculative_config`` and ``kv_events_config`` dicts.
"""

from __future__ import annotations

import dataclasses
import html
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # the checkout being built is documented, not another install of jaxllm
    sys.path.insert(0, str(ROOT))

from jaxllm.config import SUB_CONFIGS, EngineConfig, FieldDoc, KVEventsConfig, SpeculativeConfig, field_docs  # noqa: E402
from scheduler.config import SchedulerConfig  # noqa: E402

PAGE = "reference/configuration.md"
MARKER = "<!-- config-reference -->"
# Section titles, in page order: the sub-configs, the scheduler's knobs, speculative decoding, the rest.
GROUP_TITLES = {"engine": "Model and engine", "cache": "KV cache (`config.cache`)",
                "scheduler": "Scheduler (`config.scheduler_config(...)`)",
                "compilation": "Compilation (`config.compilation`)", "parallel": "Parallelism (`config.parallel`)",
                "speculative": "Speculative decoding (`config.speculative_config`)",
                "lora": "LoRA adapters (`config.lora`)",
                "observability": "Observability (`config.observability`)"}


def group_of(name: str) -> str:
    """The key of :data:`GROUP_TITLES` under which the ``EngineConfig`` field ``name`` is listed."""
    for group, cls in SUB_CONFIGS.items():
        if name in {f.name for f in dataclasses.fields(cls)}:
            return group
    if name in {f.name for f in dataclasses.fields(SchedulerConfig)} or name in ("batching", "max_waiting_requests"):
        return "scheduler"
    return "speculative" if name == "speculative_config" else "engine"


def _text(description: str) -> str:
    """``description`` as Markdown text: HTML and Markdown's emphasis and link characters escaped."""
    return re.sub(r"([\\`*_\[\]])", r"\\\1", html.escape(description, quote=False))


def _value(value: Any) -> str:
    return "required" if value is dataclasses.MISSING else f"`{value!r}`"


def flag(doc: FieldDoc) -> str:
    """The command-line flag of an ``EngineConfig`` field (both forms for a bool)."""
    name = f"--{doc.name.replace('_', '-')}"
    return f"`{name}` / `--no-{name[2:]}`" if doc.type in ("bool", "Optional[bool]") else f"`{name}`"


def _field_section(doc: FieldDoc) -> str:
    return (f"### {doc.name}\n\n| flag | type | default |\n|---|---|---|\n"
            f"| {flag(doc)} | `{doc.type}` | {_value(doc.default)} |\n\n{_text(doc.description)}\n")


def _keys_table(title: str, cls: type) -> str:
    rows = [f"| `{d.name}` | `{d.type}` | {_value(d.default)} | {_text(d.description).replace('|', '&#124;')} |"
            for d in field_docs(cls)]
    return "\n".join([f"## {title}", "", "| key | type | default | description |", "|---|---|---|---|", *rows, ""])


def render_reference() -> str:
    """The reference's Markdown: a ``##`` section per group of fields, a ``###`` section per field, then a table
    of the keys of each dict-valued field."""
    docs = field_docs(EngineConfig)
    parts = []
    for group, title in GROUP_TITLES.items():
        fields = [_field_section(d) for d in docs if group_of(d.name) == group]
        parts.append(f"## {title}\n\n" + "\n".join(fields))
    parts.append(_keys_table("speculative_config keys (`SpeculativeConfig`)", SpeculativeConfig))
    parts.append(_keys_table("kv_events_config keys (`KVEventsConfig`)", KVEventsConfig))
    return "\n".join(parts)


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    """MkDocs' page hook: the configuration page with its marker replaced by :func:`render_reference`; any other
    page unchanged.

    Raises:
      ValueError: the configuration page lacks :data:`MARKER`.
    """
    if page.file.src_uri != PAGE:
        return markdown
    if MARKER not in markdown:
        raise ValueError(f"docs/{PAGE} lacks the marker {MARKER} that the generated reference replaces")
    return markdown.replace(MARKER, render_reference())
