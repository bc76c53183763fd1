#!/usr/bin/env python3
"""Calls a running `nextstate proxy` with the official `openai` Python client, streaming and not,
with session headers and body keys. Run by tests/proxy.rs (which starts a fake upstream and the
proxy, then checks the `interactions` events this script causes):

    python3 tests/python/proxy_client.py --base-url http://127.0.0.1:PORT/v1 [--api-key KEY]

Turns (all in session py-1): 0 main non-stream with log-probs; 1 side, streamed; 2 main, no log-probs,
session_done in the body. Needs `pip install openai` (e.g. `python3 -m venv .cache/venv-openai &&
.cache/venv-openai/bin/pip install openai`). Prints "N passed, M failed" at the end; exits non-zero on
a failure.
"""

import argparse

from checks import check, run_checks
from openai import OpenAI

SYSTEM = {"role": "system", "content": "sys"}


def test_non_stream_with_logprobs(client):
    raw = client.chat.completions.with_raw_response.create(
        model="fake", messages=[SYSTEM, {"role": "user", "content": "capital of Germany"}], logprobs=True,
        extra_headers={"X-Session-Id": "py-1"},
    )
    check(raw.headers.get("x-policy-version") == "3", "X-Policy-Version header passed through")
    r = raw.parse()
    c = r.choices[0]
    check(c.message.content == "echo: capital of Germany", f"content {c.message.content!r}")
    check(c.finish_reason == "stop", "finish_reason")
    check(len(c.logprobs.content) == 4, "one log-prob entry per token")
    check(c.logprobs.content[0].logprob == -0.25, "log-prob values unchanged")
    check((r.model_extra or {}).get("policy_version") == 3, "policy_version field passed through")


def test_stream_side_turn(client):
    stream = client.chat.completions.create(
        model="fake", messages=[SYSTEM, {"role": "user", "content": "stream this please"}], stream=True,
        extra_headers={"X-Session-Id": "py-1", "X-Turn-Type": "side"},
    )
    text, chunks, finish = "", 0, None
    for chunk in stream:
        chunks += 1
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        check(ch.logprobs is None, "no log-probs in chunks the client did not ask for")
        if ch.delta and ch.delta.content:
            text += ch.delta.content
        if ch.finish_reason:
            finish = ch.finish_reason
    check(text == "echo: stream this please", f"streamed text {text!r}")
    check(finish == "stop", "finish_reason")
    check(chunks >= 5, f"{chunks} chunks")


def test_non_stream_without_logprobs_done(client):
    r = client.chat.completions.create(
        model="fake", messages=[SYSTEM, {"role": "user", "content": "bye"}],
        extra_headers={"X-Session-Id": "py-1"}, extra_body={"session_done": True},
    )
    check(r.choices[0].message.content == "echo: bye", "content")
    check(r.choices[0].logprobs is None, "log-probs removed for a client that did not ask")


def test_models(client):
    ids = [m.id for m in client.models.list().data]
    check(ids == ["fake-model"], f"models {ids}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--api-key", default="none")
    a = ap.parse_args()
    client = OpenAI(base_url=a.base_url, api_key=a.api_key, max_retries=0, timeout=30)
    # Order matters: the turns of session py-1 get indices 0, 1, 2.
    run_checks((t, (client,)) for t in [test_non_stream_with_logprobs, test_stream_side_turn, test_non_stream_without_logprobs_done, test_models])


if __name__ == "__main__":
    main()
