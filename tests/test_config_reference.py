"""The configuration reference page (docs/hooks/config_reference.py) is generated from EngineConfig's fields: every
field with its flag, type, default and the description --help prints; no MkDocs needed to check it."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest

from jaxllm.config import EngineConfig, KVEventsConfig, SpeculativeConfig, field_docs
from tests.conftest import ROOT


def _hook():
    spec = importlib.util.spec_from_file_location("config_reference", ROOT / "docs/hooks/config_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _page(uri: str) -> SimpleNamespace:
    return SimpleNamespace(file=SimpleNamespace(src_uri=uri))


def test_the_reference_has_a_section_per_field_with_its_flag_type_default_and_description():
    hook = _hook()
    text = hook.render_reference()
    for doc in field_docs(EngineConfig):
        section = text.split(f"\n### {doc.name}\n", 1)[1].split("\n### ", 1)[0].split("\n## ", 1)[0]
        assert f"`--{doc.name.replace('_', '-')}`" in section, doc.name
        assert f"`{doc.type}`" in section and f"`{doc.default!r}`" in section, doc.name
        assert hook._text(doc.description) in section, doc.name
    block = text.split("\n### block_size\n", 1)[1].split("\n### ", 1)[0]
    assert "| `--block-size` | `int` | `16` |" in block and "Tokens per KV block, a power of two." in block
    assert text.count("\n### ") == len(field_docs(EngineConfig))
    assert "`--enable-prefix-caching` / `--no-enable-prefix-caching`" in text


def test_the_reference_lists_the_keys_of_the_dict_valued_fields():
    text = _hook().render_reference()
    for cls in (SpeculativeConfig, KVEventsConfig):
        for doc in field_docs(cls):
            assert f"| `{doc.name}` | `{doc.type}` |" in text, doc.name
    assert "| `num_speculative_tokens` | `int` | required |" in text


def test_the_description_is_escaped_for_markdown():
    hook = _hook()
    assert hook._text('<jaxllm cache>/xla, "tcp://*:5557" and max_model_len') == (
        '&lt;jaxllm cache&gt;/xla, "tcp://\\*:5557" and max\\_model\\_len')


def test_the_hook_fills_the_marker_of_the_configuration_page_only():
    hook = _hook()
    page = (ROOT / "docs/reference/configuration.md").read_text()
    assert page.startswith("# Configuration\n") and page.count(hook.MARKER) == 1
    filled = hook.on_page_markdown(page, page=_page("reference/configuration.md"), config=None, files=None)
    assert hook.MARKER not in filled and hook.render_reference() in filled
    assert hook.on_page_markdown(page, page=_page("index.md"), config=None, files=None) == page
    with pytest.raises(ValueError, match="lacks the marker"):
        hook.on_page_markdown("# Configuration\n", page=_page("reference/configuration.md"))
