"""The audit behind ``bi-engine verify`` can see batch dependence: on the reference backend (no
invariance promise) it must report mismatches; alone-vs-alone it must report none."""

from __future__ import annotations

import pytest
from helpers import tiny_config

from bi_core import EngineConfig, build_engine
from bi_core.errors import BiEngineError
from bi_core.tools.verify import Case, audit, check_drafts, count


def test_audit_sees_mismatches_without_invariance():
    engine = build_engine(EngineConfig.from_dict(tiny_config(scheduler={"max_num_seqs": 16})))
    cases = audit(engine, num_prompts=4, batch_sizes=(1, 8, 16), max_new_tokens=6, log=lambda *_: None)
    assert {c.batch_size for c in cases} == {1, 8, 16}
    assert count([c for c in cases if c.batch_size == 1]) == 0  # alone vs alone: same bits
    assert count(cases) > 0
    # what ran together is reported (fillers may finish before the last arrivals)
    assert [c.peak_in_flight for c in cases if c.batch_size == 1] == [1, 1]
    assert all(1 < c.peak_in_flight <= c.batch_size for c in cases if c.batch_size > 1)


def test_audit_reports_fewer_in_flight_when_the_cache_is_small():
    """A KV cache too small for the batch runs fewer sequences at once; the audit says how many
    (the same audit, same prompts: 14 of 16 at once with room, 7 in 24 pages)."""
    def peak(num_blocks: int) -> int:
        engine = build_engine(EngineConfig.from_dict(tiny_config(
            scheduler={"max_num_seqs": 16}, model={"max_model_len": 128}, cache={"num_blocks": num_blocks})))
        cases = audit(engine, num_prompts=4, batch_sizes=(16,), max_new_tokens=6, modes=("greedy",),
                      log=lambda *_: None)
        return cases[0].peak_in_flight

    roomy, small = peak(256), peak(24)
    assert small < roomy <= 16 and roomy > 8


def test_audit_checks_mtp_against_ar():
    """With an MTP engine the audit compares speculative runs with AR runs alone; on the
    reference backend greedy tokens agree (logprobs differ in the last bits, so mismatches are
    reported as logprob-only)."""
    cfg = EngineConfig.from_dict(tiny_config(scheduler={"max_num_seqs": 8}))
    engine = build_engine(cfg)
    mtp = build_engine(cfg.replace(strategy={"name": "mtp", "num_speculative_tokens": 2}))
    cases = audit(engine, num_prompts=3, batch_sizes=(1, 4), max_new_tokens=6, modes=("greedy",),
                  log=lambda *_: None, mtp_engine=mtp)
    labels = {c.mode for c in cases}
    assert labels == {"greedy", "greedy+mtp"}
    for c in cases:
        assert all("token" not in what for _, _, what in c.mismatches)
    # not vacuous: every speculative run verified drafts, and accepted some, which were compared
    speculative = [c for c in cases if c.mode == "greedy+mtp"]
    assert len(speculative) == 2 and all(c.num_draft_tokens > 0 for c in speculative)
    assert sum(c.num_accepted_draft_tokens for c in speculative) > 0
    check_drafts(cases)
    with pytest.raises(BiEngineError, match="the MTP runs accepted none of their 6 draft tokens"):
        check_drafts([Case(1, "greedy", 1, ()), Case(1, "greedy+mtp", 1, (), num_draft_tokens=6)])


def test_audit_refuses_what_it_cannot_run():
    """A batch size above scheduler.max_num_seqs, an unknown mode or no prompts: an error, not a
    skipped case (an audit that ran less than asked must not pass)."""
    engine = build_engine(EngineConfig.from_dict(tiny_config(scheduler={"max_num_seqs": 4})))
    quiet = {"max_new_tokens": 2, "log": lambda *_: None}
    with pytest.raises(BiEngineError, match=r"batch_sizes: the audit cannot run batch sizes above "
                                            r"scheduler.max_num_seqs=4 \(got 8\)"):
        audit(engine, num_prompts=2, batch_sizes=(1, 8), **quiet)
    with pytest.raises(BiEngineError, match="modes: expected greedy and/or sampled, got 'gredy'"):
        audit(engine, num_prompts=2, batch_sizes=(1,), modes=("gredy",), **quiet)
    with pytest.raises(BiEngineError, match="num_prompts: expected a positive number of prompts, got 0"):
        audit(engine, num_prompts=0, batch_sizes=(1,), **quiet)


