"""The server's pieces that need no server: the param an error names."""

from __future__ import annotations

import pytest

from bi_core.serve.errors import param_of
from bi_core.serve.protocol import ChatCompletionRequest, CompletionRequest


@pytest.mark.parametrize("model,loc,expected", [
    (CompletionRequest, ("max_tokens",), ("max_tokens", None)),
    (CompletionRequest, ("prompt", "list[int]", 0), ("prompt", "list[int]")),
    (CompletionRequest, ("stop_token_ids", 2), ("stop_token_ids[2]", None)),
    (CompletionRequest, ("temprature",), ("temprature", None)),  # an extra field
    (CompletionRequest, ("stream_options", "include_usage"), ("stream_options.include_usage", None)),
    (ChatCompletionRequest, ("messages", 3, "role"), ("messages[3].role", None)),
    (ChatCompletionRequest, ("messages", 0, "content", "str"), ("messages[0].content", "str")),
])
def test_param_of_names_the_field_as_openai_does(model, loc, expected):
    assert param_of(model, loc) == expected

