"""Engine API a server needs (abort, stop strings, streaming text) and what the CLI reports
(explain without the configured GPU, exit codes, preemption counts, a missing MTP config field)."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from helpers import tiny_config

from bi_core import ConfigError, EngineConfig, SamplingParams, build_engine
from bi_core.cli import main
from bi_core.runtime.sequence import Status


def engine(**overrides):
    return build_engine(EngineConfig.from_dict(tiny_config(**overrides)))


def test_abort_frees_pages_and_slot_and_leaves_others_alone():
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    ps = [[1, 2, 3], [4, 5, 6, 7], [8, 9]]
    want = engine().generate(ps, params)
    eng = engine(scheduler={"max_num_seqs": 2})
    seqs = [eng.add_request(p, params) for p in ps]
    eng.step()
    eng.step()
    used, free_slots = eng.scheduler.num_pages_used, len(eng.cache.slots.free)
    assert seqs[1].status is Status.RUNNING and seqs[2].status is Status.WAITING
    assert eng.abort(seqs[1].request_id) and eng.abort(seqs[2].request_id)
    assert not eng.abort(seqs[2].request_id)  # already gone
    assert eng.scheduler.num_pages_used < used and len(eng.cache.slots.free) == free_slots + 1
    assert eng.output_of(seqs[1]).finish_reason == "abort" and seqs[2] not in eng.scheduler.waiting
    while eng.scheduler.has_work():
        eng.step()
    assert seqs[0].output_ids == want[0].token_ids and eng.scheduler.num_pages_used == 0


def test_stop_strings_cut_the_text_and_end_generation():
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    full = engine().generate(["stop test"], params)[0]
    stop = next(full.text[i:i + 2] for i in range(2, len(full.text) - 2) if "\ufffd" not in full.text[i:i + 2])
    out = engine().generate(["stop test"], SamplingParams(max_new_tokens=24, ignore_eos=True, stop=stop))[0]
    assert out.text == full.text[:full.text.index(stop)] and out.finish_reason == "stop" and out.stop_reason == stop
    assert out.token_ids == full.token_ids[:len(out.token_ids)] and len(out.token_ids) < len(full.token_ids)


def test_streaming_text_equals_the_decoded_output():
    eng = engine()
    seq = eng.add_request("héllo wörld", SamplingParams(max_new_tokens=30, ignore_eos=True), text=True)
    seen = []
    while eng.scheduler.has_work():
        eng.step()
        seen.append(seq.text.text)
    assert all(b.startswith(a) for a, b in zip(seen, seen[1:]))  # the text only grows
    assert seq.text.text == eng.tokenizer.decode(seq.output_ids)


def test_preemptions_are_counted_and_reported_once_per_interval(caplog):
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    eng = engine(cache={"num_blocks": 12}, scheduler={"max_num_seqs": 6}, model={"max_model_len": 128})
    with caplog.at_level(logging.WARNING):
        outs = eng.generate([[i] * 30 for i in range(1, 7)], params)
    assert eng.scheduler.num_preemptions > 1 and sum(o.num_preemptions for o in outs) == eng.scheduler.num_preemptions
    assert len([r for r in caplog.records if "preemption" in r.getMessage()]) == 1


def test_explain_without_the_gpu_shows_the_plan(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: explain checks it live")
    assert main(["explain", "--config", "configs/h100_invariant.yaml"]) == 0
    out = capsys.readouterr().out
    assert "is not available on this machine" in out
    assert "linear        -> cuda_hopper_invariant" in out and "attention     -> cuda_hopper_invariant" in out


def test_run_exits_1_when_no_request_could_be_served(capsys):
    assert main(["--config", "configs/cpu_reference.yaml", "--prompt-ids", "999999", "--max-new-tokens", "2"]) == 1
    assert "no request could be served" in capsys.readouterr().err
    assert main(["--config", "configs/cpu_reference.yaml", "--prompt-ids", "999999", "--prompt-ids", "1,2",
                 "--max-new-tokens", "2"]) == 0


def test_mtp_tensors_without_their_config_field_are_named(tmp_path):
    from hf_fixtures import make_hf_model, save_checkpoint

    path = save_checkpoint(make_hf_model("dense"), tmp_path / "ckpt", with_mtp=True)
    cfg = json.loads((path / "config.json").read_text())
    (cfg.get("text_config") or cfg).pop("mtp_num_hidden_layers")
    (path / "config.json").write_text(json.dumps(cfg))
    config = EngineConfig.from_dict(tiny_config(model={"path": str(path), "random": None},
                                                strategy={"name": "mtp", "num_speculative_tokens": 1}))
    with pytest.raises(ConfigError, match="mtp_num_hidden_layers"):
        build_engine(config)


def test_generate_takes_one_prompt_alone_and_numpy_or_torch_ids():
    """A lone str or a flat list of ids is one prompt (a list of one result); numpy and torch
    integers are token ids like Python ints; lists of prompts work as before."""
    import numpy as np

    eng = engine()
    params = SamplingParams(max_new_tokens=3, ignore_eos=True)
    one = eng.generate("Hello", params)
    assert len(one) == 1 and one[0].token_ids == eng.generate(["Hello"], params)[0].token_ids
    want = eng.generate([[1, 2, 3]], params)[0].token_ids
    for prompt in ([1, 2, 3], np.array([1, 2, 3]), torch.tensor([1, 2, 3]), [np.int64(1), torch.tensor(2), 3]):
        out = eng.generate(prompt, params)
        assert len(out) == 1 and out[0].error is None and out[0].token_ids == want, prompt
        assert out[0].prompt_token_ids == [1, 2, 3] and all(type(t) is int for t in out[0].prompt_token_ids)
    assert [o.token_ids for o in eng.generate(np.array([[1, 2, 3], [1, 2, 3]]), params)] == [want, want]
    assert len(eng.generate(["a", "b"], params)) == 2 and len(eng.generate([[1, 2], [3]], params)) == 2
    bad = eng.generate([[1.0, 2], [True], None], params)
    assert [o.error for o in bad] == ["prompt has token ids that are not integers: [1.0]",
                                      "prompt has token ids that are not integers: [True]",
                                      "prompt must be a str or a sequence of token ids, got NoneType"]


def test_data_parallel_size_is_refused_outside_serve():
    """Replicas are processes of their own (bi-engine serve with Ray): an engine built here with
    parallel.data_parallel_size > 1 would serve one replica while the config says N, so it is
    refused, naming the key; 1 builds."""
    with pytest.raises(ConfigError, match=r"parallel.data_parallel_size: 2: replicas are processes"):
        build_engine(EngineConfig.from_dict(tiny_config(parallel={"data_parallel_size": 2})))
    assert build_engine(EngineConfig.from_dict(tiny_config(parallel={"data_parallel_size": 1}))) is not None