def test_prefill_probe_names_the_first_divergent_op():
    """On the reference backend (PyTorch matmuls pick kernels by shape) the probe finds the first op
    whose rows change when the prompt is packed with others; an identical rerun shows none."""
    from bi_core.tools.diagnose import first_divergent_op

    engine = build_engine(EngineConfig.from_dict(tiny_config(scheduler={"max_num_seqs": 16})))
    prompt = list(range(1, 41))
    fillers = [list(range(5, 5 + n)) for n in (17, 90, 3, 64)]
    where = first_divergent_op(engine, prompt, fillers)
    assert where is not None and where.split(" at ")[0] in ("linear", "attention", "gdn", "norm", "linear (MLP)", "moe")
    assert first_divergent_op(engine, prompt, []) is None  # alone vs alone: same bits
    assert engine.cache.blocks.num_free == engine.cache.num_blocks  # pages and slots given back


def test_decode_probe_names_the_first_divergent_op():
    """A decode row alone vs packed with other sequences' decode rows (reference backend: PyTorch
    matmuls pick kernels by shape); alone vs alone shows none, and the probe gives back what it took."""
    from bi_core.tools.diagnose import first_divergent_decode_op

    engine = build_engine(EngineConfig.from_dict(tiny_config(scheduler={"max_num_seqs": 16})))
    prompt = list(range(1, 41))
    fillers = [list(range(5, 5 + n)) for n in (17, 90, 3, 64, 33, 12, 50)]
    where = first_divergent_decode_op(engine, prompt, fillers)
    assert where is not None and where.split(" at ")[0] in ("linear", "attention", "gdn", "norm", "linear (MLP)", "moe")
    assert first_divergent_decode_op(engine, prompt, []) is None
    assert engine.cache.blocks.num_free == engine.cache.num_blocks
    assert len(engine.cache.slots.free) == engine.config.scheduler.max_num_seqs


def test_probes_read_the_activation_of_norms_that_write_an_fp8_copy():
    """On an FP8 model the norms feeding block-FP8 projections return an ``Fp8Activation`` (the
    activation and its quantized copy); the probes compare the activation's rows (the copy is a
    function of them). The H200's FP8 negative control stopped on this with a TypeError."""
    from bi_core.ops.activation import Fp8Activation
    from bi_core.tools.diagnose import first_divergent_decode_op, first_divergent_op

    engine = build_engine(EngineConfig.from_dict(tiny_config(
        model={"random": {"preset": "tiny-moe-b128", "seed": 0}, "quantization": "fp8"}, scheduler={"max_num_seqs": 16})))
    seen = []
    hooks = [m.register_forward_hook(lambda mo, a, o: seen.append(isinstance(o, Fp8Activation)))
             for m in engine.model.modules() if type(m).__name__ == "RMSNorm"]
    prompt, fillers = list(range(1, 41)), [list(range(5, 5 + n)) for n in (17, 90, 3, 64)]
    assert first_divergent_op(engine, prompt, []) is None  # alone vs alone: same bits
    for h in hooks:
        h.remove()
    assert any(seen)  # not vacuous: some norm wrote an FP8 copy
    for probe in (first_divergent_op, first_divergent_decode_op):
        where = probe(engine, prompt, fillers)
        assert where is None or where.split(" at ")[0] in ("linear", "attention", "gdn", "norm", "linear (MLP)", "moe")
    assert first_divergent_decode_op(engine, prompt, []) is None
