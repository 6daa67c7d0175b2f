"""Input checks of the API and of the spawner's user_options."""

from __future__ import annotations

import datetime as dt

import pytest

from gpubroker.api import validation
from gpubroker.errors import BadRequest, NotFound
from gpubroker_spawner import form


def test_lease_request_defaults_and_types() -> None:
    assert validation.lease_request({"user": "ann", "gpus": 2}) == {
        "user": "ann",
        "server_name": "",
        "gpus": 2,
        "holder_kind": "server",
        "priority_class": None,
        "time_limit": None,
        "group": None,
        "mig_profile": None,
        "memory_gib": None,
        "count": None,
        "pool": None,
        "restart_of": None,
    }
    assert validation.lease_request({"user": "ann", "gpus": 1, "restart_of": 7})["restart_of"] == 7
    for bad in (0, -1, "7", True, 2**63):
        with pytest.raises(BadRequest, match="restart_of"):
            validation.lease_request({"user": "ann", "gpus": 1, "restart_of": bad})
    share = {"user": "ann", "memory_gib": 10, "count": 2, "pool": "shared"}
    parsed = validation.lease_request(share)
    assert (parsed["gpus"], parsed["memory_gib"], parsed["count"], parsed["pool"]) == (
        None,
        10.0,
        2,
        "shared",
    )
    parsed = validation.lease_request({"user": "ann", "mig_profile": "MIG 1g.10gb"})
    assert parsed["mig_profile"] == "1g.10gb"


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"user": "ann"}, "gpus/mig_profile/memory_gib: give exactly one of them, got none"),
        ({"user": "ann", "gpus": 1, "memory_gib": 2}, "give exactly one of them, got gpus, memory"),
        ({"user": "ann", "mig_profile": "big"}, "mig_profile: must be a MIG profile name"),
        ({"user": "ann", "memory_gib": 0}, "memory_gib: must be between 0.25 and 1024 GiB"),
        ({"user": "ann", "memory_gib": "10G"}, "memory_gib: must be a number of GiB"),
        ({"user": "ann", "gpus": 1, "count": 2}, "count: only with memory_gib"),
        ({"user": "ann", "memory_gib": 4, "count": 0}, "count: must be at least 1, got 0"),
        ({"user": "ann", "gpus": 1, "pool": "a/b"}, "pool: must be 1-255 characters"),
        ({"user": "ann", "gpus": "two"}, 'gpus: must be an integer, got "two"'),
        ({"user": "ann", "gpus": True}, "gpus: must be an integer, got true"),
        ({"user": "ann", "gpus": 1.5}, "gpus: must be an integer, got 1.5"),
        ({"user": "ann", "gpus": 0}, "gpus: must be at least 1, got 0 (a lease holds GPUs"),
        ({"gpus": 1}, "user: required, and missing"),
        ({"gpus": 1, "user": None}, "user: must be a string"),
        ({"user": "a/b", "gpus": 1}, "user: must be 1-255 characters without '/'"),
        ({"user": "ann", "gpus": 1, "server_name": 3}, "server_name: must be a string"),
        ({"user": "ann", "gpus": 1, "color": "red"}, "color: unknown field"),
        ({"user": "ann", "gpus": 1, "holder_kind": "job"}, "holder_kind: must be one of"),
        ({"user": "ann", "gpus": 1, "time_limit": 0}, "time_limit: must be more than 0"),
        ({"user": "ann", "gpus": 1, "time_limit": "1h"}, "time_limit: must be a number"),
        ({"user": "ann", "gpus": 1, "priority_class": 3}, "priority_class: must be a string"),
    ],
)
def test_lease_request_errors_name_the_field(body: dict, message: str) -> None:
    with pytest.raises(BadRequest) as err:
        validation.lease_request(body)
    assert message in err.value.message


@pytest.mark.parametrize(
    ("raw", "message"),
    [(b"{", "body: not valid JSON"), (b"[1]", "body: must be a JSON object")],
)
def test_bad_json_bodies(raw: bytes, message: str) -> None:
    with pytest.raises(BadRequest, match=message):
        validation.parse_json_object(raw)


