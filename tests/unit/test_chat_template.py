"""Chat templates as checkpoints ship them (bi_core/models/chat_template.py, tokenizer.py): the
byte tokenizer of the random presets renders Qwen3.5's format exactly (thinking, tools, tool calls,
tool results), a Hugging Face tokenizer renders its own template with the same inputs,
``chat_template_kwargs`` reaches the variables a template reads and nothing else; and an episode
continued from its exact ids (chat_episode.py) is the concatenation of its turns."""

from __future__ import annotations

import pytest

from bi_core.models.chat_episode import extend_chat
from bi_core.models.chat_template import ChatTemplateError, qwen3_5_template
from bi_core.models.tokenizer import ByteTokenizer

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Get weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
TOOLS_PROMPT = (
    "<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n"
    '{"type": "function", "function": {"name": "get_weather", "description": "Get weather", "parameters": '
    '{"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}\n</tools>\n\n'
    "If you choose to call a function ONLY reply in the following format with NO suffix:\n\n<tool_call>\n"
    "<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n"
    "<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple lines\n"
    "</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n- Function calls MUST follow the specified "
    "format: an inner <function=...></function> block must be nested within <tool_call></tool_call> XML tags\n"
    "- Required parameters MUST be specified\n- You may provide optional reasoning for your function call in natural "
    "language BEFORE the function call, but NOT after\n- If there is no function call available, answer the question "
    "like normal with your current knowledge and do not tell the user about function calls\n</IMPORTANT>")
TOK = ByteTokenizer()


def test_a_plain_turn_opens_thinking_and_enable_thinking_false_closes_it():
    p = TOK.chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert p.text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    assert p.opens_reasoning and p.stop_token_ids == (TOK.im_end,)
    assert p.ids[:2] == [TOK.im_start, *TOK.encode("s")] and p.ids.count(TOK.im_end) == 2  # specials are tokens
    off = TOK.chat([{"role": "user", "content": "Hi"}], template_kwargs={"enable_thinking": False})
    assert off.text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n") and not off.opens_reasoning


def test_tools_tool_calls_and_tool_results_in_qwen3_5s_format():
    messages = [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": "", "reasoning_content": "Two cities.", "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"id": "b", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome", "n": [1]}}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "a"}, {"role": "tool", "content": "rain", "tool_call_id": "b"}]
    p = TOK.chat(messages, tools=TOOLS)
    assert p.text == (
        TOOLS_PROMPT + "\n\nBe brief.<|im_end|>\n<|im_start|>user\nWeather in Paris and Rome?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nTwo cities.\n</think>\n\n<tool_call>\n<function=get_weather>\n"
        "<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n"
        "<parameter=city>\nRome\n</parameter>\n<parameter=n>\n[1]\n</parameter>\n</function>\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n<think>\n")


def test_earlier_thinking_is_stripped_once_a_new_user_turn_follows():
    turn = {"role": "assistant", "content": "Hello!", "reasoning_content": "greet"}
    kept = TOK.chat([{"role": "user", "content": "Hi"}, turn], add_generation_prompt=False).text
    assert kept.endswith("<|im_start|>assistant\n<think>\ngreet\n</think>\n\nHello!<|im_end|>\n")
    later = TOK.chat([{"role": "user", "content": "Hi"}, turn, {"role": "user", "content": "Bye"}]).text
    assert "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye" in later and "greet" not in later


def test_continue_final_message_leaves_the_last_message_open():
    p = TOK.chat([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}],
                 add_generation_prompt=False, continue_final_message=True)
    assert p.text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nHel")
    with pytest.raises(ChatTemplateError, match="cannot both be true"):
        TOK.chat([{"role": "user", "content": "Hi"}], continue_final_message=True)


def test_template_kwargs_are_the_variables_the_template_reads():
    with pytest.raises(ChatTemplateError, match=r"does not read preserve_thinking.*the variables it reads") as e:
        TOK.chat([{"role": "user", "content": "Hi"}], template_kwargs={"preserve_thinking": True})  # Qwen3.6's
    assert e.value.param == "chat_template_kwargs.preserve_thinking"
    assert "add_vision_id" in str(e.value) and "enable_thinking" in str(e.value)
    TOK.chat([{"role": "user", "content": "Hi"}], template_kwargs={"enable_thinking": True, "add_vision_id": False})
    with pytest.raises(ChatTemplateError, match="request field of that name"):
        TOK.chat([{"role": "user", "content": "Hi"}], template_kwargs={"tools": []})
    with pytest.raises(ChatTemplateError, match="No user query found"):  # the template's own refusal
        TOK.chat([{"role": "system", "content": "only a system turn"}])


