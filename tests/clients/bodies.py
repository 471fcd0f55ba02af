"""Request bodies as real clients send them, recorded from each client's source (the file named
above each); only the prompts, lengths and the model's name are ours. ``method, path, body``."""

from __future__ import annotations

MODEL = "tiny"
IDS = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]  # "Hello, world" in the byte tokenizer
CONTEXT, CONTINUATION = [84, 104, 101, 32, 99, 97, 116], [32, 115, 97, 116]  # "The cat", " sat"

# ---------------------------------------------------------------- slime (THUDM/slime)
# slime/rollout/sglang_rollout.py: GenerateState.sampling_params (rollout_top_k -1, no stop, the
# --rollout-skip-special-tokens default: false), custom_params when rollout_top_p != 1, sampling_seed with
# deterministic inference; generate(): input_ids, return_logprob.
SLIME_SAMPLING = {"temperature": 1.0, "top_p": 0.9, "top_k": -1, "max_new_tokens": 8, "stop": None,
                  "stop_token_ids": None, "skip_special_tokens": False, "no_stop_trim": True,
                  "spaces_between_special_tokens": False, "custom_params": {"return_top_p_token_ids": True},
                  "sampling_seed": 42}
SLIME_GENERATE = ("POST", "/generate", {"sampling_params": SLIME_SAMPLING, "return_logprob": True, "input_ids": IDS})
# slime/backends/sglang_utils/server_control.py: abort_server_until_idle's two calls, looped until idle
SLIME_ABORT = ("POST", "/abort_request", {"abort_all": True})
SLIME_LOADS = ("GET", "/v1/loads?include=core,disagg,queues", None)

# ---------------------------------------------------------------- verl (volcengine/verl)
# verl/workers/rollout/sglang_rollout/http_server_engine.py: generate() drops the None fields;
# async_sglang_server.py: the agent loop's sampling params (repetition_penalty 1.0), rid, return_logprob.
VERL_GENERATE = ("POST", "/generate", {
    "rid": "verl-0", "input_ids": IDS, "return_logprob": True,
    "sampling_params": {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0,
                        "max_new_tokens": 8}})
VERL_HTTP_GENERATE = ("POST", "/generate", {"sampling_params": {"max_new_tokens": 8, "temperature": 0},
                                            "input_ids": IDS, "return_logprob": False})

# ---------------------------------------------------------------- SGLang's frontend (sgl-project/sglang)
# python/sglang/lang/backend/runtime_endpoint.py with python/sglang/lang/ir.py's SglSamplingParams
# defaults (to_srt_kwargs, global_config's special-token switches).
SGL_SAMPLING = {"skip_special_tokens": True, "spaces_between_special_tokens": True, "max_new_tokens": 8,
                "min_new_tokens": 0, "n": 1, "stop": [], "stop_token_ids": [], "stop_regex": [],
                "temperature": 0.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "frequency_penalty": 0.0,
                "presence_penalty": 0.0, "ignore_eos": False, "regex": None, "json_schema": None}
SGL_GEN = ("POST", "/generate", {"text": "Q: two plus two?\nA:", "sampling_params": SGL_SAMPLING})
SGL_GEN_STREAM = ("POST", "/generate", {"text": "Q: two plus two?\nA:", "sampling_params": SGL_SAMPLING,
                                        "stream": True})
# select(): cache the common prefix, then score every choice from two tokens before its end
SGL_CACHE_PREFIX = ("POST", "/generate", {"text": "The answer is", "sampling_params": {"max_new_tokens": 0}})
SGL_SELECT = ("POST", "/generate", {
    "text": ["The answer is yes", "The answer is no"], "sampling_params": {"max_new_tokens": 0, "temperature": 0},
    "return_logprob": True, "return_text_in_logprobs": True, "logprob_start_len": 11})
SGL_UNCONDITIONAL = ("POST", "/generate", {"input_ids": [[115, 32, 121, 101, 115], [115, 32, 110, 111]],
                                           "sampling_params": {"max_new_tokens": 0}, "return_logprob": True})
SGL_MODEL_INFO = ("GET", "/get_model_info", None)

# ---------------------------------------------------------------- lm-evaluation-harness (EleutherAI)
# lm_eval/models/openai_completions.py LocalCompletionsAPI._create_payload (token-id prompts, the
# default tokenized_requests); lm_eval/utils.py check_remote_tokenizer_support and RemoteTokenizer.
LM_EVAL_LOGLIKELIHOOD = ("POST", "/v1/completions", {
    "model": MODEL, "prompt": [CONTEXT + CONTINUATION, CONTEXT + [32, 114, 97, 110]], "temperature": 0,
    "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": True})
LM_EVAL_LOGLIKELIHOOD_NO_GENERATION = ("POST", "/v1/completions", {  # older harnesses: max_tokens 0
    "model": MODEL, "prompt": [CONTEXT + CONTINUATION], "temperature": 0, "max_tokens": 0, "logprobs": 1,
    "seed": 1234, "echo": True})
LM_EVAL_GENERATE_UNTIL = ("POST", "/v1/completions", {
    "prompt": [IDS, CONTEXT], "model": MODEL, "max_tokens": 8, "temperature": 0, "stop": ["\n\n", "Question:"],
    "seed": 1234})
LM_EVAL_TOKENIZER_INFO = ("GET", "/tokenizer_info", None)
LM_EVAL_TOKENIZE = ("POST", "/tokenize", {"prompt": "test", "add_special_tokens": False})
LM_EVAL_DETOKENIZE = ("POST", "/detokenize", {"tokens": [116, 101, 115, 116]})

# ---------------------------------------------------------------- guidellm (vllm-project/guidellm)
# src/guidellm/backends/openai/request_handlers.py: TextCompletionsRequestHandler and
# ChatCompletionsRequestHandler.format, streaming, a fixed output length.
GUIDELLM_COMPLETIONS = ("POST", "/v1/completions", {
    "model": MODEL, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    "max_tokens": 6, "stop": None, "ignore_eos": True, "prompt": "benchmark prompt"})
GUIDELLM_CHAT = ("POST", "/v1/chat/completions", {
    "model": MODEL, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    "max_completion_tokens": 6, "stop": None, "ignore_eos": True,
    "messages": [{"role": "system", "content": "prefix"},
                 {"role": "user", "content": [{"type": "text", "text": "benchmark prompt"}]}]})

# ---------------------------------------------------------------- aiperf (ai-dynamo/aiperf)
# src/aiperf/endpoints/openai_completions.py and openai_chat.py format_payload (server token
# counts: stream_options.include_usage; --per-chunk-usage adds continuous_usage_stats).
AIPERF_COMPLETIONS = ("POST", "/v1/completions", {
    "prompt": ["benchmark prompt"], "model": MODEL, "stream": True, "max_tokens": 6,
    "stream_options": {"include_usage": True}})
AIPERF_CHAT = ("POST", "/v1/chat/completions", {
    "messages": [{"role": "user", "content": "benchmark prompt"}], "model": MODEL, "stream": True,
    "max_completion_tokens": 6, "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
AIPERF_CHAT_PLAIN = ("POST", "/v1/chat/completions", {
    "messages": [{"role": "user", "content": "benchmark prompt"}], "model": MODEL, "stream": False,
    "max_completion_tokens": 6})
