"""The fields vllm-router adds to forwarded requests are dropped only at the router's defaults; GET /tokenizer_info is
served only with its flag."""

import json

from jaxllm.entrypoints.openai.router_compat import ROUTER_DEFAULTS, strip_router_defaults

CHAT = ROUTER_DEFAULTS["/v1/chat/completions"]


def test_the_routers_defaults_are_dropped_and_the_clients_fields_kept():
    forwarded = {"model": "m", "messages": [], "max_tokens": 3, "logprobs": False, "no_stop_trim": False,
                 "ignore_eos": False, "separate_reasoning": True, "stream_reasoning": True,
                 "return_hidden_states": False, "include_reasoning": True}
    # include_reasoning is a field the server declares (the reasoning parsers'): it reaches it as sent.
    assert json.loads(strip_router_defaults(json.dumps(forwarded).encode(), CHAT)) == {
        "model": "m", "messages": [], "max_tokens": 3, "logprobs": False, "ignore_eos": False,
        "include_reasoning": True}


def test_any_other_value_of_those_fields_is_left_for_validation_to_refuse():
    body = json.dumps({"model": "m", "no_stop_trim": True, "return_hidden_states": 0}).encode()
    assert strip_router_defaults(body, ROUTER_DEFAULTS["/v1/completions"]) == body


def test_the_render_routes_drop_the_defaults_of_their_generation_routes():
    # kv_aware forwards a request's body to the render route before the request itself.
    assert ROUTER_DEFAULTS["/v1/chat/completions/render"] == CHAT
    assert ROUTER_DEFAULTS["/v1/completions/render"] == ROUTER_DEFAULTS["/v1/completions"] == {
        "no_stop_trim": False, "return_hidden_states": False}


def test_a_body_that_is_not_a_json_object_is_untouched():
    for body in (b"{not json", b"[1, 2]"):
        assert strip_router_defaults(body, CHAT) == body


def _app(tokenizer, enable_tokenizer_info):
    from types import SimpleNamespace

    from jaxllm.entrypoints.openai.api_server import build_app

    serving = SimpleNamespace(engine=SimpleNamespace(dead=None), tokenizer=tokenizer, model_name="m")
    return build_app(serving, enable_tokenizer_info=enable_tokenizer_info)


def test_tokenizer_info_is_served_only_with_its_flag(stories_dir):
    from fastapi.testclient import TestClient

    from jaxllm.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(stories_dir)
    assert TestClient(_app(tokenizer, True)).get("/tokenizer_info").json() == tokenizer.info()
    assert TestClient(_app(tokenizer, False)).get("/tokenizer_info").status_code == 404
    refused = TestClient(_app(None, True)).get("/tokenizer_info")
    assert refused.status_code == 400 and "has no tokenizer" in refused.json()["error"]["message"]
