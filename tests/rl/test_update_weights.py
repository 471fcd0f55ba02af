"""engine.update_weights: new weights copied into the live parameters, checked before anything changes."""

from __future__ import annotations

import pytest
import torch
from hf_fixtures import make_hf_model, save_checkpoint

from bi_core import EngineConfig, SamplingParams, build_engine
from bi_core.errors import CheckpointError, RequestError

PROMPTS = [[5, 17, 200, 3, 9], list(range(40, 110)), [7]]


def engine_for(path, dtype="float32"):
    cfg = {"model": {"path": str(path), "dtype": dtype, "device": "cpu"}, "backend": "reference",
           "scheduler": {"max_num_seqs": 8, "max_num_batched_tokens": 256}, "cache": {"block_size": 16, "num_blocks": 64}}
    return build_engine(EngineConfig.from_dict(cfg))


def run(engine):
    out = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, ignore_eos=True, temperature=0.7, seed=3))
    return [(o.token_ids, o.token_logprobs) for o in out]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Two MoE models of the same shape (different seeds): A's checkpoint per expert, B's fused."""
    tmp = tmp_path_factory.mktemp("upd")
    a, b = make_hf_model("moe", seed=0), make_hf_model("moe", seed=1)
    return (a, save_checkpoint(a, tmp / "a"), b, save_checkpoint(b, tmp / "b", experts="fused_transposed"))


def test_state_dict_update_gives_the_other_models_outputs_bitwise(models):
    a, path_a, b, path_b = models
    engine = engine_for(path_a)
    before = run(engine)
    assert engine.update_weights(b.state_dict()) > 0  # transformers' own names and fused expert layout
    after = run(engine)
    assert after != before
    assert after == run(engine_for(path_b))
    assert engine.weight_version == 1
    assert engine.generate([[1, 2]], SamplingParams(max_new_tokens=1))[0].weight_version == 1


def test_checkpoint_path_update_and_back(models):
    a, path_a, b, path_b = models
    engine = engine_for(path_a)
    before = run(engine)
    engine.update_weights(path_b)  # experts stored transposed there: detected as at load
    assert run(engine) == run(engine_for(path_b))
    engine.update_weights(list(a.state_dict().items()))  # (name, tensor) pairs
    assert run(engine) == before


def test_partial_update_touches_only_its_rows(models):
    a, path_a, b, _ = models
    engine = engine_for(path_a)
    qkv = engine.model.layers[1].mixer.qkv_proj.weight
    old = qkv.detach().clone()
    q_new = b.state_dict()["model.layers.1.self_attn.q_proj.weight"]
    assert engine.update_weights({"model.layers.1.self_attn.q_proj.weight": q_new}) == 1
    rows = q_new.shape[0]
    assert torch.equal(qkv[:rows], q_new) and torch.equal(qkv[rows:], old[rows:])
    # one routed expert's up projection, per-expert name: lands at the padded offset of w13
    up = torch.randn(32, 64)
    engine.update_weights({"model.layers.0.mlp.experts.3.up_proj.weight": up})
    w13 = engine.model.layers[0].mlp.w13
    width = w13.shape[1] // 2
    assert torch.equal(w13[3, width:width + 32], up)
    assert torch.all(w13[3, width + 32:] == 0)  # the padding of a narrower expert stays zero


def test_bad_updates_change_nothing(models):
    a, path_a, b, _ = models
    engine = engine_for(path_a)
    snapshot = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    good = b.state_dict()["model.norm.weight"]
    cases = {
        "unknown weight names ['model.layers.0.mlp.nonsense.weight']": {"model.layers.0.mlp.nonsense.weight": good},
        "tensor model.norm.weight: checkpoint shape (65,), model expects (64,)": {"model.norm.weight": torch.ones(65)},
        "dtype torch.int64": {"model.norm.weight": torch.ones(64, dtype=torch.long)},
    }
    for expected, update in cases.items():
        with pytest.raises(CheckpointError) as e:
            engine.update_weights({"model.embed_tokens.weight": b.state_dict()["model.embed_tokens.weight"], **update})
        assert expected in str(e.value) and "nothing was updated" in str(e.value)
    for n, p in engine.model.named_parameters():
        assert torch.equal(p, snapshot[n]), n


def test_unfinished_requests_refuse_or_abort(models):
    a, path_a, b, _ = models
    engine = engine_for(path_a)
    seq = engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=5))
    engine.step()
    with pytest.raises(RequestError, match="1 request\\(s\\) unfinished"):
        engine.update_weights(b.state_dict())
    engine.update_weights(b.state_dict(), abort_unfinished=True)
    assert seq.finish_reason == "abort" and engine.scheduler.num_pages_used == 0


def test_refused_update_aborts_nothing(models):
    """abort_unfinished=True aborts only once the update is known to be valid."""
    a, path_a, b, _ = models
    engine = engine_for(path_a)
    params = SamplingParams(max_new_tokens=5, ignore_eos=True)
    want = engine.generate([[1, 2, 3]], params)[0].token_ids
    seq = engine.add_request([1, 2, 3], params)
    engine.step()
    with pytest.raises(CheckpointError, match="nothing was updated"):
        engine.update_weights({"model.norm.weight": torch.ones(65)}, abort_unfinished=True)
    assert seq.finish_reason is None and seq.request_id in engine.requests
    while engine.scheduler.has_work():
        engine.step()
    assert seq.output_ids == want and engine.weight_version == 0


def test_the_engines_own_names_are_accepted(models):
    """engine.model.state_dict() of one engine updates another: the engine's own parameter names."""
    a, path_a, b, path_b = models
    engine, other = engine_for(path_a), engine_for(path_b)
    assert engine.update_weights(other.model.state_dict()) == len(other.model.state_dict())
    assert run(engine) == run(other)
    w13 = engine.model.layers[0].mlp.w13
    with pytest.raises(CheckpointError, match=r"tensor layers.0.mlp.w13: checkpoint shape \(3, 4\), model expects"):
        engine.update_weights({"layers.0.mlp.w13": torch.ones(3, 4)})
    with pytest.raises(CheckpointError, match="or the engine's own, as in engine.model.state_dict"):
        engine.update_weights({"layers.0.mlp.nonsense": w13})


def test_dtype_rule_engine_dtype_or_float32(models):
    """An in-memory tensor is in the engine's dtype or float32 (rounded as .to() rounds); a
    narrower or other dtype is refused, naming the tensor, its dtype and the engine's."""
    a, path_a, b, _ = models
    name, norm = "model.norm.weight", b.state_dict()["model.norm.weight"]
    engine = engine_for(path_a)  # float32
    for dtype in (torch.bfloat16, torch.float16):
        with pytest.raises(CheckpointError) as e:
            engine.update_weights({name: norm.to(dtype)})
        assert (f"tensor {name}: dtype {dtype}, but the engine runs torch.float32 (model.dtype)" in str(e.value)
                and "nothing was updated" in str(e.value))
    engine = engine_for(path_a, dtype="bfloat16")
    assert engine.update_weights({name: norm}) == 1  # fp32 master weights into a bf16 engine
    assert torch.equal(engine.model.norm.weight, norm.to(torch.bfloat16))
    with pytest.raises(CheckpointError, match=f"tensor {name}: dtype torch.float16, but the engine runs torch.bfloat16"):
        engine.update_weights({name: norm.to(torch.float16)})
    engine.update_weights({name: (norm + 1).to(torch.bfloat16)})
    assert torch.equal(engine.model.norm.weight, (norm + 1).to(torch.bfloat16))
