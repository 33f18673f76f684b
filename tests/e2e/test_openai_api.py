"""The OpenAI API end to end: the official client against the whole stack on the tiny Llama.

Each test ends with the idle invariant (the ``stack`` fixture): every KV block free, no pending
entries in any consumer group, no request state in the engine, the detokenizer or the gateway.
"""

from __future__ import annotations

import pytest

from shared.protocol import SamplingParams

PROMPTS = ["Hello, my name is", "The capital of France is", "Once upon a time"]


def reference(engine, prompts, **params):
    """Greedy text from the in-process LLMEngine: what the stack must reproduce."""
    results = engine.generate(prompts, SamplingParams(temperature=0.0, **params))
    return [r.outputs[0] for r in results]


def stream_text(stream) -> tuple[dict[int, str], dict[int, str], list]:
    """(text per choice index, finish_reason per index, all chunks) of a completions/chat stream."""
    texts, finish, chunks = {}, {}, []
    for chunk in stream:
        chunks.append(chunk)
        for choice in chunk.choices:
            piece = choice.text if hasattr(choice, "text") else (choice.delta.content or "")
            texts[choice.index] = texts.get(choice.index, "") + piece
            if choice.finish_reason is not None:
                finish[choice.index] = choice.finish_reason
    return texts, finish, chunks


# --------------------------------------------------------------------------- completions


def test_greedy_completions_equal_the_in_process_engine(client, tiny_engine):
    expected = reference(tiny_engine, PROMPTS, max_tokens=12)
    resp = client.completions.create(model="tiny", prompt=PROMPTS, max_tokens=12, temperature=0)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert [c.text for c in resp.choices] == [e.text for e in expected]
    assert [c.finish_reason for c in resp.choices] == [e.finish_reason for e in expected]
    prompt_lens = [len(tiny_engine.tokenizer.encode(p)) for p in PROMPTS]
    assert resp.usage.prompt_tokens == sum(prompt_lens)
    assert resp.usage.completion_tokens == sum(len(e.token_ids) for e in expected)
    assert resp.object == "text_completion" and resp.model == "tiny" and resp.id.startswith("cmpl-")


def test_streamed_completion_equals_the_unary_one(client, tiny_engine):
    expected = reference(tiny_engine, PROMPTS[:1], max_tokens=16, ignore_eos=True)[0]
    texts, finish, chunks = stream_text(client.completions.create(
        model="tiny", prompt=PROMPTS[0], max_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert texts == {0: expected.text} and finish == {0: "length"}
    assert len(chunks) > 2  # really streamed, not one blob
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert all(c.usage is None for c in chunks[:-1])


def test_usage_reports_the_prompt_tokens_served_from_the_prefix_cache(client):
    prompt = [(i * 37) % 900 + 5 for i in range(100)]  # token ids no other test sends
    first = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    again = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details is None  # nothing cached yet
    # every full 16-token block of the prompt but the last token's: (100 - 1) // 16 * 16
    assert again.usage.prompt_tokens_details.cached_tokens == 96


def test_token_id_prompts_and_echo(client, tiny_engine):
    ids = tiny_engine.tokenizer.encode(PROMPTS[1])
    expected = reference(tiny_engine, [ids], max_tokens=8)[0]
    expected_text = tiny_engine.tokenizer.decode(expected.token_ids, skip_special_tokens=True)
    resp = client.completions.create(model="tiny", prompt=[ids, ids], max_tokens=8, temperature=0, echo=True)
    prompt_text = tiny_engine.tokenizer.decode(ids)
    assert [c.text for c in resp.choices] == [prompt_text + expected_text] * 2
    resp = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=8, temperature=0, echo=True)
    assert resp.choices[0].text == PROMPTS[1] + expected_text
    texts, _, _ = stream_text(client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=8,
                                                        temperature=0, echo=True, stream=True))
    assert texts[0] == PROMPTS[1] + expected_text


def test_completion_logprobs_match_the_engine(client, tiny_engine):
    expected = reference(tiny_engine, PROMPTS[:1], max_tokens=6, ignore_eos=True, logprobs=2)[0]
    resp = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=2,
                                     extra_body={"ignore_eos": True})
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert lp.token_logprobs == pytest.approx([x.logprob for x in expected.logprobs], abs=1e-4)
    assert all(2 <= len(top) <= 3 for top in lp.top_logprobs)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_two_tokens(client, tiny_engine, include):
    full = reference(tiny_engine, PROMPTS[:1], max_tokens=24, ignore_eos=True)[0]
    tok = tiny_engine.tokenizer
    # a boundary between two tokens with at least two characters on each side
    bounds = [len(tok.decode(full.token_ids[:k])) for k in range(1, len(full.token_ids))]
    text = full.text
    cut = next(b for b in bounds if b >= 4 and len(text) - b >= 2 and text[b - 2:b].strip() and text[b:b + 2].strip())
    stop = text[cut - 2:cut + 2]
    expected = text[:text.index(stop) + (len(stop) if include else 0)]
    for stream in (False, True):
        resp = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=24, temperature=0,
                                         stop=[stop], stream=stream,
                                         extra_body={"ignore_eos": True, "include_stop_str_in_output": include})
        if stream:
            texts, finish, _ = stream_text(resp)
            assert (texts[0], finish[0]) == (expected, "stop")
        else:
            assert (resp.choices[0].text, resp.choices[0].finish_reason) == (expected, "stop")


