"""A registered architecture under tensor parallelism (tests/custom_model_gptj.py): its declared leaves split as
``Family.param_axes`` says, the undeclared ones are replicated, and TP 2 gives the TP 1 greedy tokens."""

from __future__ import annotations

import pytest

from jaxllm import LLM
from jaxllm.models import register_model
from tests import custom_model_gptj as gptj
from tests.conftest import STORIES
from tests.multidevice.conftest import ENGINE, GREEDY, prompts


@pytest.fixture(scope="module")
def gptj_dir(tmp_path_factory):
    register_model(gptj.MODEL_TYPE, gptj.IMPORT_STRING, hf_architectures=[gptj.ARCHITECTURE])
    return gptj.write_checkpoint(tmp_path_factory.mktemp("gptj") / "tiny_gptj", STORIES)


def test_registered_family_splits_its_declared_leaves_and_gives_tp_1_tokens(gptj_dir):
    llm = LLM(model=gptj_dir, tensor_parallel_size=2, **ENGINE)
    layers = llm.engine.runner.weights.params["layers"]
    assert {s.data.shape for s in layers["w_fc"].addressable_shards} == {(3, 64, 80)}  # [L, E, F / 2]
    assert {s.data.shape for s in layers["ln_bias"].addressable_shards} == {(3, 64)}  # replicated
    one = LLM(model=gptj_dir, tensor_parallel_size=1, **ENGINE)
    assert ([o.outputs[0].token_ids for o in llm.generate(prompts(4), GREEDY)]
            == [o.outputs[0].token_ids for o in one.generate(prompts(4), GREEDY)])
