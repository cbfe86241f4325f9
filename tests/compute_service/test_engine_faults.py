"""A fault in an engine step fails the requests of that step, not the engine.

The fault is real code raising inside a real step: the engine's model runner is replaced by one
that raises on its first call and runs the model after that.
"""

from __future__ import annotations

import asyncio

import pytest

from kvfleet.compute_service.engine.async_engine import AsyncEngine
from kvfleet.compute_service.engine.llm_engine import EngineConfig, LLMEngine
from kvfleet.core.sampling import SamplingParams
from tests.compute_service.conftest import random_prompt

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


class FailsOnce:
    """A model runner whose first ``execute`` raises (a CUDA error, a bad kernel launch)."""

    def __init__(self, runner):
        self.runner = runner
        self.failed = False

    def execute(self, batch):
        if not self.failed:
            self.failed = True
            raise RuntimeError("injected fault in the forward pass")
        return self.runner.execute(batch)


@pytest.fixture
def engine(llama_dir):
    return LLMEngine(llama_dir, EngineConfig(dtype="float32", block_size=16, kv_cache_memory=16 << 20, max_model_len=256))


async def _outputs(aengine, request_id, prompt):
    got = []
    async for out in aengine.generate(request_id, prompt, GREEDY):
        got.append(out)
    return got


def test_a_failed_step_fails_its_requests_and_the_engine_serves_on(engine, caplog):
    a, b = random_prompt(20, seed=1), random_prompt(33, seed=2)
    expected = [o.new_token_ids for o in engine.generate([a, b], GREEDY)]
    engine.runner = FailsOnce(engine.runner)

    async def main(aengine):
        failed = await asyncio.gather(_outputs(aengine, "a", a), _outputs(aengine, "b", b))
        again = await asyncio.gather(_outputs(aengine, "a2", a), _outputs(aengine, "b2", b))
        return failed, again

    aengine = AsyncEngine(engine)
    try:
        failed, again = asyncio.run(asyncio.wait_for(main(aengine), 120))
        assert aengine.is_alive()
    finally:
        aengine.shutdown()
    for outs in failed:  # one output each: finished with reason "error" and the exception's one-line summary
        assert len(outs) == 1 and outs[0].finished and not outs[0].new_token_ids and outs[0].finish_reason == "error"
        assert outs[0].failure == "engine step failed on node local: RuntimeError: injected fault in the forward pass"
        assert outs[0].error == outs[0].failure
    assert [[t for o in outs for t in o.new_token_ids] for outs in again] == expected
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and errors[0].exc_info is not None and "ending its 2 requests" in errors[0].getMessage()
    assert not engine.has_unfinished_requests()
    stats = engine.stats()
    assert stats.blocks.num_used == 0  # the failed requests' blocks went back
    assert stats.num_step_failures == 1