def test_stop_string_with_a_multibyte_character(client, tiny_engine):
    # the tiny model's greedy text for some prompt holds a non-ASCII character: stop on it
    candidates = [f"Prompt number {i}: tell me" for i in range(24)]
    outs = reference(tiny_engine, candidates, max_tokens=24, ignore_eos=True)
    prompt, text, at = next((p, o.text, i) for p, o in zip(candidates, outs) for i, c in enumerate(o.text)
                            if i >= 1 and ord(c) > 127 and c != "\ufffd")
    stop = text[at - 1:at + 1]  # the character before it too, so the stop string is not one token
    assert len(stop.encode()) >= 3
    for stream in (False, True):
        resp = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0, stop=stop,
                                         stream=stream, extra_body={"ignore_eos": True})
        got = stream_text(resp)[0][0] if stream else resp.choices[0].text
        assert got == text[:text.index(stop)]


def test_n3_with_seed_is_reproducible(client):
    def run(seed):
        resp = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=10, n=3, temperature=1.0,
                                         seed=seed, extra_body={"ignore_eos": True})
        assert [c.index for c in resp.choices] == [0, 1, 2]
        assert resp.usage.completion_tokens == 30
        return [c.text for c in resp.choices]

    first = run(1234)
    assert run(1234) == first
    assert len(set(first)) > 1  # three samples, not three copies
    assert run(4321) != first


def test_streamed_n3_chunks_carry_their_index(client):
    texts, finish, chunks = stream_text(client.completions.create(
        model="tiny", prompt=PROMPTS[0], max_tokens=5, n=3, temperature=1.0, seed=7, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert set(texts) == {0, 1, 2} and finish == {0: "length", 1: "length", 2: "length"}
    assert chunks[-1].usage.completion_tokens == 15
    unary = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=5, n=3, temperature=1.0, seed=7,
                                      extra_body={"ignore_eos": True})
    assert [texts[i] for i in range(3)] == [c.text for c in unary.choices]


# --------------------------------------------------------------------------- chat


def chat_ids(engine, content: str) -> list[int]:
    text = engine.tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                add_generation_prompt=True)
    return engine.tokenizer.encode(text, add_special_tokens=False)


def test_chat_equals_the_engine_on_the_templated_prompt(client, tiny_engine):
    ids = chat_ids(tiny_engine, "Say something.")
    expected = reference(tiny_engine, [ids], max_tokens=10)[0]
    expected_text = tiny_engine.tokenizer.decode(expected.token_ids, skip_special_tokens=True)
    resp = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Say something."}],
                                          max_tokens=10, temperature=0)
    assert resp.object == "chat.completion" and resp.id.startswith("chatcmpl-")
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == expected_text
    assert resp.usage.prompt_tokens == len(ids) and resp.usage.completion_tokens == len(expected.token_ids)

    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Say something."}],
                                            max_completion_tokens=10, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    texts, finish, chunks = stream_text(stream)
    assert texts[0] == expected_text and finish[0] == resp.choices[0].finish_reason
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.total_tokens == resp.usage.total_tokens


def test_chat_logprobs_and_n3(client):
    resp = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                          n=3, temperature=0.8, seed=3, logprobs=True, top_logprobs=2,
                                          extra_body={"ignore_eos": True})
    assert [c.index for c in resp.choices] == [0, 1, 2]
    for choice in resp.choices:
        content = choice.logprobs.content
        assert len(content) == 4
        assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 and t.bytes for t in content)
        raw = b"".join(bytes(t.bytes) for t in content)
        assert raw.decode("utf-8", "replace") == choice.message.content


# --------------------------------------------------------------------------- the other routes


def test_models_health_version_metrics(stack, client):
    import httpx

    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(stack.base_url + "/health").status_code == 200
    assert httpx.get(stack.base_url + "/version").json()["version"]
    client.completions.create(model="tiny", prompt="x", max_tokens=2)
    metrics = httpx.get(stack.base_url + "/metrics").text + httpx.get(stack.engine_metrics_url).text
    for name in ("pagedserve:num_requests_running", "pagedserve:kv_cache_usage_perc",
                 "pagedserve:time_to_first_token_seconds_bucket", "pagedserve:generation_tokens_total"):
        assert name in metrics


def test_tokenize_and_detokenize(stack, tiny_engine):
    import httpx

    http = httpx.Client(timeout=60)  # the gateway may still be loading its tokenizer
    resp = http.post(stack.base_url + "/tokenize", json={"model": "tiny", "prompt": PROMPTS[0]}).json()
    assert resp["tokens"] == tiny_engine.tokenizer.encode(PROMPTS[0]) and resp["count"] == len(resp["tokens"])
    back = http.post(stack.base_url + "/detokenize", json={"model": "tiny", "tokens": resp["tokens"]}).json()
    assert back == {"prompt": PROMPTS[0]}
    chat = http.post(stack.base_url + "/tokenize",
                      json={"model": "tiny", "messages": [{"role": "user", "content": "Say something."}]}).json()
    assert chat["tokens"] == chat_ids(tiny_engine, "Say something.")
    bad = http.post(stack.base_url + "/detokenize", json={"model": "tiny", "tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_beam_search_equals_the_in_process_engine(client, tiny_engine):
    params = SamplingParams(n=3, use_beam_search=True, temperature=0.0, max_tokens=8, length_penalty=0.5)
    expected = tiny_engine.generate([PROMPTS[1]], params)[0].outputs
    resp = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=8, n=3, temperature=0,
                                     extra_body={"use_beam_search": True, "length_penalty": 0.5})
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert [c.text for c in resp.choices] == [e.text for e in expected]
    assert len({c.text for c in resp.choices}) == 3  # three distinct beams, best first
    assert resp.usage.completion_tokens == sum(len(e.token_ids) for e in expected)
