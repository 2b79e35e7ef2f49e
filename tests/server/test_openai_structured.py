"""Structured output on /v1/chat/completions: `response_format` enforced by the grammar,
so even the tiny model's answers parse and validate, streaming or not."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest

from tests.conftest import MODEL_NAME, Server

pytestmark = pytest.mark.slow


def obj(properties: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": properties, "required": required or list(properties),
            "additionalProperties": False}


def text(n: int = 40) -> dict:
    return {"type": "string", "maxLength": n}


CASES = [
    ("Describe a person named Alice who is 30.", obj({"name": text(), "age": {"type": "integer"}})),
    ("Is the sky blue? Answer yes or no.", obj({"answer": {"type": "string", "enum": ["yes", "no"]}})),
    ("Rate the movie Titanic from 1 to 5.", obj({"rating": {"type": "integer", "minimum": 1, "maximum": 5}})),
    ("Give the capital of France.", obj({"country": text(), "capital": text()})),
    ("List two fruits.", obj({"fruits": {"type": "array", "items": text(20), "minItems": 1, "maxItems": 3}})),
    ("Is water wet?", obj({"wet": {"type": "boolean"}})),
    ("What is 2 + 3?", obj({"result": {"type": "number"}})),
    ("Describe a book.", obj({"title": text(), "author": text(),
                              "year": {"type": "integer", "minimum": 0, "maximum": 2100}})),
    ("Give the weather in Rome.", obj({"city": text(), "temperature_c": {"type": "number"},
                                      "sky": {"type": "string", "enum": ["sunny", "cloudy", "rainy"]}})),
    ("Make a todo item.", obj({"task": text(), "done": {"type": "boolean"},
                               "priority": {"type": "string", "enum": ["low", "medium", "high"]}})),
    ("Describe a user account.", obj({"user": obj({"id": {"type": "integer", "minimum": 0, "maximum": 99999},
                                                            "email": text()}),
                                      "active": {"type": "boolean"}})),
    ("Give a color in hex.", obj({"hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}})),
    ("Give three numbers.", obj({"numbers": {"type": "array", "items": {"type": "integer"},
                                             "minItems": 3, "maxItems": 3}})),
    ("Translate hello to French.", obj({"source": text(), "translation": text()})),
    ("Name an animal and its legs.", obj({"animal": text(), "legs": {"type": "integer", "minimum": 0,
                                                                       "maximum": 1000}})),
    ("Summarize: The cat sat on the mat.", obj({"summary": text(80)})),
    ("Pick a shape.", {"anyOf": [obj({"kind": {"const": "circle"}, "radius": {"type": "number"}}),
                                 obj({"kind": {"const": "square"}, "side": {"type": "number"}})]}),
    ("Give an address.", obj({"street": text(), "city": text(), "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                             ["city", "zip"])),
    ("Classify the sentiment of: I love this!", obj({"sentiment": {"enum": ["positive", "negative", "neutral"]},
                                                     "confidence": {"type": "number", "minimum": 0,
                                                                    "maximum": 1}})),
    ("Give a short list of tags for a blog post about Python.",
     obj({"tags": {"type": "array", "items": {"type": "string", "maxLength": 15}, "maxItems": 4},
          "draft": {"type": "boolean"}})),
]


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)


def answer(client: openai.OpenAI, i: int, prompt: str, schema: dict) -> tuple[str, str]:
    """Returns the answer's text and finish reason; every third one is streamed."""
    args = dict(model=MODEL_NAME, messages=[{"role": "user", "content": prompt}], temperature=0,
                max_tokens=200, response_format={"type": "json_schema",
                                                 "json_schema": {"name": f"case_{i}", "schema": schema}})
    if i % 3:
        r = client.chat.completions.create(**args)
        return r.choices[0].message.content, r.choices[0].finish_reason
    chunks = list(client.chat.completions.create(**args, stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return content, [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason][0]


def test_twenty_schemas_all_validate(client):
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda c: answer(client, c[0], *c[1]), enumerate(CASES)))
    bad = []
    for (prompt, schema), (content, finish) in zip(CASES, answers):
        try:
            jsonschema.validate(json.loads(content), schema)
        except (ValueError, jsonschema.ValidationError) as e:
            bad.append((prompt, finish, content, str(e)[:200]))
    assert not bad
    assert {finish for _, finish in answers} == {"stop"}


def test_json_object_is_a_json_object(client):
    r = client.chat.completions.create(
        model=MODEL_NAME, temperature=0, max_tokens=120, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Return a JSON object with the key name set to Bob."}])
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_text_format_is_free_text(client):
    r = client.chat.completions.create(model=MODEL_NAME, temperature=0, max_tokens=16,
                                       response_format={"type": "text"},
                                       messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in r.choices[0].message.content


def test_a_cut_answer_ends_with_length(client):
    schema = obj({"summary": {"type": "string"}})
    r = client.chat.completions.create(
        model=MODEL_NAME, temperature=0, max_tokens=3,
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
        messages=[{"role": "user", "content": "Summarize the history of Rome."}])
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].message.content.startswith('{"summary":')  # cut, as the budget says


@pytest.mark.parametrize("response_format, param", [
    ({"type": "xml"}, "response_format.type"),
    ({"type": "json_schema"}, "response_format"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}, "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}, "response_format"),
    ("json", "response_format"),
])
def test_bad_response_format_is_a_400_naming_the_param(server: Server, response_format, param):
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
        "response_format": response_format})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
