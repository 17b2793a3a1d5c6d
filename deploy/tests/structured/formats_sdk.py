# OpenAI's `response_format` through its SDK, beyond completions' json_schema (schema_sdk.py):
# `{"type": "json_object"}` on /v1/completions, and a `json_schema` on /v1/chat/completions,
# streaming and not, on a model with a chat template. An output that ends (finish "stop") must
# parse (json.loads) as a JSON object, and every chat output must validate against the schema
# (jsonschema). A story model under `json_object` writes its story into the object's strings and
# does not close it within max_tokens: an output cut there (finish "length") must be the start
# of a JSON object.
# argv: base_url, schema (JSON), count. Prints {"json_object": {...}, "chat": {...}}, each with
# the outputs, the invalid ones and the finish reasons; the Rust test asserts on them.
import json, sys
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai

base_url, schema, count = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
model = client.models.list().data[0].id
response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}


def json_object(seed):
    completion = client.completions.create(
        model=model, prompt="Once upon a time", max_tokens=200, temperature=1.0, seed=seed,
        extra_body={"response_format": {"type": "json_object"}})
    return completion.choices[0].text, completion.choices[0].finish_reason


def chat(seed):
    # Alternate non-streamed and streamed requests.
    kwargs = dict(model=model, messages=[{"role": "user", "content": "Tell me about a person."}],
                  max_tokens=200, temperature=1.0, seed=seed, response_format=response_format)
    if seed % 2 == 0:
        completion = client.chat.completions.create(**kwargs)
        return completion.choices[0].message.content, completion.choices[0].finish_reason
    text, finish = "", None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return text, finish


# What may complete a cut-off JSON text's last token: a string's closing quote (after the rest
# of an escape), or the rest of a number or a literal.
ENDINGS = ["", '"', 'n"', '0"', '00"', '000"', '0000"', "0", "e", "ue", "rue", "l", "ll", "ull",
           "se", "lse", "alse"]


def json_object_start(text):
    """Whether text begins a JSON object: once its last token is completed, json's only
    complaint is that the input ended."""
    if not text.startswith("{"):
        return False
    for ending in ENDINGS:
        candidate = text + ending
        try:
            return isinstance(json.loads(candidate), dict)
        except json.JSONDecodeError as e:
            if e.pos >= len(candidate):
                return True
    return False


def check(results, validate):
    invalid, finish = [], {}
    for text, reason in results:
        finish[reason] = finish.get(reason, 0) + 1
        try:
            if reason == "length":
                assert json_object_start(text), "cut off, and not the start of a JSON object"
                continue
            value = json.loads(text)
            assert isinstance(value, dict), "not a JSON object"
            validate(value)
        except Exception as e:  # not JSON, not an object, or not valid against the schema
            invalid.append({"text": text, "error": str(e)[:200]})
    return {"outputs": [t for t, _ in results], "invalid": invalid, "finish": finish}


# The prefix check itself: starts of objects pass, other texts fail.
for start in ['{"a', '{"a":', '{"a":tr', '{"a":-', '{"a":1.', '{"a":"x\\', '{"a":[1,', '{}']:
    assert json_object_start(start), start
for other in ['Once upon', '{"a" x', '{"a":1}x', '[1', '{"a":tx']:
    assert not json_object_start(other), other

with ThreadPoolExecutor(4) as pool:
    objects = list(pool.map(json_object, range(count)))
    chats = list(pool.map(chat, range(count)))
print(json.dumps({
    "json_object": check(objects, lambda value: None),
    "chat": check(chats, lambda value: jsonschema.validate(value, schema)),
}))
