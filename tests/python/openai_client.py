#!/usr/bin/env python3
"""Calls a running `nextstate serve` with the official `openai` Python client, streaming and not.

Usage:
    python3 tests/python/openai_client.py --base-url http://127.0.0.1:30000/v1 [--api-key KEY]
    python3 tests/python/openai_client.py --start --model models/smollm2-135m-instruct

With --start the script launches `$CARGO_TARGET_DIR/debug/nextstate serve` (default target/) on a free
loopback port itself, waits for /health, runs the checks and stops the server. Needs `pip install openai`
(a test dependency: `python3 -m venv .cache/venv-openai && .cache/venv-openai/bin/pip install openai`,
then run it with `.cache/venv-openai/bin/python`). tests/proxy.rs also runs it through the capture proxy
(`--base-url` of the proxy; its /health answers like the server's).
Exits non-zero on the first failed check; prints "N passed, 0 failed" at the end.
"""

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

from checks import check
from openai import OpenAI

QUESTION = [{"role": "user", "content": "What is the capital of Germany?"}]
ANSWER = "The capital of Germany is Berlin."


def test_non_stream(client):
    raw = client.chat.completions.with_raw_response.create(
        model="policy", messages=QUESTION, temperature=0, max_tokens=24, logprobs=True, top_logprobs=2
    )
    check(raw.headers.get("x-policy-version") is not None, "X-Policy-Version header")
    r = raw.parse()
    choice = r.choices[0]
    check(choice.message.content == ANSWER, f"answer {choice.message.content!r}")
    check(choice.finish_reason == "stop", f"finish_reason {choice.finish_reason}")
    entries = choice.logprobs.content
    check(len(entries) >= 8, "one log-prob entry per token")
    check(all(e.logprob <= 0 for e in entries), "log-probs are <= 0")
    check(len(entries[0].top_logprobs) == 2, "two alternatives per token")
    extra = r.model_extra or {}
    check(isinstance(extra.get("policy_version"), int), "policy_version extension field")
    token_ids = (choice.model_extra or {}).get("token_ids")
    check(token_ids is not None and len(token_ids) == len(entries), "token_ids aligned with log-probs")
    check(r.usage.completion_tokens == len(token_ids), "usage.completion_tokens")


def test_stream(client):
    stream = client.chat.completions.create(
        model="policy", messages=QUESTION, temperature=0, max_tokens=24, stream=True, logprobs=True,
        stream_options={"include_usage": True},
    )
    text, n_tokens, finish, usage = "", 0, None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if not chunk.choices:
            continue
        c = chunk.choices[0]
        if c.delta and c.delta.content:
            text += c.delta.content
        if c.logprobs and c.logprobs.content:
            n_tokens += len(c.logprobs.content)
        if c.finish_reason:
            finish = c.finish_reason
    check(text == ANSWER, f"streamed text {text!r}")
    check(finish == "stop", f"finish_reason {finish}")
    check(usage is not None and usage.completion_tokens == n_tokens, "usage chunk counts the streamed tokens")


def test_models(client):
    ids = [m.id for m in client.models.list().data]
    check(len(ids) == 1, f"one model listed, got {ids}")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_health(url, timeout_s=60):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                return json.load(r)
        except OSError:
            time.sleep(0.3)
    raise TimeoutError(f"{url} not healthy after {timeout_s} s")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", default=os.environ.get("NEXTSTATE_BASE_URL", "http://127.0.0.1:30000/v1"))
    ap.add_argument("--api-key", default=os.environ.get("NEXTSTATE_API_KEY", "none"))
    ap.add_argument("--start", action="store_true", help="start target/debug/nextstate serve on a free port")
    ap.add_argument("--model", default="models/smollm2-135m-instruct")
    ap.add_argument("--binary", default=os.path.join(os.environ.get("CARGO_TARGET_DIR", "target"), "debug", "nextstate"))
    args = ap.parse_args()
    proc = None
    if args.start:
        port = free_port()
        env = dict(os.environ, NEXTSTATE_API_KEY=args.api_key, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        proc = subprocess.Popen([args.binary, "serve", "--model", args.model, "--port", str(port), "--threads", "1"], env=env)
        args.base_url = f"http://127.0.0.1:{port}/v1"
    try:
        wait_health(args.base_url.rsplit("/v1", 1)[0] + "/health")
        client = OpenAI(base_url=args.base_url, api_key=args.api_key)
        passed = 0
        for t in (test_models, test_non_stream, test_stream):
            t(client)
            print(f"ok {t.__name__}")
            passed += 1
        print(f"{passed} passed, 0 failed")
    except Exception as e:  # report as the plain closing line too
        print(f"FAILED: {e!r}", file=sys.stderr)
        print("0 passed, 1 failed")
        sys.exit(1)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)


if __name__ == "__main__":
    main()