def test_wait_argument() -> None:
    assert validation.wait_seconds(None, 300) == 0
    assert validation.wait_seconds("2.5", 300) == 2.5
    with pytest.raises(BadRequest, match="wait: must be between 0 and 300 seconds"):
        validation.wait_seconds("301", 300)
    with pytest.raises(BadRequest, match="wait: must be a number"):
        validation.wait_seconds("soon", 300)


def test_form_and_api_options_share_one_check() -> None:
    assert form.options_from_form({"gpus": ["2"]}) == {"gpus": 2}
    assert form.options_from_form({"gpus": ["two"]}) == {"gpus": "two"}
    assert form.check_gpu_options({"gpus": 2}, limit=8) == 2
    assert form.check_gpu_options({}, limit=8, default=1) == 1
    assert form.check_gpu_options(None, limit=0) == 0
    from_form = form.options_from_form({"gpus": ["99"]})
    for options in (from_form, {"gpus": 99}):
        with pytest.raises(form.OptionsError, match=r"gpus: must be between 0 and 8 .* got 99"):
            form.check_gpu_options(options, limit=8)
    with pytest.raises(
        form.OptionsError, match='gpus: must be an integer between 0 and 8, got "two"'
    ):
        form.check_gpu_options({"gpus": "two"}, limit=8)
    with pytest.raises(form.OptionsError, match="image: unknown option"):
        form.check_gpu_options({"gpus": 1, "image": "x"}, limit=8)


def test_form_html_offers_zero_to_limit_and_says_when_simulated() -> None:
    devices = {
        "summary": {"free": 1, "total": 2},
        "backend": {"simulated": True},
        "devices": [{"name": "NVIDIA H100 80GB HBM3", "present": True}],
    }
    html = form.render_form(2, devices)
    assert html.count("<option") == 3
    assert "(will queue)" in html and "Simulated GPUs" in html
    assert "1 of 2 GPUs free now (NVIDIA H100 80GB HBM3)" in html


# -- hardening (issue #10): hostile input gets a 400/404 naming the limit ---------------


def test_deep_json_is_refused_before_parsing() -> None:
    deep = b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with pytest.raises(BadRequest, match="body: JSON nested deeper than 32 levels"):
        validation.parse_json_object(deep)
    ok = b'{"a": ' + b"[" * 31 + b"]" * 31 + b', "s": "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["}'
    assert validation.parse_json_object(ok)["s"].startswith("[[[")
    assert validation.json_depth(b'{"a": [1, {"b": "]]]\\"["}]}') == 3


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b'{"guaranteed": NaN}', "body: NaN is not a number JSON allows"),
        (b'{"limit": Infinity}', "body: Infinity is not a number JSON allows"),
        (b'{"limit": -Infinity}', "body: -Infinity is not a number JSON allows"),
        (b'{"limit": 1e400}', 'body: number "1e400" is out of range (finite numbers only)'),
        (b'{"gpus": 9223372036854775808}', "at most 9223372036854775807 in magnitude"),
        (b'{"gpus": ' + b"7" * 5000 + b"}", "is out of range"),
        (b'{"user": "ann", "server_name": "\\ud800"}', "server_name: not valid Unicode"),
        (b'{"\\udfff": 1}', "body: a field name: not valid Unicode"),
        (b'{"reason": ["ok", "\\ud800x"]}', "reason: not valid Unicode"),
        (b'{"reason": "bye\\u0000x"}', "reason: must not contain a NUL character (at character 3)"),
        (b'{"server_url": "http://x\\u0000"}', "server_url: must not contain a NUL character"),
        (b'{"command": ["echo", "a\\u0000b"]}', "command: must not contain a NUL character"),
        (b'{"env": {"X": "a\\u0000b"}}', "env: must not contain a NUL character"),
        (b'{"a\\u0000": 1}', "body: a field name: must not contain a NUL character"),
    ],
)
def test_non_finite_numbers_huge_integers_and_surrogates_are_refused(
    raw: bytes, message: str
) -> None:
    with pytest.raises(BadRequest) as err:
        validation.parse_json_object(raw)
    assert message in err.value.message


