"""API keys → tenant (`app/auth.py`) on requests built in memory: which requests an ingress admits and whose KV
each one's turn is. No Ray, no engines."""

from __future__ import annotations

from starlette.requests import Request

from app.auth import API_KEYS_FILE_ENV, ApiKeys, hashed, load_api_keys


def request(path: str = "/v1/chat/completions", authorization: str | None = None) -> Request:
    headers = [(b"authorization", authorization.encode())] if authorization is not None else []
    return Request({"type": "http", "method": "POST", "path": path, "headers": headers, "query_string": b""})


def test_api_keys_may_also_come_from_a_file(tmp_path, monkeypatch):
    keys = tmp_path / "keys"
    keys.write_text("sk-one\n\n  sk-two  \n")
    monkeypatch.setenv(API_KEYS_FILE_ENV, str(keys))
    assert load_api_keys(["sk-config"]) == ["sk-config", "sk-one", "sk-two"]


def test_a_tenant_is_a_short_hash_that_does_not_keep_the_secret():
    assert hashed("") == ""
    assert hashed("sk-one") == hashed("sk-one") != hashed("sk-two")
    assert len(hashed("sk-one")) == 24 and "sk-one" not in hashed("sk-one")


def test_with_keys_only_a_bearer_of_a_configured_key_is_admitted_beyond_the_open_routes():
    keys = ApiKeys(["sk-one", "sk-two"])
    assert keys.key(request(authorization="Bearer sk-two")) == "sk-two"
    assert keys.key(request(authorization="bearer  sk-one ")) == "sk-one"
    assert keys.admits(request(authorization="Bearer sk-one"))
    for refused in (None, "sk-one", "Basic sk-one", "Bearer sk-three", "Bearer "):
        assert keys.key(request(authorization=refused)) is None
        assert not keys.admits(request(authorization=refused))
    assert keys.admits(request("/health")) and keys.admits(request("/version"))
    assert not keys.admits(request("/metrics"))


def test_with_keys_the_tenant_is_the_key_so_a_wrong_key_cannot_name_another_tenant():
    keys = ApiKeys(["sk-one"])
    assert keys.tenant(request(authorization="Bearer sk-one")) == hashed("sk-one")
    assert keys.tenant(request(authorization="Bearer sk-other")) == ""


def test_without_keys_everything_is_admitted_and_the_authorization_header_separates_tenants():
    keys = ApiKeys([])
    assert keys.admits(request()) and keys.admits(request("/metrics"))
    assert keys.tenant(request(authorization="Bearer a")) == hashed("Bearer a") != keys.tenant(request())
    assert keys.tenant(request()) == ""
