"""End to end: a real `omlx serve` with the real model, driven by the official openai client."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.conftest import MODEL_NAME, Server

pytestmark = pytest.mark.slow

CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)


def test_models_lists_the_configured_model(client: openai.OpenAI):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert models.data[0].owned_by == "omlx"
    assert models.data[0].model_extra["state"] == "ready"


def test_chat_answers_with_usage(client: openai.OpenAI):
    r = client.chat.completions.create(model=MODEL_NAME, messages=CAPITAL, temperature=0, max_tokens=24)
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.object == "chat.completion" and r.model == MODEL_NAME
    u = r.usage
    assert u.prompt_tokens > 5 and u.completion_tokens > 0
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert 0 <= u.prompt_tokens_details.cached_tokens < u.prompt_tokens


def test_cached_tokens_count_a_revisited_prompt(client: openai.OpenAI):
    messages = [{"role": "user", "content": "Name three rivers of Europe, one per line."}]
    salt = {"cache_salt": "revisit-test"}  # a tenant of its own: nothing cached before
    first = client.chat.completions.create(model=MODEL_NAME, messages=messages, temperature=0, max_tokens=8,
                                           extra_body=salt)
    again = client.chat.completions.create(model=MODEL_NAME, messages=messages, temperature=0, max_tokens=8,
                                           extra_body=salt)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1
    assert again.choices[0].message.content == first.choices[0].message.content


def test_streaming_matches_non_streaming(client: openai.OpenAI):
    whole = client.chat.completions.create(model=MODEL_NAME, messages=CAPITAL, temperature=0, max_tokens=24)
    chunks = list(client.chat.completions.create(
        model=MODEL_NAME, messages=CAPITAL, temperature=0, max_tokens=24,
        stream=True, stream_options={"include_usage": True},
    ))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == whole.usage.total_tokens
    assert all(c.object == "chat.completion.chunk" for c in chunks)


def test_streaming_without_usage_sends_no_usage_chunk(client: openai.OpenAI):
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=CAPITAL, temperature=0,
                                                 max_tokens=4, stream=True))
    assert all(c.usage is None and c.choices for c in chunks)


def test_max_tokens_ends_with_length(client: openai.OpenAI):
    r = client.chat.completions.create(model=MODEL_NAME, messages=CAPITAL, temperature=0, max_tokens=3)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 3


def test_default_model_is_used_when_model_is_empty(server: Server):
    body = {"messages": CAPITAL, "temperature": 0, "max_tokens": 2}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200 and r.json()["model"] == MODEL_NAME


def test_stop_string_is_not_emitted(client: openai.OpenAI):
    free = client.chat.completions.create(model=MODEL_NAME, messages=CAPITAL, temperature=0, max_tokens=24)
    text = free.choices[0].message.content
    stop = text[text.index("Paris"):][:4]  # "Pari": spans tokens and cuts mid-word
    r = client.chat.completions.create(model=MODEL_NAME, messages=CAPITAL, temperature=0, max_tokens=24,
                                       stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == text[: text.index(stop)]
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL_NAME, messages=CAPITAL, temperature=0, max_tokens=24, stop=stop, stream=True))
    assert streamed == r.choices[0].message.content


def test_seed_makes_sampling_reproducible(client: openai.OpenAI):
    def sample(seed: int) -> str:
        return client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "Write a short poem."}],
            temperature=1.0, top_p=0.95, seed=seed, max_tokens=16).choices[0].message.content
    assert sample(7) == sample(7)
    assert len({sample(7), sample(8), sample(9)}) > 1


def test_completions_endpoint(client: openai.OpenAI):
    r = client.completions.create(model=MODEL_NAME, prompt="The capital of France is", temperature=0,
                                  max_tokens=5)
    assert r.object == "text_completion"
    assert r.choices[0].text.startswith(" Paris")  # continues the prompt's text exactly
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"
    with_logprobs = client.completions.create(model=MODEL_NAME, prompt="The capital of France is",
                                              temperature=0, max_tokens=5, logprobs=2)
    assert "".join(with_logprobs.choices[0].logprobs.tokens) == r.choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL_NAME, prompt="The capital of France is", temperature=0, max_tokens=5, stream=True)
        if c.choices)
    assert streamed == r.choices[0].text


def test_completions_with_token_ids_and_echo(client: openai.OpenAI):
    prompt = "The capital of France is"
    r = client.completions.create(model=MODEL_NAME, prompt=prompt, temperature=0, max_tokens=2, echo=True)
    assert r.choices[0].text.startswith(prompt)


def test_logprobs(client: openai.OpenAI):
    r = client.chat.completions.create(model=MODEL_NAME, messages=CAPITAL, temperature=0, max_tokens=4,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    assert "".join(c.token for c in content).strip() == r.choices[0].message.content.strip()
    for c in content:
        assert c.logprob <= 0 and len(c.top_logprobs) == 3
        assert c.top_logprobs[0].logprob >= c.top_logprobs[-1].logprob
        assert c.token == c.top_logprobs[0].token  # greedy picks the top token


# --- errors: OpenAI's shape, the right status, never a 500 ---------------------------------

def error_of(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"])
    return body["error"]


@pytest.mark.parametrize("raw", [b"{not json", b"", b"[1, 2]", b'"text"'])
def test_malformed_json_is_400(server: Server, raw: bytes):
    r = httpx.post(f"{server.url}/v1/chat/completions", content=raw,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert error_of(r)["type"] == "invalid_request_error"


@pytest.mark.parametrize("body, param", [
    ({"messages": CAPITAL, "temperature": 5}, "temperature"),
    ({"messages": CAPITAL, "max_tokens": 0}, "max_tokens"),
    ({"messages": CAPITAL, "top_p": 0}, "top_p"),
    ({"messages": CAPITAL, "n": 2}, "n"),
    ({"messages": []}, "messages"),
    ({}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    ({"messages": CAPITAL, "stop": ["a"] * 17}, "stop"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
])
def test_bad_parameters_are_400_naming_the_parameter(server: Server, body: dict, param: str):
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"model": MODEL_NAME, **body})
    assert r.status_code == 400
    assert error_of(r)["param"] == param


def test_unknown_model_is_404(client: openai.OpenAI):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="no-such-model", messages=CAPITAL)
    assert e.value.status_code == 404
    assert e.value.body["code"] == "model_not_found"


def test_prompt_longer_than_context_is_400(client: openai.OpenAI):
    long = "hello " * 3000  # the test config caps the context at 2048 tokens
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": long}])
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL_NAME, prompt=long)


def test_out_of_vocabulary_token_ids_are_400(client: openai.OpenAI):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL_NAME, prompt=[1, 2, 10**9])


def test_unknown_route_and_method_use_the_error_shape(server: Server):
    r = httpx.get(f"{server.url}/v1/nothing")
    assert r.status_code == 404 and error_of(r)["type"] == "not_found_error"
    r = httpx.get(f"{server.url}/v1/chat/completions")
    assert r.status_code == 405 and error_of(r)
