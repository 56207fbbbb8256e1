"""JSON schemas that say nothing of undeclared keys are closed before they become grammars (issue 55, item 3).

The class of inputs: any object node with ``properties`` and no ``additionalProperties``, at any depth (inside
``properties``, ``items``, ``anyOf``, ``$defs``). The reported input is instructor's TOOLS-mode schema of a pydantic
model, under which a small model went on writing invented keys until ``max_tokens``.
"""

import copy

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxllm.structured_output import closed_objects, grammar_spec
from scheduler import StructuredOutputsParams

# What instructor sends for `class Weather(BaseModel): city: str` (pydantic's model_json_schema()).
INSTRUCTOR_WEATHER = {"properties": {"city": {"title": "City", "type": "string"}}, "required": ["city"],
                      "title": "Weather", "type": "object"}


@pytest.fixture(scope="module")
def ll_tokenizer(stories_dir):
    import llguidance

    from jaxllm.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(stories_dir)
    return tokenizer, llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=tokenizer.vocab_size,
                                             eos_token=[tokenizer.eos_token_id])


def accepts(ll_tokenizer, params, text) -> bool:
    import llguidance

    _, ll = ll_tokenizer
    matcher = llguidance.LLMatcher(ll, grammar_spec(params)[1], log_level=0)
    # llguidance's own tokenization: the model tokenizer would prefix a word-start space.
    return all(matcher.consume_token(t) for t in ll.tokenize_str(text)) and matcher.is_accepting()


def test_instructor_tools_schema_admits_no_invented_key(ll_tokenizer):
    closed = StructuredOutputsParams(json=INSTRUCTOR_WEATHER)
    assert accepts(ll_tokenizer, closed, '{"city": "Paris"}')
    assert not accepts(ll_tokenizer, closed, '{"city": "Paris", "said": "x"}')
    opened = StructuredOutputsParams(json=INSTRUCTOR_WEATHER, disable_additional_properties=False)
    assert accepts(ll_tokenizer, opened, '{"city": "Paris", "said": "x"}')


def test_nested_objects_close_too_and_free_form_objects_stay_open(ll_tokenizer):
    schema = {"type": "object", "properties": {
        "where": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        "tags": {"type": "object"}}, "required": ["where", "tags"]}
    params = StructuredOutputsParams(json=schema)
    assert accepts(ll_tokenizer, params, '{"where": {"city": "Rome"}, "tags": {"any": 1}}')
    assert not accepts(ll_tokenizer, params, '{"where": {"city": "Rome", "x": 1}, "tags": {}}')
    assert not accepts(ll_tokenizer, params, '{"where": {"city": "Rome"}, "tags": {}, "x": 1}')


def test_what_closing_leaves_alone():
    explicit = {"type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": {"type": "integer"}}
    assert closed_objects(explicit) == explicit
    in_all_of = {"allOf": [{"type": "object", "properties": {"a": {"type": "string"}}},
                           {"type": "object", "properties": {"b": {"type": "string"}}}]}
    assert closed_objects(in_all_of) == in_all_of
    beside_ref = {"$ref": "#/$defs/B", "properties": {"a": {"type": "string"}},
                  "$defs": {"B": {"type": "object", "properties": {"b": {"type": "string"}}}}}
    assert closed_objects(beside_ref)["$defs"]["B"]["additionalProperties"] is False
    assert "additionalProperties" not in closed_objects(beside_ref)
    required_elsewhere = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a", "b"]}
    assert closed_objects(required_elsewhere) == required_elsewhere


# Schemas of nested objects, arrays and scalars, each object with at least one declared property.
_scalars = st.sampled_from([{"type": "string"}, {"type": "integer"}, {"type": "boolean"}])
_names = st.sampled_from(["a", "b", "c", "d"])


def _objects(children):
    return st.dictionaries(_names, children, min_size=1, max_size=3).map(
        lambda props: {"type": "object", "properties": props, "required": sorted(props)})


def _extend(children):
    arrays = children.map(lambda item: {"type": "array", "items": item, "minItems": 1})
    any_of = st.lists(children, min_size=1, max_size=2).map(lambda alts: {"anyOf": alts})
    return st.one_of(_objects(children), arrays, any_of)


# An object at the top, built as one rather than filtered out of all schemas: a filter that drops most draws
# fails hypothesis's filter_too_much health check on unlucky seeds.
schemas = _objects(st.recursive(_scalars, _extend, max_leaves=6))


def _instance(schema):
    """A value valid under ``schema`` (the first alternative of each ``anyOf``)."""
    if "anyOf" in schema:
        return _instance(schema["anyOf"][0])
    kind = schema["type"]
    if kind == "object":
        return {k: _instance(v) for k, v in schema["properties"].items()}
    if kind == "array":
        return [_instance(schema["items"])]
    return {"string": "s", "integer": 1, "boolean": True}[kind]


def _object_paths(value, path=()):
    if isinstance(value, dict):
        yield path
        for k, v in value.items():
            yield from _object_paths(v, path + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _object_paths(v, path + (i,))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schemas)
def test_closing_refuses_an_invented_key_at_every_object_and_nothing_valid(schema):
    original = copy.deepcopy(schema)
    closed = closed_objects(schema)
    assert schema == original
    good = _instance(schema)
    jsonschema.validate(good, closed)
    for path in _object_paths(good):
        bad = copy.deepcopy(good)
        node = bad
        for step in path:
            node = node[step]
        node["invented"] = 1
        jsonschema.validate(bad, schema)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, closed)
