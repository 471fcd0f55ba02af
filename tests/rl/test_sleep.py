"""Sleep / wake (RL with a colocated trainer): the runner releases the cache tensors, the graphs
and the weights (level 1: to host memory; level 2: dropped, refilled by a weight update) and
allocates them again; outputs after a wake are bitwise the ones before."""

from __future__ import annotations

import attrs
import pytest
import torch
from helpers import tiny_config

from bi_core import EngineConfig, SamplingParams, build_engine

PARAMS = SamplingParams(max_new_tokens=8, temperature=0.7, seed=3, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4], list(range(5, 40))]


def config(**over) -> EngineConfig:
    return EngineConfig.from_dict(tiny_config(model={"random": {"preset": "tiny-moe", "seed": 1}}, **over))


def storage_bytes(tensors) -> int:
    return sum(t.untyped_storage().nbytes() for t in tensors)


def test_level_1_releases_everything_and_wakes_to_the_same_outputs():
    eng = build_engine(config())
    before = eng.generate(PROMPTS, PARAMS)
    runner = eng.runner
    held = storage_bytes(runner._weights()) + storage_bytes(eng.cache.tensors())
    runner.sleep(1)
    assert runner.sleeping == {"weights", "kv_cache"} and eng.cache.released
    assert storage_bytes(runner._weights()) + storage_bytes(eng.cache.tensors()) == 0 < held
    runner.wake_up(["weights"])  # in two steps, as a trainer that updates weights first would
    assert runner.sleeping == {"kv_cache"}
    runner.wake_up(["kv_cache"])
    assert not runner.sleeping
    after = eng.generate(PROMPTS, PARAMS)
    assert [o.token_ids for o in after] == [o.token_ids for o in before]
    assert [o.token_logprobs for o in after] == [o.token_logprobs for o in before]


def test_level_2_drops_the_weights_until_an_update_refills_them():
    cfg = config()
    eng = build_engine(cfg)
    before = eng.generate(PROMPTS, PARAMS)
    eng.runner.sleep(1)
    eng.runner.wake_up()
    assert eng.runner._host is not None  # level 1's host buffer is kept between sleeps...
    eng.runner.sleep(2)
    assert eng.runner._host is None  # ...and level 2 gives it back
    eng.runner.wake_up(["weights"])
    eng.model.embed_tokens.data.fill_(0.0)  # stand-in for whatever the fresh allocation holds
    eng.update_weights(build_engine(cfg).model.state_dict())
    eng.runner.wake_up(["kv_cache"])
    after = eng.generate(PROMPTS, PARAMS)
    assert [o.token_ids for o in after] == [o.token_ids for o in before]


def test_after_level_2_nothing_is_served_until_every_weight_has_landed_again():
    """A level-2 sleep then a wake without a weight sync left the weights' memory as it was
    (garbage: token 0, NaN logprobs): every request is refused with one clear error until updates
    have written every weight again (here in two halves), then the outputs are the old ones."""
    from bi_core.rl.coverage import WeightsMissing

    cfg = config()
    eng = build_engine(cfg)
    before = eng.generate(PROMPTS, PARAMS)
    eng.sleep(2)
    eng.wake_up()
    for call in (lambda: eng.generate(PROMPTS, PARAMS), lambda: eng.score([[1, 2]], [[3]]),
                 lambda: eng.add_request([1, 2], PARAMS)):
        with pytest.raises(WeightsMissing, match="weights are missing: they were released by sleep level 2 and no "
                                                 "weight update has filled them since; sync weights first"):
            call()
    state = list(build_engine(cfg).model.state_dict().items())
    eng.update_weights(state[::2])
    with pytest.raises(WeightsMissing, match=rf"fills the {len(state) // 2} parameter\(s\) left"):
        eng.generate(PROMPTS, PARAMS)
    eng.update_weights(state[1::2])
    after = eng.generate(PROMPTS, PARAMS)
    assert [(o.token_ids, o.token_logprobs) for o in after] == [(o.token_ids, o.token_logprobs) for o in before]
    eng.sleep(1)  # level 1 keeps the weights: served at once after the wake
    eng.wake_up()
    assert [o.token_ids for o in eng.generate(PROMPTS, PARAMS)] == [o.token_ids for o in before]


def test_level_1_host_buffer_is_pinned_once_and_reused():
    """The host copy lives in one buffer kept from the first level-1 sleep on (pinning is the slow
    part): a second sleep reuses it, and saves the weights of that moment (an update in between
    must come back after the second wake, not the first sleep's values)."""
    cfg = config()
    eng = build_engine(cfg)
    eng.sleep(1)
    host = eng.runner._host
    assert host.nbytes >= storage_bytes([t for t in eng.model.parameters()]) and host.buf.numel() == host.nbytes
    assert all((v.data_ptr() - host.buf.data_ptr()) % 256 == 0 for v in host.views)
    eng.wake_up()
    other = build_engine(attrs.evolve(cfg, model=attrs.evolve(cfg.model, random=attrs.evolve(cfg.model.random,
                                                                                             seed=9))))
    want = other.generate(PROMPTS, PARAMS)
    eng.update_weights(other.model.state_dict())
    eng.sleep(1)
    assert eng.runner._host is host  # the same buffer, not pinned again
    eng.wake_up()
    got = eng.generate(PROMPTS, PARAMS)
    assert [o.token_logprobs for o in got] == [o.token_logprobs for o in want]


def test_sleep_forgets_captured_graphs_and_captures_again():
    """A captured graph replays the addresses of the weights and caches it was captured with, and
    sleep moves both: the graph runner must forget its graphs (not be "rebuilt": the op factory
    memoises impls, so that returned the same runner, and its old graphs replayed freed memory,
    an illegal address on the GPU). The CUDA graph runner in its rerun mode stands in on the CPU."""
    from bi_core.runtime.graphs import CudaGraphRunner

    eng = build_engine(config())
    runner = eng.runner
    graphs = runner.main_graphs = CudaGraphRunner(attrs.evolve(runner.spec, use_graphs=True, capture=False))
    before = eng.generate(PROMPTS, PARAMS)
    assert graphs.graphs and graphs.num_replays[1] > 0
    runner.sleep(1)
    assert runner.main_graphs is graphs and not graphs.graphs and not graphs.statics
    eng.wake_up()
    replays = graphs.num_replays[1]
    after = eng.generate(PROMPTS, PARAMS)
    assert graphs.graphs and graphs.num_replays[1] > replays  # captured again, then replayed
    assert [o.token_logprobs for o in after] == [o.token_logprobs for o in before]


def test_bad_calls():
    eng = build_engine(config())
    with pytest.raises(ValueError, match="sleep level"):
        eng.runner.sleep(3)
    eng.runner.sleep(1)
    with pytest.raises(RuntimeError, match="already asleep"):
        eng.runner.sleep(1)
    with pytest.raises(ValueError, match="wake_up tags"):
        eng.runner.wake_up(["kv"])
    eng.runner.wake_up()
    torch.testing.assert_close(eng.model.embed_tokens.abs().sum() > 0, torch.tensor(True))