def _char_tokenizer(path, template: str):
    """A Hugging Face tokenizer of one token per character, special tokens included, with ``template``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from bi_core.models.tokenizer import HFTokenizer

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {c: i for i, c in enumerate(["[UNK]", *specials, "\n", *map(chr, range(32, 127))])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]", eos_token="<|im_end|>",
                                  additional_special_tokens=specials)
    tok.chat_template = template
    tok.save_pretrained(path)
    return HFTokenizer(path)


def test_a_checkpoints_template_gets_the_same_inputs(tmp_path):
    hf = _char_tokenizer(tmp_path, qwen3_5_template())
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny"}]
    for kwargs in ({}, {"enable_thinking": False}):
        mine, theirs = TOK.chat(messages, tools=TOOLS, template_kwargs=kwargs), hf.chat(messages, tools=TOOLS,
                                                                                        template_kwargs=kwargs)
        assert theirs.text == mine.text
        pieces = hf._tok.convert_ids_to_tokens(theirs.ids)
        assert "".join(pieces) == mine.text and pieces.count("<|im_start|>") == mine.ids.count(TOK.im_start)
    with pytest.raises(ChatTemplateError, match="does not read thinking_budget"):
        hf.chat(messages, template_kwargs={"thinking_budget": 5})
    other = _char_tokenizer(tmp_path / "other", "{{ messages[0].content }}{% if budget %}[{{ budget }}]{% endif %}")
    assert other.chat([{"role": "user", "content": "Hi"}], template_kwargs={"budget": 5}).text == "Hi[5]"


def _answer(text: str) -> list[int]:
    """An answer's ids as the engine returns them: its text, then the <|im_end|> it stopped on."""
    return TOK.encode(text) + [TOK.im_end]


def test_a_five_turn_episode_is_the_concatenation_of_its_turns():
    turns = [[{"role": "user", "content": "Weather in Paris?"}],
             [{"role": "tool", "content": "sunny, 24C"}],
             [{"role": "user", "content": "And Rome?"}],
             [{"role": "tool", "content": "rain"}, {"role": "tool", "content": "wind"}],
             [{"role": "user", "content": "Thanks."}]]
    answers = ["I should call it.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
               "</parameter>\n</function>\n</tool_call>", "Got it.\n</think>\n\nSunny, 24C.",
               "Call again.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n"
               "</function>\n</tool_call>", "Two results.\n</think>\n\nRain and wind.", "Bye.\n</think>\n\nBye!"]
    prompt = TOK.chat(turns[0], tools=TOOLS)
    episode = prompt.ids
    for n in range(1, 5):
        episode = episode + _answer(answers[n - 1])
        prompt = extend_chat(TOK, episode, turns[n], tools=TOOLS)
        new = prompt.ids[len(episode):]
        assert prompt.ids[:len(episode)] == episode  # turn n+1's prompt extends turn n's ids exactly
        assert TOK.decode(new, skip_special_tokens=False, spaces_between_special_tokens=False) == \
            "\n" + prompt.text and prompt.opens_reasoning  # the turn's "\n" after <|im_end|>, then the messages
        episode = prompt.ids
    episode += _answer(answers[4])
    # the episode holds every turn's thinking as sampled; re-rendering the conversation strips it (the fork)
    conversation = [m for n in range(5) for m in turns[n] + [{"role": "assistant", "content": answers[n]}]]
    rerendered = TOK.chat(conversation, tools=TOOLS, add_generation_prompt=False)
    text = TOK.decode(episode, skip_special_tokens=False, spaces_between_special_tokens=False)
    assert text.count("</think>") == 5 and rerendered.text.count("</think>") < 5
    assert rerendered.text.rstrip("\n") != text
    # each new part is what the template writes for those messages after an assistant turn
    after_tool = extend_chat(TOK, _answer("x"), turns[1], tools=TOOLS, template_kwargs={"enable_thinking": False})
    assert after_tool.text == ("<|im_start|>user\n<tool_response>\nsunny, 24C\n</tool_response><|im_end|>\n"
                               "<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_a_turn_cut_before_its_end_gets_the_templates_end():
    cut = TOK.encode("truncated answ")
    p = extend_chat(TOK, cut, [{"role": "user", "content": "go on"}])
    assert p.ids[:len(cut)] == cut and p.ids[len(cut):len(cut) + 2] == [TOK.im_end, *TOK.encode("\n")]
