"""The bus's MAC (shared/bus_auth.py, format in shared/entries.py): signing, and each way a
forged or damaged entry is refused. No Redis here."""

from __future__ import annotations

import hashlib
import hmac

import pytest

from shared import entries
from shared.bus_auth import (BusSigner, ForgedEntry, RefusalLog, check_secret, refusal_record, secure_serve,
                             split_credentials, url_with_credentials)
from shared.config import ServeConfig
from shared.protocol import RequestOutput
from shared.redis_server import RedisAcl

SECRET = "k" * 16 + "-unit-test"
STREAM = "ps:gateway:g0:out"


def _fields(*texts: str) -> dict:
    items = [(STREAM, RequestOutput(request_id="r1", seq=i, text_delta=t)) for i, t in enumerate(texts)]
    [(stream, fields)] = entries.pack(items, batch=True)
    return fields


def test_a_signed_entry_verifies_and_its_messages_read_back():
    signer = BusSigner(SECRET)
    fields = _fields("Hello", " world")
    signed = signer.sign(STREAM, fields)
    assert set(signed) == {b"m", b"m1", b"s"} and len(signed[b"s"]) == 32
    assert signer.verify(STREAM, signed) == fields
    assert entries.payloads(signed) == [fields[b"m"], fields[b"m1"]]  # a reader with no key skips the MAC


def test_the_mac_is_hmac_sha256_of_the_documented_bytes():
    fields = {b"m": b"abc", b"m1": b"de"}
    expected_input = b"".join([(17).to_bytes(4, "big"), b"pagedserve-bus-v1", (len(STREAM)).to_bytes(4, "big"),
                               STREAM.encode(), (1).to_bytes(4, "big"), b"m", (3).to_bytes(4, "big"), b"abc",
                               (2).to_bytes(4, "big"), b"m1", (2).to_bytes(4, "big"), b"de"])
    assert entries.mac_input(STREAM, fields) == expected_input
    assert BusSigner(SECRET).mac(STREAM, fields) == hmac.new(SECRET.encode(), expected_input, hashlib.sha256).digest()


def _refused(signer: BusSigner, stream: str, fields: dict) -> str:
    with pytest.raises(ForgedEntry) as info:
        signer.verify(stream, fields)
    return info.value.message


def test_a_tampered_body_is_refused():
    signer = BusSigner(SECRET)
    signed = signer.sign(STREAM, _fields("Hello", " world"))
    flipped = bytearray(signed[b"m1"])
    flipped[-1] ^= 0x01
    assert _refused(signer, STREAM, {**signed, b"m1": bytes(flipped)}) == "entry MAC does not match"
    assert _refused(signer, STREAM, {b"m": signed[b"m"], b"s": signed[b"s"]}) == "entry MAC does not match"  # dropped
    swapped = {b"m": signed[b"m1"], b"m1": signed[b"m"], b"s": signed[b"s"]}  # reordered
    assert _refused(signer, STREAM, swapped) == "entry MAC does not match"
    assert _refused(signer, STREAM, {**signed, b"extra": b"x"}) == "entry MAC does not match"  # added


def test_a_wrong_key_a_wrong_stream_a_missing_or_truncated_mac_are_refused():
    signer = BusSigner(SECRET)
    signed = signer.sign(STREAM, _fields("Hello"))
    assert _refused(BusSigner("another-secret-of-16+"), STREAM, signed) == "entry MAC does not match"
    assert _refused(signer, "ps:gateway:g1:out", signed) == "entry MAC does not match"  # copied to another stream
    assert _refused(signer, STREAM, {b"m": signed[b"m"]}) == "entry has no MAC"
    assert _refused(signer, STREAM, {**signed, b"s": signed[b"s"][:16]}) == "entry MAC does not match"
    assert _refused(signer, STREAM, {**signed, b"s": b""}) == "entry MAC does not match"
    assert _refused(signer, STREAM, {}) == "entry has no fields"


def test_str_fields_sign_as_redis_stores_them():
    """Dead letters are XADDed with str values; Redis hands them back as bytes: same MAC."""
    signer = BusSigner(SECRET)
    record = refusal_record(STREAM, "1-0", {b"m": b"\x01"}, "entry has no MAC")
    signed = signer.sign("ps:dlq", record)
    as_read = {k: v.encode() if isinstance(v, str) else v for k, v in signed.items()}
    assert signer.verify("ps:dlq", as_read)[b"error"] == b"entry has no MAC"


def test_short_secrets_are_refused_and_the_key_never_shows():
    with pytest.raises(ValueError, match="--bus-secret"):
        check_secret("too-short")
    with pytest.raises(ValueError):
        BusSigner("x" * 15)
    assert BusSigner.of(None) is None and BusSigner.of("") is None
    assert SECRET not in repr(BusSigner(SECRET))
    assert SECRET not in repr(secure_serve(ServeConfig(), "redis://h:1/0", None)[0])


def test_refusals_are_counted_and_logged_once_in_a_while(caplog):
    refusals = RefusalLog(STREAM, every_s=3600)
    with caplog.at_level("WARNING", logger="shared.bus_auth"):
        for i in range(5):
            refusals.refused(f"{i}-0", "entry has no MAC")
    assert refusals.num_refused == 5
    assert len([r for r in caplog.records if "refused" in r.getMessage()]) == 1


def test_serve_gives_every_child_the_secret_and_its_role_user_and_keeps_credentials_off_the_url():
    acl = RedisAcl.generate("ps", role_password="p" * 20)
    config, url = secure_serve(ServeConfig(), "redis://127.0.0.1:6390/0", acl)
    secrets = {getattr(config, kind).bus.bus_secret for kind in ("gateway", "tokenizer", "engine", "detok")}
    assert len(secrets) == 1 and len(secrets.pop()) >= 32
    assert [getattr(config, k).bus.redis_username for k in ("gateway", "tokenizer", "engine", "detok")] == \
        ["gateway", "tokenizer", "engine", "detok"]
    assert url == "redis://127.0.0.1:6390/0"
    # an external Redis: the URL's credentials move to the typed fields (environment), off the URL
    config, url = secure_serve(ServeConfig(), "redis://app:s%3Acret@redis.internal:6379/0", None)
    assert url == "redis://redis.internal:6379/0"
    assert (config.engine.bus.redis_username, config.engine.bus.redis_password) == ("app", "s:cret")
    assert config.engine.bus.bus_secret != secure_serve(ServeConfig(), url, None)[0].engine.bus.bus_secret  # per run


def test_credentials_split_off_and_back_onto_a_url():
    assert split_credentials("rediss://u:p%40x@h:1/0") == ("rediss://h:1/0", "u", "p@x")
    assert split_credentials("redis://h:1/0") == ("redis://h:1/0", None, None)
    assert url_with_credentials("redis://h:1/0", "engine", "a/b") == "redis://engine:a%2Fb@h:1/0"
    assert url_with_credentials("redis://h:1/0", None, None) == "redis://h:1/0"


def test_acl_config_holds_hashes_not_passwords():
    acl = RedisAcl.generate("ps")
    text = "\n".join(acl.config_lines())
    assert len(set(acl.role_passwords.values())) == len(acl.role_passwords)  # one password per role
    for password in [acl.admin_password, *acl.role_passwords.values()]:
        assert password not in text and hashlib.sha256(password.encode()).hexdigest() in text
    assert "~ps:kv:*" in next(line for line in acl.config_lines() if line.startswith("user engine "))
    assert "~ps:kv:*" not in next(line for line in acl.config_lines() if line.startswith("user gateway "))

