"""Refused option values are quoted in errors (a 400 over the hub's REST
API, spawn progress, the hub log) at most :data:`form.MAX_SHOWN` characters
long: a 100 kB slug or key posted to the API is not echoed back whole."""

from __future__ import annotations

from typing import Any

import pytest

from gpubroker_spawner import form
from gpubroker_spawner.profiles import check_profiles

PROFILES = [
    {"display_name": "Big", "slug": "big", "request": {"gpus": 1}},
    {"display_name": "Plain", "slug": "plain", "request": {"gpus": 1}},
]


@pytest.mark.parametrize("options", [{"profile": "x" * 100_000}, {"y" * 100_000: 1}])
def test_profile_errors_quote_at_most_a_short_value(options: dict[str, Any]) -> None:
    profiles = check_profiles(PROFILES, lambda name: True)
    with pytest.raises(form.OptionsError) as info:
        form.select_profile(profiles, options)
    assert len(str(info.value)) < 200, len(str(info.value))
    assert "..." in str(info.value)


def test_gpu_count_errors_quote_at_most_a_short_key() -> None:
    with pytest.raises(form.OptionsError) as info:
        form.check_gpu_options({"z" * 100_000: 1}, 4)
    assert str(info.value).startswith("z" * 37 + "...: unknown option")
