"""A checkpoint directory with its own tokenizer: text prompts in, text out, through AutoTokenizer."""

from __future__ import annotations

from hf_fixtures import hf_greedy, make_hf_model, save_checkpoint

from bi_core import EngineConfig, SamplingParams, build_engine


def save_tokenizer(path) -> object:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["hello", "world", "batch", "invariance", "is", "bitwise", "the", "same", "<unk>", "<eos>"]
    vocab = {w: i for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")
    fast.save_pretrained(str(path))
    return fast


def test_text_prompts_use_the_checkpoint_tokenizer(tmp_path):
    hf = make_hf_model("dense")
    path = save_checkpoint(hf, tmp_path / "ckpt")
    fast = save_tokenizer(path)
    cfg = {"model": {"path": str(path), "dtype": "float32", "device": "cpu"}, "backend": "reference"}
    engine = build_engine(EngineConfig.from_dict(cfg))
    out = engine.generate(["hello world is the same"], SamplingParams(max_new_tokens=5, ignore_eos=True))[0]
    ids = fast.encode("hello world is the same", add_special_tokens=False)
    assert out.prompt_token_ids == ids
    tokens, _, _ = hf_greedy(hf, ids, 5)
    assert out.token_ids == tokens
    assert out.text == fast.decode(tokens, skip_special_tokens=True)