def test_quota_body_refuses_non_finite_numbers_given_directly() -> None:
    for bad in (float("nan"), float("inf"), -1):
        with pytest.raises(BadRequest, match="guaranteed: must be a finite number of GPUs >= 0"):
            validation.quota_body({"guaranteed": bad})
    assert validation.quota_body({"guaranteed": 1, "limit": 2}) == (1.0, 2.0)
    zero = validation.quota_body({"guaranteed": -0.0, "limit": -0.0})
    assert [str(x) for x in zero] == ["0.0", "0.0"]


@pytest.mark.parametrize(
    "name",
    [".", "..", "a/b", "a\x00b", "tab\there", "del\x7f", "c1\x85", "\ud800", " lead", "x" * 256],
)
def test_names_are_checked(name: str) -> None:
    with pytest.raises(BadRequest, match="group: must be 1-255 characters without '/'"):
        validation.lease_request({"user": "ann", "gpus": 1, "group": name})
    with pytest.raises(BadRequest, match="name: must be 1-255"):
        validation.check_name(name, "name")


def test_good_names_pass() -> None:
    for name in ("ann", "x" * 255, "a.b", "...", "é-ü", "team a"):
        assert validation.check_name(name, "name") == name
    assert validation.check_name("", "server_name", allow_empty=True) == ""
    assert validation.optional_name_arg(None, "user") is None


@pytest.mark.parametrize("raw", ["0", str(2**63), "9" * 5000, "\u0661\u0662"])
def test_lease_ids_beyond_64_bits_are_not_found(raw: str) -> None:
    with pytest.raises(NotFound, match="no such lease"):
        validation.lease_id(raw)
    with pytest.raises(NotFound, match=r"^job .*: no such job"):
        validation.lease_id(raw, "job")
    assert validation.lease_id(str(2**63 - 1)) == 2**63 - 1


def test_version_argument_is_bounded() -> None:
    assert validation.optional_int("7", "version") == 7
    for raw in ("9" * 5000, str(2**63), "-1", "\u0661"):
        with pytest.raises(
            BadRequest, match="version: must be an integer from 0 to 9223372036854775807"
        ):
            validation.optional_int(raw, "version")
    with pytest.raises(BadRequest, match="wait: must be between 0 and 300"):
        validation.wait_seconds("nan", 300)


def test_echoed_values_are_escaped_and_cut() -> None:
    with pytest.raises(BadRequest) as err:
        validation.lease_request({"user": "ann", "gpus": "g" * 10_000})
    assert err.value.message == 'gpus: must be an integer, got "' + "g" * 59 + "…"
    with pytest.raises(BadRequest) as err:
        validation.check_name("\x00" * 500, "user")
    assert "\x00" not in err.value.message and len(err.value.message) < 200
    assert validation.echo("\ud800") == '"\\ud800"'


def test_report_parameters_echo_a_bad_value_cut_and_escaped() -> None:
    from gpubroker.usage.report import ReportError, parse_time, zone_of

    with pytest.raises(ReportError) as err:
        zone_of("A" * 300)
    assert str(err.value) == (
        f'tz: unknown time zone "{"A" * 59}… (use an IANA name such as Europe/Berlin)'
    )
    with pytest.raises(ReportError, match=r'^from: not a date .*: "x\\u0001y"$'):
        parse_time("from", "x\x01y", dt.timezone.utc)


def test_a_quota_put_without_fields_is_refused_not_a_lifted_limit() -> None:
    # an empty body (curl -X PUT without -d) read as {} set 0 guaranteed and
    # no limit: the admin's trial lifted bob's limit by accident
    for empty in (b"", b"  ", b"{}"):
        with pytest.raises(validation.BadRequest, match='body: give "guaranteed" and/or "limit"'):
            validation.quota_body(validation.parse_json_object(empty))
    assert validation.quota_body({"limit": None}) == (0.0, None)  # said on purpose
