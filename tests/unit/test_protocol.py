"""The bus codec: every message round-trips, defaults stay off the wire, and decoding refuses
anything that does not match the annotations, naming the field."""

from __future__ import annotations

import msgpack
import pytest

from shared.protocol import (MAX_MESSAGE_BYTES, Abort, Admission, ChatMessage, DetokParams, EngineRequest, ErrorInfo,
                             GenerateRequest, Heartbeat, ProtocolError, RequestOutput, SamplingParams, TextLogprobs,
                             TokenDelta, TokenLogprobs, Usage, decode)

FULL = [
    GenerateRequest(request_id="r1", reply_to="ps:gateway:g:out", prompt="hi", prompt_token_ids=(1, 2),
                    messages=(ChatMessage(role="user", content="é", name="x"),), add_generation_prompt=False,
                    sampling=SamplingParams(n=2, temperature=0.5, top_k=3, seed=-7, stop=("a", "b"),
                                            logit_bias={5: -1.5}, use_beam_search=True),
                    echo=True, cache_salt="s", arrival_time=1.5),
    EngineRequest(request_id="r2", reply_to="ps:gateway:g:out", prompt_token_ids=tuple(range(300)),
                  detok=DetokParams(stop=("\n",), logprobs=True)),
    Abort(request_ids=("a", "b"), reason="stop"),
    TokenDelta(request_id="r3", seq=4, index=1, new_token_ids=(9, 10),
               logprobs=(TokenLogprobs(token_id=9, logprob=-0.25, rank=1, top_ids=(9, 3), top_logprobs=(-0.25, -2.0)),),
               cumulative_logprob=-0.25, finish_reason=2, stop_reason=7, num_prompt_tokens=12,
               num_cached_tokens=8, num_choices=2, error=ErrorInfo(message="m", param="p", code=503)),
    Admission(request_id="r5", num_choices=3, engine_id="e", reply_to="ps:gateway:g:out",
              detok=DetokParams(stop=("x",), skip_special_tokens=False)),
    RequestOutput(request_id="r4", seq=1, text_delta="ü", token_ids=(1,), finish_reason=1, stop_reason="END",
                  logprobs=(TextLogprobs(token="a", token_id=1, logprob=-1.0, bytes=(97,), top_tokens=("a",),
                                         top_logprobs=(-1.0,)),),
                  usage=Usage(prompt_tokens=3, completion_tokens=1), prompt_text="p", prompt_token_ids=(5,)),
    Heartbeat(service="engine", service_id="e0", time=12.5, stats={"num_running": 3.0}),
]


@pytest.mark.parametrize("msg", FULL, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(msg):
    assert decode(msg.to_wire()) == msg


def test_fields_holding_their_default_stay_off_the_wire():
    body = msgpack.unpackb(TokenDelta(request_id="r", seq=3, new_token_ids=(5,)).to_wire())
    assert body == {"t": 4, "request_id": "r", "seq": 3, "new_token_ids": [5]}
    decoded = decode(TokenDelta(request_id="r", seq=3).to_wire())
    assert decoded.error is None and decoded.new_token_ids == () and decoded.num_choices == 1


def _wire(tag: int, **fields) -> bytes:
    return msgpack.packb({"t": tag, **fields}, use_bin_type=True)


@pytest.mark.parametrize("data, words", [
    (_wire(4, request_id="r", seq="1"), "TokenDelta.seq: expected an integer"),
    (_wire(4, request_id="r", seq=True), "TokenDelta.seq: expected an integer"),
    (_wire(4, request_id="r", seq=1, new_token_ids=[1, "2"]), "TokenDelta.new_token_ids: expected integers"),
    (_wire(4, request_id="r", seq=1, new_token_ids=5), "TokenDelta.new_token_ids: expected an array"),
    (_wire(4, request_id="r", seq=1, logprobs=[{"token_id": 1, "logprob": "x", "rank": 1}]),
     "TokenDelta.logprobs[].logprob: expected a number"),
    (_wire(7, request_id="r", detok={"stop": ["a", 3]}), "Admission.detok.stop: expected strings"),
    (_wire(4, request_id="r", seq=1, bogus=1), "unknown fields ['bogus']"),
    (_wire(4, request_id="r"), "TokenDelta: "),  # seq is required
    (_wire(5, request_id="r", stop_reason=1.5), "no type matches"),
    (_wire(1, request_id="r", reply_to="x", sampling={"logit_bias": {"5": 1.0}}),
     "GenerateRequest.sampling.logit_bias key: expected an integer"),
    (_wire(6, service="s", service_id="i", time=1, stats=[]), "Heartbeat.stats: expected a map"),
    (_wire(99, x=1), "unknown message type 99"),
    (msgpack.packb({"t": True, "request_id": "r", "reply_to": "x"}), "unknown message type True"),  # True == 1
    (msgpack.packb({"t": {"a": 1}}), "unknown message type"),  # unhashable: no TypeError escapes
    (msgpack.packb([1, 2]), "not a map"),
    (b"\xc1", "undecodable"),
    ("text", "not bytes"),
])
def test_decoding_refuses_what_the_annotations_do_not_allow(data, words):
    with pytest.raises(ProtocolError) as info:
        decode(data)
    assert words in info.value.message


def test_decoding_bounds_sizes():
    with pytest.raises(ProtocolError, match="exceeds"):
        decode(b"\x80" * (MAX_MESSAGE_BYTES + 1))
    huge_array = b"\x81\xa1t\x04" + b"\xdd" + (1 << 31).to_bytes(4, "big")  # claims 2**31 items
    with pytest.raises(ProtocolError):
        decode(huge_array)


def test_ints_widen_to_float_but_floats_never_narrow_to_int():
    msg = decode(_wire(6, service="s", service_id="i", time=3, stats={"x": 2}))
    assert msg.time == 3.0 and type(msg.time) is float and type(msg.stats["x"]) is float
    with pytest.raises(ProtocolError, match="expected an integer"):
        decode(_wire(4, request_id="r", seq=1.0))


def test_a_message_refused_for_its_size_still_gets_its_error_reply():
    """A GenerateRequest over the decoder's limits (1.1 M prompt token ids) is refused, but its
    envelope is read back (bounded by the entry's own length) so the gateway is answered with a
    400 instead of waiting for the deadline."""
    import msgpack

    from shared.dead_letters import salvage_reply
    from shared.protocol import MAX_PROMPT_TOKENS, decode

    wire = msgpack.packb({"t": GenerateRequest.TAG, "request_id": "cmpl-1", "reply_to": "ps:gateway:g0:out",
                          "prompt_token_ids": [7] * (MAX_PROMPT_TOKENS + 100_000)}, use_bin_type=True)
    with pytest.raises(ProtocolError):
        decode(wire)
    reply_to, out = salvage_reply(wire, "too many prompt token ids")
    assert reply_to == "ps:gateway:g0:out" and out.request_id == "cmpl-1"
    assert out.error.code == 400 and "too many prompt token ids" in out.error.message
    assert salvage_reply(b"\xc1" + wire[1:], "garbage") is None  # undecodable: nobody to tell
