# 100 seeded chat-less completions with a JSON schema through OpenAI's SDK, 8 at a time (so the
# decode node batches them); every output must validate against the schema (jsonschema).
# argv: base_url, schema (JSON). Prints {"outputs": [...], "invalid": [...], "finish": {...}}.
import json, sys
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai

base_url, schema = sys.argv[1], json.loads(sys.argv[2])
client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
model = client.models.list().data[0].id

def one(seed):
    completion = client.completions.create(
        model=model,
        prompt="Once upon a time",
        max_tokens=200,
        temperature=1.0,
        seed=seed,
        extra_body={"response_format": {"type": "json_schema",
                                        "json_schema": {"name": "person", "schema": schema}}},
    )
    return completion.choices[0].text, completion.choices[0].finish_reason

with ThreadPoolExecutor(8) as pool:
    results = list(pool.map(one, range(100)))

invalid, finish = [], {}
for text, reason in results:
    finish[reason] = finish.get(reason, 0) + 1
    try:
        jsonschema.validate(json.loads(text), schema)
    except Exception as e:  # not JSON, or not valid against the schema
        invalid.append({"text": text, "error": str(e)[:200]})
print(json.dumps({"outputs": [t for t, _ in results], "invalid": invalid, "finish": finish}))
