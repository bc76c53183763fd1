#!/usr/bin/env python3
"""Calls a running `nextstate proxy` with the official `openai` (Responses API) and `anthropic`
(Messages API) Python clients, streamed and not, through a weather-tool conversation. Run by
tests/serve_proxy/proxy/apis.rs, which starts the fake upstream and the proxy, then checks the `interactions`
events this script causes:

    python3 tests/python/proxy_apis_client.py --base-url http://127.0.0.1:PORT --api-key KEY

Turns: session py-responses 0 (tool call), 1 (answer from the tool output, chained by
previous_response_id), 2 (streamed, chained); session py-claude 0 (tool use), 1 (streamed answer from
the tool result), 2 (a side turn); then, passed through and not captured, the stored response's
retrieve, input items and cancel, and a Messages count_tokens. Needs `pip install openai anthropic` (scripts/setup.sh puts both in
.cache/venv-openai). Prints "N passed, M failed" at the end; exits non-zero on a failure.
"""

import argparse
import json

import anthropic
from checks import check, run_checks
from openai import OpenAI

TOOLS = [{"type": "function", "name": "get_weather", "description": "weather of a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "weather of a city",
                    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]


class State:
    pass


def test_responses_tool_call_and_chain(oa, st):
    h = {"X-Session-Id": "py-responses"}
    r0 = oa.responses.create(model="gpt-x", input=[{"role": "user", "content": "Paris"}], tools=TOOLS, extra_headers=h)
    calls = [o for o in r0.output if o.type == "function_call"]
    check(len(calls) == 1, f"one function call in {r0.output!r}")
    check(json.loads(calls[0].arguments) == {"city": "Paris"}, f"arguments {calls[0].arguments!r}")
    r1 = oa.responses.create(model="gpt-x", previous_response_id=r0.id, tools=TOOLS, extra_headers=h,
                             input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "18C"}])
    check(r1.output_text == "It is 18C.", f"output_text {r1.output_text!r}")
    st.last_response = r1.id


def test_responses_stream(oa, st):
    stream = oa.responses.create(model="gpt-x", previous_response_id=st.last_response, input="thanks", stream=True,
                                 extra_headers={"X-Session-Id": "py-responses"})
    text, final = "", None
    for ev in stream:
        if ev.type == "response.output_text.delta":
            text += ev.delta
        elif ev.type == "response.completed":
            final = ev.response
    check(text == "echo: thanks", f"streamed text {text!r}")
    check(final is not None and final.output_text == "echo: thanks", "response.completed carries the response")


def test_messages_tool_use(ac, st):
    st.user0 = {"role": "user", "content": "Paris"}
    m0 = ac.messages.create(model="claude-x", max_tokens=256, tools=ANTHROPIC_TOOLS, messages=[st.user0],
                            extra_headers={"X-Session-Id": "py-claude"})
    check(m0.stop_reason == "tool_use", f"stop_reason {m0.stop_reason!r}")
    uses = [b for b in m0.content if b.type == "tool_use"]
    check(len(uses) == 1 and uses[0].input == {"city": "Paris"}, f"tool use {m0.content!r}")
    st.m0, st.tool_use = m0, uses[0]


def test_messages_stream_then_side_turn(ac, st):
    history = [st.user0, {"role": "assistant", "content": st.m0.content},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": st.tool_use.id, "content": "18C"}]}]
    with ac.messages.stream(model="claude-x", max_tokens=256, tools=ANTHROPIC_TOOLS, messages=history,
                            extra_headers={"X-Session-Id": "py-claude"}) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    check(text == "The result is 18C.", f"streamed text {text!r}")
    check(final.stop_reason == "end_turn", f"stop_reason {final.stop_reason!r}")
    history += [{"role": "assistant", "content": final.content}, {"role": "user", "content": "bye"}]
    m2 = ac.messages.create(model="claude-x", max_tokens=256, messages=history,
                            extra_headers={"X-Session-Id": "py-claude", "X-Turn-Type": "side"})
    check(m2.content[0].text == "echo: bye", f"side turn {m2.content!r}")


def test_responses_retrieve_input_items_cancel(oa, st):
    # Passed through by the proxy, not captured.
    r = oa.responses.retrieve(st.last_response)
    check(r.id == st.last_response and r.output_text == "It is 18C.", f"retrieved {r!r}")
    items = oa.responses.input_items.list(st.last_response)
    check(len(items.data) == 1 and items.data[0].type == "message", f"input items {items.data!r}")
    c = oa.responses.cancel(st.last_response)
    check(c.status == "cancelled", f"cancel status {c.status!r}")


def test_messages_count_tokens(ac, st):
    n = ac.messages.count_tokens(model="claude-x", messages=[st.user0])
    check(n.input_tokens == 10, f"input_tokens {n.input_tokens!r}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True, help="the proxy, without /v1")
    ap.add_argument("--api-key", default="none")
    a = ap.parse_args()
    oa = OpenAI(base_url=a.base_url + "/v1", api_key=a.api_key, max_retries=0, timeout=30, organization="org-py", project="proj-py")
    ac = anthropic.Anthropic(base_url=a.base_url, api_key=a.api_key, max_retries=0, timeout=30)
    st = State()
    # Order matters: each test continues the conversation of the one before.
    run_checks(((t, (c, st)) for t, c in [(test_responses_tool_call_and_chain, oa), (test_responses_stream, oa), (test_messages_tool_use, ac),
                                          (test_messages_stream_then_side_turn, ac), (test_responses_retrieve_input_items_cancel, oa),
                                          (test_messages_count_tokens, ac)]), describe=repr)


if __name__ == "__main__":
    main()
