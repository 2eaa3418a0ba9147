"""Signed records ([Note: digest and signature] in qwz/qualify/evidence/signing.py): a resealed
record passes the digest but not ``compare --require-signature``; unsigned records say so."""

from __future__ import annotations

import json
import pathlib

import pytest

from qwz.qualify import cli
from qwz.qualify.evidence import record, schema, seal, signing
from tests.unit.records import make_record

KEY_HEX = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff"
OTHER_HEX = "ff" * 32


@pytest.fixture
def no_key(monkeypatch):
    monkeypatch.delenv(signing.KEY_ENV, raising=False)
    monkeypatch.delenv(signing.KEY_FILE_ENV, raising=False)


def use_key(monkeypatch, text: str = KEY_HEX) -> signing.SigningKey:
    monkeypatch.setenv(signing.KEY_ENV, text)
    monkeypatch.delenv(signing.KEY_FILE_ENV, raising=False)
    return signing.configured_key()


def signed(path: pathlib.Path, key_hex: str = KEY_HEX, **overrides) -> pathlib.Path:
    record.save(make_record(**overrides), path, key=signing.parse_key(key_hex, "test"))
    return path


def resealed(path: pathlib.Path, edit) -> None:
    """Edit the record body and recompute its digest: what someone without the key can do."""
    payload = json.loads(path.read_text())
    edit(payload)
    body = {key: value for key, value in payload.items() if key != "signature"}
    payload["digest"] = seal.canonical_digest(body)
    path.write_text(json.dumps(payload, indent=2))


def faster(payload) -> None:
    """Doctor the raw step times (the candidate twice as fast) and derive the summary again,
    so the record is consistent: only a signature can tell it from a real one."""
    from qwz.qualify.evidence.rules.speed import summarize_blocks

    performance = payload["performance"][0]
    for block in performance["blocks"]:
        block["candidate_times_s"] = [time / 2 for time in block["candidate_times_s"]]
    performance.update(summarize_blocks(performance["blocks"]))


# --------------------------------------------------------------------------- #
# Keys
# --------------------------------------------------------------------------- #


def test_key_id_is_the_sha256_prefix_of_the_key_bytes(no_key, monkeypatch):
    import hashlib

    key = use_key(monkeypatch)
    assert key.key_id == hashlib.sha256(bytes.fromhex(KEY_HEX)).hexdigest()[:16]
    assert KEY_HEX not in repr(key)
    text_key = use_key(monkeypatch, "a passphrase of some length")
    assert text_key.secret == b"a passphrase of some length"


def test_key_from_a_file(no_key, monkeypatch, tmp_path):
    path = tmp_path / "key"
    path.write_text(KEY_HEX + "\n")
    monkeypatch.setenv(signing.KEY_FILE_ENV, str(path))
    assert signing.configured_key().secret == bytes.fromhex(KEY_HEX)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({signing.KEY_ENV: "abcd"}, "QWZ_RECORD_KEY: a key of 2 bytes is too short"),
        ({signing.KEY_ENV: "short"}, "a key of 5 bytes is too short"),
        ({signing.KEY_ENV: KEY_HEX, signing.KEY_FILE_ENV: "/x"}, "both set"),
        ({signing.KEY_FILE_ENV: "/nonexistent/key"}, "QWZ_RECORD_KEY_FILE: /nonexistent/key"),
        ({signing.KEY_FILE_ENV: "/dev/zero"}, "not a regular file"),
    ],
)
def test_unusable_keys_are_named(env, message):
    with pytest.raises(signing.SigningKeyError, match=message):
        signing.configured_key(env)


def test_no_key_and_empty_variables_mean_unsigned():
    assert signing.configured_key({}) is None
    assert signing.configured_key({signing.KEY_ENV: "", signing.KEY_FILE_ENV: ""}) is None


# --------------------------------------------------------------------------- #
# Records
# --------------------------------------------------------------------------- #


def test_a_signed_record_round_trips_and_verifies(no_key, monkeypatch, tmp_path):
    path = signed(tmp_path / "record.json")
    stored = json.loads(path.read_text())["signature"]
    key = use_key(monkeypatch)
    assert stored["key_id"] == key.key_id and len(stored["hmac_sha256"]) == 64
    loaded = record.load(path)
    assert loaded.signature == signing.Signature.model_validate(stored)
    assert "verified with the configured key" in signing.describe(
        loaded.digest, loaded.signature, key
    )
    # The signature is outside the digest: the same body unsigned has the same digest.
    assert loaded.digest == make_record().digest


