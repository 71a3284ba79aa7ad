"""Drives a Tandem endpoint (an instance or the P/D proxy) with the official `openai` client, as a
vLLM user would, and checks what comes back. Run by tests/openai_client.rs; exits non-zero with the
first failed check.

Usage: python3 tests/openai/client_check.py BASE_URL [API_KEY]
"""

import json
import os
import sys

import openai
from openai import OpenAI


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def expect_error(kind, call, param=None):
    try:
        call()
    except kind as e:
        body = e.body if isinstance(e.body, dict) else {}
        if param is not None:
            check(body.get("param") == param, f"{kind.__name__}: param {body!r}, want {param!r}")
        return e
    raise AssertionError(f"expected {kind.__name__}")


def token_ids(choice):
    extra = choice.model_extra or {}
    ids = extra.get("token_ids")
    check(isinstance(ids, list), f"no token_ids in {choice!r}")
    return ids


def main():
    base = sys.argv[1]
    key = sys.argv[2] if len(sys.argv) > 2 else "unused"
    client = OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=300)

    if len(sys.argv) > 2:
        wrong = OpenAI(base_url=f"{base}/v1", api_key="wrong-key", max_retries=0)
        expect_error(openai.AuthenticationError, lambda: wrong.models.list())

    models = client.models.list().data
    check(len(models) >= 1, "no model listed")
    model = models[0].id

    messages = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0)
    text = chat.choices[0].message.content
    check(chat.choices[0].message.role == "assistant", "role")
    check(text and text.strip(), f"chat answer: {text!r}")
    check(chat.choices[0].finish_reason in ("stop", "length"), chat.choices[0].finish_reason)
    check(chat.usage.prompt_tokens > 0 and chat.usage.completion_tokens > 0, chat.usage)

    # streaming, with usage in the last chunk: the same text as the plain call
    pieces, usage = [], None
    for chunk in client.chat.completions.create(
        model=model, messages=messages, max_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True},
    ):
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
        if chunk.usage:
            usage = chunk.usage
    check("".join(pieces) == text, f"stream {''.join(pieces)!r} != {text!r}")
    check(usage is not None and usage.completion_tokens == chat.usage.completion_tokens, usage)

    # completions: logprobs, n, stop, seed
    c = client.completions.create(model=model, prompt="The capital of France is", max_tokens=6,
                                  temperature=0, logprobs=2)
    lp = c.choices[0].logprobs
    check(len(lp.tokens) == 6 and all(len(t) == 2 for t in lp.top_logprobs), lp)
    check(all(x <= 0 for x in lp.token_logprobs), lp.token_logprobs)
    c = client.completions.create(model=model, prompt="Count: one, two,", max_tokens=8,
                                  temperature=0.9, seed=11, n=2)
    check(len(c.choices) == 2 and {x.index for x in c.choices} == {0, 1}, c.choices)
    again = client.completions.create(model=model, prompt="Count: one, two,", max_tokens=8,
                                      temperature=0.9, seed=11, n=2)
    check([x.text for x in c.choices] == [x.text for x in again.choices], "seeded sampling")
    c = client.completions.create(model=model, prompt="List three colors:\n1.", max_tokens=32,
                                  temperature=0, stop=["\n"])
    check("\n" not in c.choices[0].text and c.choices[0].finish_reason == "stop", c.choices[0])

    # sampling controls change the output as they say
    forced = client.completions.create(model=model, prompt="Hello", max_tokens=5, temperature=0,
                                       logit_bias={"504": 100}, extra_body={"return_token_ids": True})
    check(token_ids(forced.choices[0]) == [504] * 5, token_ids(forced.choices[0]))
    loop = "one one one one one one one one one one"
    plain = client.completions.create(model=model, prompt=loop, max_tokens=12, temperature=0,
                                      extra_body={"return_token_ids": True})
    varied = client.completions.create(model=model, prompt=loop, max_tokens=12, temperature=0,
                                       frequency_penalty=2.0, presence_penalty=1.0,
                                       extra_body={"return_token_ids": True})
    check(len(set(token_ids(varied.choices[0]))) > len(set(token_ids(plain.choices[0]))),
          f"penalties: {varied.choices[0].text!r} vs {plain.choices[0].text!r}")
    rep = client.completions.create(model=model, prompt=loop, max_tokens=12, temperature=0,
                                    extra_body={"repetition_penalty": 1.5, "return_token_ids": True})
    check(token_ids(rep.choices[0]) != token_ids(plain.choices[0]), "repetition_penalty")

    # structured outputs: a JSON schema, a choice, a forced tool call (in P/D the decode
    # instance constrains what it samples, and so does the producer)
    schema = {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "population_millions": {"type": "integer", "minimum": 0, "maximum": 50}},
        "required": ["city", "population_millions"], "additionalProperties": False}
    for q in ["Name a large city.", "Which city is the capital of Japan?", "Pick any city."]:
        c = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": q}], max_tokens=60, temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}})
        v = json.loads(c.choices[0].message.content)
        check(set(v) == {"city", "population_millions"} and isinstance(v["city"], str)
              and 0 <= v["population_millions"] <= 50, v)
    c = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0,
                                       extra_body={"guided_choice": ["Paris", "Lyon", "Nice"]})
    check(c.choices[0].message.content in ("Paris", "Lyon", "Nice"), c.choices[0].message.content)
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"], "additionalProperties": False}}}
    c = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Weather in Rome?"}], max_tokens=40,
        temperature=0, tools=[weather],
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    calls = c.choices[0].message.tool_calls
    check(c.choices[0].finish_reason == "tool_calls" and calls and
          calls[0].function.name == "get_weather", c.choices[0])
    check(isinstance(json.loads(calls[0].function.arguments)["city"], str), calls[0])

    # lm-eval-harness's loglikelihood request: the prompt echoed with its tokens' logprobs
    # (vLLM's prompt_logprobs too). In P/D the prompt is not computed where the answer is made:
    # refused by name.
    def loglikelihood():
        return client.completions.create(
            model=model, prompt="The capital of France is Paris", max_tokens=1, temperature=0,
            echo=True, logprobs=1, extra_body={"prompt_logprobs": 1, "return_token_ids": True})
    if os.environ.get("TANDEM_CHECK_PD") == "1":
        expect_error(openai.BadRequestError, loglikelihood, param="prompt_logprobs")
    else:
        c = loglikelihood()
        choice = c.choices[0]
        lp = choice.logprobs
        ids = (c.model_extra or {}).get("prompt_token_ids")
        plp = (choice.model_extra or {}).get("prompt_logprobs")
        check(choice.text.startswith("The capital of France is Paris"), choice.text)
        check(isinstance(ids, list) and len(lp.tokens) == len(ids) + 1, (ids, lp.tokens))
        check(lp.token_logprobs[0] is None and lp.top_logprobs[0] is None, lp)
        check(plp[0] is None and len(plp) == len(ids), plp)
        for i in range(1, len(ids)):
            own = plp[i][str(ids[i])]
            check(abs(own["logprob"] - lp.token_logprobs[i]) < 1e-5 and own["rank"] >= 1, (i, own))
            check(own["logprob"] <= 0, own)

    # errors, by exception type, naming the field
    expect_error(openai.NotFoundError, lambda: client.completions.create(
        model="no-such-model", prompt="hi", max_tokens=2), param="model")
    expect_error(openai.BadRequestError, lambda: client.completions.create(
        model=model, prompt="hi", max_tokens=2, temperature=-1), param="temperature")
    expect_error(openai.BadRequestError, lambda: client.chat.completions.create(
        model=model, messages=messages, max_tokens=2, response_format={"type": "yaml"}),
        param="response_format")
    expect_error(openai.BadRequestError, lambda: client.completions.create(
        model=model, prompt="hi", max_tokens=2, logit_bias={"99999999": 5}), param="logit_bias")
    expect_error(openai.BadRequestError, lambda: client.completions.create(
        model=model, prompt="hi", max_tokens=2, extra_body={"min_tokens": "two"}),
        param="min_tokens")
    expect_error(openai.BadRequestError, lambda: client.completions.create(
        model=model, prompt="hi " * 20000, max_tokens=2))
    print("openai client checks passed against", base)


if __name__ == "__main__":
    main()
