"""The pruned draft vocabulary (``strategy.draft_vocab_size``, FR-Spec): MTP drafts choose among
a table of token ids, verification is untouched, so MTP == AR whatever the table; the draft head
is the table's lm_head rows, refreshed by weight updates."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import tiny_config
from test_mtp import N_SPEC, PARAMS, prompts

from bi_core import ConfigError, EngineConfig, build_engine
from bi_core.strategies.draft_vocab import count_table, draft_table


def config(preset: str, strategy: str = "mtp", **strategy_fields) -> EngineConfig:
    strat = {"name": strategy, **({"num_speculative_tokens": N_SPEC} if strategy == "mtp" else {}), **strategy_fields}
    return EngineConfig.from_dict(tiny_config(model={"random": {"preset": preset, "seed": 1}}, strategy=strat,
                                              scheduler={"prefill_chunk_size": 32}))


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe"])
@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_pruned_drafts_keep_mtp_equal_to_ar(preset, mode, tmp_path):
    ps, params = prompts(), PARAMS[mode]
    ar = build_engine(config(preset, "ar")).generate(ps, params)
    # a table that holds the tokens AR emits first (so drafts can be right) and a few others
    emitted = [t for o in ar for t in o.token_ids]
    table = list(dict.fromkeys(emitted))[:40] + [t for t in range(260) if t not in emitted][:24]
    path = tmp_path / "table.json"
    path.write_text(json.dumps(table))
    eng = build_engine(config(preset, draft_vocab_size=48, draft_vocab=str(path)))
    allowed = set(eng.model.draft_ids.tolist())
    proposed = []
    eng.strategy.draft_hook = lambda seq, d: (proposed.extend(d), d)[1]
    out = eng.generate(ps, params)
    for a, m in zip(ar, out):
        assert m.token_ids == a.token_ids
        torch.testing.assert_close(torch.tensor(m.token_logprobs), torch.tensor(a.token_logprobs), atol=1e-5, rtol=1e-5)
    assert len(allowed) == 48 and proposed and set(proposed) <= allowed
    assert sum(o.num_draft_tokens for o in out) > 0  # (a random head's drafts are rarely right: no acceptance asked)


def test_draft_is_the_full_heads_argmax_over_the_table():
    eng = build_engine(config("tiny-dense", draft_vocab_size=32))
    model = eng.model
    h = torch.randn(7, model.args.hidden_size)
    full = model.compute_logits(h)
    ids = model.draft_ids
    want = ids[torch.argmax(full[:, ids], dim=-1)]
    got = ids[torch.argmax(model._draft_head.forward(h, model.draft_weight), dim=-1)]
    assert torch.equal(got, want)
    assert ids.tolist()[:1] == list(model.args.eos_token_ids)[:1] and sorted(ids.tolist()[1:]) == list(range(31))


def test_a_weight_update_refreshes_the_draft_head():
    eng = build_engine(config("tiny-dense", draft_vocab_size=32))
    model = eng.model
    name = "lm_head.weight" if model.lm_head is not None else "embed_tokens"
    full = dict(model.named_parameters())[name]
    weight = model.draft_weight
    new = torch.randn_like(full)
    eng.update_weights({name: new})
    assert model.draft_weight is weight  # the same storage: captured graphs read the new rows
    assert torch.equal(model.draft_weight, new[model.draft_ids])


def test_tables():
    assert draft_table(4, 10, (9,)) == [9, 0, 1, 2]
    assert draft_table(3, 10, (2,), None) == [2, 0, 1]

    class Tok:
        def encode(self, text):
            return [ord(c) for c in text]

    assert count_table(Tok(), ["abca", "cc"], 2) == [ord("c"), ord("a")]


@pytest.mark.parametrize(("fields", "key", "text"), [
    ({"name": "ar", "draft_vocab_size": 8}, "strategy.draft_vocab_size", "only for speculative"),
    ({"name": "mtp", "draft_vocab": "x.json"}, "strategy.draft_vocab", "set strategy.draft_vocab_size"),
    ({"name": "mtp", "draft_vocab_size": 100_000}, "strategy.draft_vocab_size", "exceeds the model's vocabulary"),
    ({"name": "mtp", "draft_vocab_size": 8, "draft_vocab": "/nonexistent/t.json"}, "strategy.draft_vocab",
     "cannot read"),
])
def test_bad_settings_are_refused_with_the_key(fields, key, text):
    with pytest.raises(ConfigError, match=text) as e:
        build_engine(EngineConfig.from_dict(tiny_config(strategy=fields)))
    assert key in str(e.value)


def test_a_bad_table_file_is_refused(tmp_path):
    for content, text in (("[1, 2, 99999]", "outside the vocabulary"), ("1 2 x", "expected token ids"),
                          ("[1, 2]", "distinct ids")):
        path = tmp_path / "t.txt"
        path.write_text(content)
        with pytest.raises(ConfigError, match=text):
            build_engine(config("tiny-dense", draft_vocab_size=8, draft_vocab=str(path)))


def test_pruned_drafts_through_graph_runners():
    """The head's chain and catch-up steps replay (rerun) graphs with the pruned head too."""
    from test_graph_steps import with_graph_runners

    ps, params = prompts()[:3], PARAMS["greedy"]
    ar = build_engine(config("tiny-moe", "ar")).generate(ps, params)
    eng = with_graph_runners(build_engine(config("tiny-moe", draft_vocab_size=64)))
    proposed = []
    eng.strategy.draft_hook = lambda seq, d: (proposed.extend(d), d)[1]
    out = eng.generate(ps, params)
    assert [o.token_ids for o in out] == [o.token_ids for o in ar]
    assert eng.runner.mtp_graphs.num_replays[1] > 0 and set(proposed) <= set(eng.model.draft_ids.tolist())


def test_cli_counts_a_corpus_into_a_table_the_engine_takes(tmp_path, capsys):
    from bi_core.cli import main

    (tmp_path / "a.txt").write_text("hello hello world")
    (tmp_path / "b.jsonl").write_text('{"text": "zzz"}\n"hh"\n')
    out = tmp_path / "table.json"
    assert main(["draft-vocab", "--config", "configs/cpu_reference.yaml", "--size", "5", "--out", str(out),
                 str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl")]) == 0
    assert json.loads(out.read_text()) == [ord("l"), ord("h"), ord("o"), ord("z"), ord(" ")]
    eng = build_engine(config("tiny-dense", draft_vocab_size=5, draft_vocab=str(out)))
    eos = list(eng.model.args.eos_token_ids)
    assert eng.model.draft_ids.tolist() == (eos + [ord("l"), ord("h"), ord("o"), ord("z")])[:5]
    assert main(["draft-vocab", "--config", "configs/cpu_reference.yaml", "--out", str(out),
                 str(tmp_path / "missing.txt")]) == 2
    assert "missing.txt: cannot read it as text" in capsys.readouterr().err