def test_a_resealed_signed_record_is_refused_by_load_with_the_key(no_key, monkeypatch, tmp_path):
    path = signed(tmp_path / "record.json")
    resealed(path, faster)
    record.load(path)  # without the key, only the digest can be checked: it matches
    use_key(monkeypatch)
    with pytest.raises(schema.RecordError, match="does not verify: the record was changed"):
        record.load(path)


def test_a_malformed_signature_is_a_schema_error(no_key, tmp_path):
    path = signed(tmp_path / "record.json")
    payload = json.loads(path.read_text())
    payload["signature"]["hmac_sha256"] = "not hex"
    path.write_text(json.dumps(payload))
    with pytest.raises(schema.RecordError, match=r"signature\.hmac_sha256"):
        record.load(path)


def _compare(*argv: str) -> int:
    return cli.main(["compare", *argv])


def test_require_signature_accepts_two_records_signed_by_the_key(no_key, monkeypatch, tmp_path):
    baseline, candidate = signed(tmp_path / "a.json"), signed(tmp_path / "b.json")
    use_key(monkeypatch)
    assert _compare(str(baseline), str(candidate), "--require-signature") == 0


def test_require_signature_refuses_a_resealed_record(no_key, monkeypatch, tmp_path, capsys):
    """The issue's attack: speed-up edited to 9.9 [9.0, 10.0] and the digest recomputed."""
    baseline, candidate = signed(tmp_path / "a.json"), signed(tmp_path / "b.json")
    resealed(candidate, faster)
    assert _compare(str(baseline), str(candidate)) == 0  # the digest alone is fooled
    use_key(monkeypatch)
    capsys.readouterr()
    assert _compare(str(baseline), str(candidate), "--require-signature") == 2
    assert "does not verify" in capsys.readouterr().err


def test_require_signature_refuses_a_record_whose_signature_was_dropped(
    no_key, monkeypatch, tmp_path, capsys
):
    baseline, candidate = signed(tmp_path / "a.json"), signed(tmp_path / "b.json")
    resealed(candidate, lambda payload: (faster(payload), payload.pop("signature")))
    use_key(monkeypatch)
    assert _compare(str(baseline), str(candidate), "--require-signature") == 2
    err = capsys.readouterr().err
    assert err.startswith("qwz-qualify compare: error: ")
    assert f"candidate record {candidate}: a verified signature is required; it is unsigned" in err


def test_require_signature_refuses_another_key(no_key, monkeypatch, tmp_path, capsys):
    baseline = signed(tmp_path / "a.json")
    candidate = signed(tmp_path / "b.json", key_hex=OTHER_HEX)
    key = use_key(monkeypatch)
    assert _compare(str(baseline), str(candidate), "--require-signature") == 2
    assert f"the configured key is {key.key_id}" in capsys.readouterr().err


def test_require_signature_without_a_key_refuses(no_key, tmp_path, capsys):
    baseline, candidate = signed(tmp_path / "a.json"), signed(tmp_path / "b.json")
    assert _compare(str(baseline), str(candidate), "--require-signature") == 2
    assert "no key configured" in capsys.readouterr().err


def test_report_and_compare_label_unsigned_records(no_key, tmp_path, capsys):
    path = tmp_path / "record.json"
    record.save(make_record(), path)
    assert "signature" not in json.loads(path.read_text())
    assert cli.main(["report", str(path)]) == 0
    assert "## Signature\n\nunsigned: anyone could have written" in capsys.readouterr().out
    assert _compare(str(path), str(path)) == 0
    out = capsys.readouterr().out
    assert "baseline signature: unsigned" in out and "candidate signature: unsigned" in out


def test_report_shows_the_key_id(no_key, monkeypatch, tmp_path, capsys):
    path = signed(tmp_path / "record.json")
    key = signing.parse_key(KEY_HEX, "test")
    assert cli.main(["report", str(path)]) == 0
    assert f"signed (HMAC-SHA256) by key id {key.key_id}; not verified: no key" in (
        capsys.readouterr().out
    )
    use_key(monkeypatch)
    assert cli.main(["report", str(path)]) == 0
    assert "verified with the configured key" in capsys.readouterr().out


def test_an_unusable_key_is_exit_2_for_report_and_compare(no_key, monkeypatch, tmp_path, capsys):
    path = signed(tmp_path / "record.json")
    monkeypatch.setenv(signing.KEY_ENV, "short")
    assert cli.main(["report", str(path)]) == 2
    assert _compare(str(path), str(path)) == 2
    assert "too short" in capsys.readouterr().err
