# Tool calls through OpenAI's SDK on a model with Qwen2.5's chat template: a named choice and
# `required` must come back as tool_calls whose arguments validate against the function's
# parameters, streaming and not; `auto` must come back as valid tool_calls or as plain text.
# argv: base_url. Prints one JSON object of findings; the Rust test asserts on it.
import json, sys

import jsonschema
import openai

base_url = sys.argv[1]
client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
model = client.models.list().data[0].id
parameters = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
tools = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": parameters}},
    {"type": "function", "function": {"name": "get_time", "description": "Local time",
                                      "parameters": {"type": "object", "properties": {},
                                                     "additionalProperties": False}}},
]
messages = [{"role": "user", "content": "What is the weather in Paris?"}]
named = {"type": "function", "function": {"name": "get_weather"}}

def check_calls(calls, only=None):
    """Each call names a tool and has JSON arguments valid for it."""
    assert calls, "no tool_calls"
    for call in calls:
        assert call["type"] == "function", call
        assert call["id"], call
        name = call["function"]["name"]
        assert name in ("get_weather", "get_time"), call
        assert only is None or name == only, call
        args = json.loads(call["function"]["arguments"])
        schema = parameters if name == "get_weather" else {"type": "object"}
        jsonschema.validate(args, schema)
    return [c["function"]["name"] for c in calls]

def plain(choice, seed, **kw):
    r = client.chat.completions.create(model=model, messages=messages, tools=tools, max_tokens=120,
                                       temperature=1.0, seed=seed, **kw)
    c = r.choices[0]
    calls = [t.model_dump() for t in (c.message.tool_calls or [])]
    return c.finish_reason, c.message.content, calls

def streamed(seed, **kw):
    stream = client.chat.completions.create(model=model, messages=messages, tools=tools, max_tokens=120,
                                            temperature=1.0, seed=seed, stream=True, **kw)
    content, calls, finish = "", {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        c = chunk.choices[0]
        if c.delta.content:
            content += c.delta.content
        for t in c.delta.tool_calls or []:
            entry = calls.setdefault(t.index, {"id": "", "type": "function",
                                               "function": {"name": "", "arguments": ""}})
            entry["id"] += t.id or ""
            if t.function:
                entry["function"]["name"] += t.function.name or ""
                entry["function"]["arguments"] += t.function.arguments or ""
        if c.finish_reason:
            finish = c.finish_reason
    return finish, content, [calls[i] for i in sorted(calls)]

out = {}
for seed in range(3):
    finish, _, calls = plain(named, seed, tool_choice=named)
    assert finish == "tool_calls", finish
    check_calls(calls, only="get_weather")
    finish, _, calls = streamed(seed, tool_choice=named)
    assert finish == "tool_calls", finish
    check_calls(calls, only="get_weather")
    finish, _, calls = plain(None, seed, tool_choice="required", parallel_tool_calls=False)
    assert finish == "tool_calls", finish
    assert len(check_calls(calls)) == 1, calls
    finish, _, calls = streamed(seed, tool_choice="required", parallel_tool_calls=False)
    assert finish == "tool_calls", finish
    assert len(check_calls(calls)) == 1, calls
out["named_and_required"] = "ok"

# Parallel calls may be several; a list the model keeps extending may run out of tokens.
parallel = []
for seed in range(3):
    finish, _, calls = plain(None, seed, tool_choice="required", parallel_tool_calls=True)
    if finish == "tool_calls":
        parallel.append(len(check_calls(calls)))
    else:
        assert finish == "length", finish
out["parallel_counts"] = parallel

# The same seeded named call, streamed and not, is the same call.
_, _, a = plain(named, 11, tool_choice=named)
_, _, b = streamed(11, tool_choice=named)
out["stream_matches"] = [c["function"] for c in a] == [c["function"] for c in b]

auto = {"calls": 0, "text": 0}
for seed in range(4):
    for finish, content, calls in (plain(None, seed), streamed(seed)):
        if calls:
            assert finish == "tool_calls", finish
            check_calls(calls)
            auto["calls"] += 1
        else:
            assert finish in ("stop", "length"), finish
            assert isinstance(content, str), content
            auto["text"] += 1
out["auto"] = auto

# A second turn: the assistant's call and the tool's answer render through the template.
history = messages + [
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"unit\": \"c\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"},
]
r = client.chat.completions.create(model=model, messages=history, tools=tools, max_tokens=8,
                                   tool_choice="none", temperature=0)
out["second_turn_finish"] = r.choices[0].finish_reason
out["none_has_no_calls"] = r.choices[0].message.tool_calls is None
print(json.dumps(out))
