"""Tests for the MIG profile catalog and placement rules (gpubroker.devices.mig).

Expected numbers are the NVIDIA MIG User Guide's ("Supported MIG Profiles"
tables, "List GPU Instance Profiles" -lgip/-lgipp listing); see the module.
"""

from __future__ import annotations

import re
import uuid

import pynvml
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpubroker.devices import mig
from gpubroker.devices.mig import (
    SPECS,
    GpuMigSpec,
    MigInstance,
    Placement,
    best_placement,
    blocking,
    can_place,
    free_compute_slices,
    free_memory_slices,
    is_fragmented,
    is_mig_uuid,
    is_valid_layout,
    legacy_mig_uuid,
    mig_uuid,
    spec_for,
    valid_placements,
)

H100 = "NVIDIA H100 80GB HBM3"


def _h100() -> GpuMigSpec:
    spec = spec_for(H100)
    assert spec is not None
    return spec


def _starts(placements: list[Placement] | tuple[Placement, ...]) -> list[int]:
    return [p.start for p in placements]


# --------------------------------------------------------------------------
# The tables
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "key"),
    [
        ("NVIDIA A100-SXM4-40GB", "A100-40GB"),
        ("NVIDIA A100-PCIE-40GB", "A100-40GB"),
        ("A100-SXM4-40GB", "A100-40GB"),  # pre-"NVIDIA " driver naming
        ("NVIDIA A100-SXM4-80GB", "A100-80GB"),
        ("NVIDIA A100 80GB PCIe", "A100-80GB"),
        ("NVIDIA A30", "A30-24GB"),
        ("NVIDIA H100 80GB HBM3", "H100-80GB"),
        ("NVIDIA H100 PCIe", "H100-80GB"),
        ("nvidia  h100 80gb hbm3 ", "H100-80GB"),
        ("NVIDIA H100 NVL", "H100-94GB"),
        ("NVIDIA H200", "H200-141GB"),
        ("NVIDIA H200 NVL", "H200-141GB"),
    ],
)
def test_spec_for_known_models(model: str, key: str) -> None:
    spec = spec_for(model)
    assert spec is not None
    assert spec.name == key


@pytest.mark.parametrize("model", ["NVIDIA L4", "Tesla T4", "NVIDIA L40S", "", "H100", "GPU-123"])
def test_spec_for_unknown_model_is_none(model: str) -> None:
    assert spec_for(model) is None


def test_catalog_names_match_devices_models() -> None:
    """Every MIG-capable model of the device catalog has a MIG spec."""
    from gpubroker.devices import models

    for model in models.MODELS.values():
        assert (spec_for(model.name) is not None) == model.mig_capable, model.name


@pytest.mark.parametrize(
    ("key", "names"),
    [
        (
            "A100-40GB",
            ["1g.5gb", "1g.5gb+me", "1g.10gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb"],
        ),
        (
            "A100-80GB",
            ["1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"],
        ),
        ("A30-24GB", ["1g.6gb", "1g.6gb+me", "2g.12gb", "2g.12gb+me", "4g.24gb"]),
        (
            "H100-80GB",
            ["1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"],
        ),
        (
            "H100-94GB",
            ["1g.12gb", "1g.12gb+me", "1g.24gb", "2g.24gb", "3g.47gb", "4g.47gb", "7g.94gb"],
        ),
        (
            "H200-141GB",
            ["1g.18gb", "1g.18gb+me", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb"],
        ),
    ],
)
def test_profile_names_per_gpu(key: str, names: list[str]) -> None:
    assert list(SPECS[key].profiles) == names


@pytest.mark.parametrize(
    ("key", "memory", "compute"),
    [
        ("A100-40GB", 8, 7),
        ("A100-80GB", 8, 7),
        ("A30-24GB", 4, 4),
        ("H100-80GB", 8, 7),
        ("H100-94GB", 8, 7),
        ("H200-141GB", 8, 7),
    ],
)
def test_slices_per_gpu(key: str, memory: int, compute: int) -> None:
    spec = SPECS[key]
    assert (spec.memory_slices, spec.compute_slices) == (memory, compute)


# (GPU, profile) -> (compute slices, memory slices, GiB, max count, NVML constant suffix,
# placement starts, size): the "Supported MIG Profiles" tables and the -lgipp listing.
TABLE_SPOT_CHECKS = [
    ("A100-40GB", "1g.5gb", 1, 1, 5, 7, "1_SLICE", [0, 1, 2, 3, 4, 5, 6], 1),
    ("A100-40GB", "1g.5gb+me", 1, 1, 5, 1, "1_SLICE_REV1", [0, 1, 2, 3, 4, 5, 6], 1),
    ("A100-40GB", "1g.10gb", 1, 2, 10, 4, "1_SLICE_REV2", [0, 2, 4, 6], 2),
    ("A100-40GB", "2g.10gb", 2, 2, 10, 3, "2_SLICE", [0, 2, 4], 2),
    ("A100-40GB", "3g.20gb", 3, 4, 20, 2, "3_SLICE", [0, 4], 4),
    ("A100-40GB", "4g.20gb", 4, 4, 20, 1, "4_SLICE", [0], 4),
    ("A100-40GB", "7g.40gb", 7, 8, 40, 1, "7_SLICE", [0], 8),
    ("A100-80GB", "1g.20gb", 1, 2, 20, 4, "1_SLICE_REV2", [0, 2, 4, 6], 2),
    ("A100-80GB", "7g.80gb", 7, 8, 80, 1, "7_SLICE", [0], 8),
    ("A30-24GB", "1g.6gb", 1, 1, 6, 4, "1_SLICE", [0, 1, 2, 3], 1),
    ("A30-24GB", "1g.6gb+me", 1, 1, 6, 1, "1_SLICE_REV1", [0, 1, 2, 3], 1),
    ("A30-24GB", "2g.12gb", 2, 2, 12, 2, "2_SLICE", [0, 2], 2),
    ("A30-24GB", "2g.12gb+me", 2, 2, 12, 1, "2_SLICE_REV1", [0, 2], 2),
    ("A30-24GB", "4g.24gb", 4, 4, 24, 1, "4_SLICE", [0], 4),
    ("H100-80GB", "1g.10gb", 1, 1, 10, 7, "1_SLICE", [0, 1, 2, 3, 4, 5, 6], 1),
    ("H100-80GB", "1g.10gb+me", 1, 1, 10, 1, "1_SLICE_REV1", [0, 1, 2, 3, 4, 5, 6], 1),
    ("H100-80GB", "1g.20gb", 1, 2, 20, 4, "1_SLICE_REV2", [0, 2, 4, 6], 2),
    ("H100-80GB", "2g.20gb", 2, 2, 20, 3, "2_SLICE", [0, 2, 4], 2),
    ("H100-80GB", "3g.40gb", 3, 4, 40, 2, "3_SLICE", [0, 4], 4),
    ("H100-80GB", "4g.40gb", 4, 4, 40, 1, "4_SLICE", [0], 4),
    ("H100-80GB", "7g.80gb", 7, 8, 80, 1, "7_SLICE", [0], 8),
    ("H100-94GB", "1g.12gb", 1, 1, 12, 7, "1_SLICE", [0, 1, 2, 3, 4, 5, 6], 1),
    ("H100-94GB", "1g.24gb", 1, 2, 24, 4, "1_SLICE_REV2", [0, 2, 4, 6], 2),
    ("H100-94GB", "3g.47gb", 3, 4, 47, 2, "3_SLICE", [0, 4], 4),
    ("H100-94GB", "7g.94gb", 7, 8, 94, 1, "7_SLICE", [0], 8),
    ("H200-141GB", "1g.18gb", 1, 1, 18, 7, "1_SLICE", [0, 1, 2, 3, 4, 5, 6], 1),
    ("H200-141GB", "1g.18gb+me", 1, 1, 18, 1, "1_SLICE_REV1", [0, 1, 2, 3, 4, 5, 6], 1),
    ("H200-141GB", "1g.35gb", 1, 2, 35, 4, "1_SLICE_REV2", [0, 2, 4, 6], 2),
    ("H200-141GB", "2g.35gb", 2, 2, 35, 3, "2_SLICE", [0, 2, 4], 2),
    ("H200-141GB", "3g.71gb", 3, 4, 71, 2, "3_SLICE", [0, 4], 4),
    ("H200-141GB", "4g.71gb", 4, 4, 71, 1, "4_SLICE", [0], 4),
    ("H200-141GB", "7g.141gb", 7, 8, 141, 1, "7_SLICE", [0], 8),
]


@pytest.mark.parametrize(
    ("key", "name", "compute", "memory", "gib", "max_count", "nvml", "starts", "size"),
    TABLE_SPOT_CHECKS,
)
def test_table_spot_checks(
    key: str,
    name: str,
    compute: int,
    memory: int,
    gib: int,
    max_count: int,
    nvml: str,
    starts: list[int],
    size: int,
) -> None:
    profile = SPECS[key].profile(name)
    assert profile.gpu_model == key
    assert profile.compute_slices == compute
    assert profile.memory_slices == memory
    assert profile.memory_gib == gib
    assert profile.max_count == max_count
    assert profile.nvml_profile == f"NVML_GPU_INSTANCE_PROFILE_{nvml}"
    assert _starts(profile.placements) == starts
    assert {p.size for p in profile.placements} == {size}
    assert profile.media_extensions == name.endswith("+me")


def test_a100_40gb_lgip_listing_from_the_guide() -> None:
    """Profile IDs and memory of the guide's ``nvidia-smi mig -lgip`` example."""
    spec = SPECS["A100-40GB"]
    listing = {
        "1g.5gb": (19, 4.75),
        "1g.5gb+me": (20, 4.75),
        "1g.10gb": (15, 9.625),
        "2g.10gb": (14, 9.625),
        "3g.20gb": (9, 19.50),
        "4g.20gb": (5, 19.50),
        "7g.40gb": (0, 39.25),
    }
    for name, (profile_id, gib) in listing.items():
        profile = spec.profile(name)
        assert profile.profile_id == profile_id
        assert profile.memory_mib == int(gib * 1024)


def test_profile_lookup_accepts_display_name_and_rejects_unknown() -> None:
    spec = _h100()
    assert spec.profile("MIG 3g.40gb") is spec.profiles["3g.40gb"]
    assert spec.profiles["3g.40gb"].display_name == "MIG 3g.40gb"
    with pytest.raises(KeyError, match=r"1g\.5gb"):
        spec.profile("1g.5gb")


@pytest.mark.parametrize("spec", list(SPECS.values()), ids=list(SPECS))
def test_table_is_consistent_with_placements(spec: GpuMigSpec) -> None:
    """The "Number of Instances Available" column is what the placements allow.

    For each non-+me profile, the most instances of that profile alone that
    fit an empty GPU (by its placements and the compute slices) equals the
    table's count; +me profiles are limited to one.  Every placement fits
    the GPU and has the profile's size; names agree with the slice counts.
    """
    for profile in spec.profiles.values():
        assert re.fullmatch(
            rf"{profile.compute_slices}g\.{profile.memory_gib}gb(\+me)?", profile.name
        )
        assert all(p.size == profile.memory_slices for p in profile.placements)
        assert all(p.end <= spec.memory_slices for p in profile.placements)
        layout: list[tuple[str, Placement]] = []
        while (placement := best_placement(spec, layout, profile)) is not None:
            layout.append((profile.name, placement))
        if profile.media_extensions:
            assert profile.max_count == 1
            assert len(layout) == 1
        else:
            assert len(layout) == profile.max_count


def test_full_gpu_profile_takes_every_slice() -> None:
    for spec in SPECS.values():
        (full,) = [p for p in spec.profiles.values() if p.compute_slices == spec.compute_slices]
        assert full.placements == (Placement(0, spec.memory_slices),)


def test_nvml_constants_match_pynvml() -> None:
    for name, value in mig.NVML_GPU_INSTANCE_PROFILES.items():
        assert getattr(pynvml, name) == value, name
    for spec in SPECS.values():
        for profile in spec.profiles.values():
            assert profile.nvml_profile_value == getattr(pynvml, profile.nvml_profile)


def test_specs_are_hashable_and_read_only() -> None:
    spec = _h100()
    assert hash(spec) == hash(spec)
    with pytest.raises(TypeError):
        spec.profiles["9g.1gb"] = spec.profiles["1g.10gb"]  # type: ignore[index]


# --------------------------------------------------------------------------
# Placement
# --------------------------------------------------------------------------


def test_placement_basics() -> None:
    a, b = Placement(0, 4), Placement(4, 4)
    assert not a.overlaps(b)
    assert Placement(2, 2).overlaps(a)
    assert list(Placement(6, 2).slices) == [6, 7]
    assert str(Placement(4, 4)) == "4:4"
    with pytest.raises(ValueError):
        Placement(-1, 1)
    with pytest.raises(ValueError):
        Placement(0, 0)


def test_seven_users_get_seven_distinct_1g10gb_on_an_h100_and_the_eighth_waits() -> None:
    spec = _h100()
    layout: list[tuple[str, Placement]] = []
    for _user in range(7):
        placement = best_placement(spec, layout, "1g.10gb")
        assert placement is not None
        assert placement in spec.profile("1g.10gb").placements  # valid by NVIDIA's -lgipp
        assert can_place(spec, layout, "1g.10gb", placement)
        layout.append(MigInstance("1g.10gb", placement))
    assert sorted(p.start for _, p in layout) == [0, 1, 2, 3, 4, 5, 6]
    assert is_valid_layout(spec, layout)
    assert free_compute_slices(spec, layout) == 0
    assert free_memory_slices(spec, layout) == 1  # slot 7 stays empty ...
    assert best_placement(spec, layout, "1g.10gb") is None  # ... and no 1g starts there
    assert valid_placements(spec, layout, "1g.10gb") == []
    assert not can_place(spec, layout, "1g.10gb", Placement(7, 1))


def _seven_1g(spec: GpuMigSpec) -> list[tuple[str, Placement]]:
    return [("1g.10gb", Placement(start, 1)) for start in range(7)]


def test_3g_fits_after_releases_that_free_a_half() -> None:
    spec = _h100()
    layout = [inst for inst in _seven_1g(spec) if inst[1].start not in (0, 1, 2, 3)]
    assert valid_placements(spec, layout, "3g.40gb") == [Placement(0, 4)]
    assert best_placement(spec, layout, "3g.40gb") == Placement(0, 4)
    assert blocking(spec, layout, "3g.40gb") == []
    assert not is_fragmented(spec, layout, "3g.40gb")


def test_3g_does_not_fit_after_releases_scattered_across_both_halves() -> None:
    spec = _h100()
    layout = [inst for inst in _seven_1g(spec) if inst[1].start not in (0, 2, 4, 5)]
    # 5 memory slices (0, 2, 4, 5, 7) and 4 compute slices free, but no free half
    assert free_memory_slices(spec, layout) == 5
    assert free_compute_slices(spec, layout) == 4
    assert valid_placements(spec, layout, "3g.40gb") == []
    assert best_placement(spec, layout, "3g.40gb") is None
    assert blocking(spec, layout, "3g.40gb") == [
        ("1g.10gb", Placement(1, 1)),
        ("1g.10gb", Placement(3, 1)),
        ("1g.10gb", Placement(6, 1)),
    ]
    assert is_fragmented(spec, layout, "3g.40gb")
    # a 2g still fits in slots 4-5
    assert valid_placements(spec, layout, "2g.20gb") == [Placement(4, 2)]


def test_blocking_is_empty_when_the_gpu_is_full_for_other_reasons() -> None:
    spec = _h100()
    # two 3g.40gb use both halves: a third 3g is blocked by memory ...
    layout = [("3g.40gb", Placement(0, 4)), ("3g.40gb", Placement(4, 4))]
    assert blocking(spec, layout, "3g.40gb") == layout
    assert not is_fragmented(spec, layout, "3g.40gb")  # ... but the GPU is simply full
    # a second +me is refused by the +me rule, not by memory
    me_layout = [("1g.10gb+me", Placement(0, 1))]
    assert valid_placements(spec, me_layout, "1g.10gb+me") == []
    assert blocking(spec, me_layout, "1g.10gb+me") == []


def test_only_one_media_extension_instance_per_gpu() -> None:
    spec = _h100()
    first = best_placement(spec, [], "1g.10gb+me")
    assert first is not None
    layout = [("1g.10gb+me", first)]
    assert valid_placements(spec, layout, "1g.10gb+me") == []
    # the plain profile is unaffected
    assert len(valid_placements(spec, layout, "1g.10gb")) == 6

    a30 = SPECS["A30-24GB"]
    layout = [("1g.6gb+me", Placement(0, 1))]
    assert valid_placements(a30, layout, "2g.12gb+me") == []  # one +me of any size
    assert valid_placements(a30, layout, "2g.12gb") == [Placement(2, 2)]
    assert not is_valid_layout(a30, [*layout, ("2g.12gb+me", Placement(2, 2))])


def test_7g_only_on_an_empty_gpu() -> None:
    for spec in SPECS.values():
        full = max(spec.profiles.values(), key=lambda p: p.compute_slices)
        assert valid_placements(spec, [], full) == [Placement(0, spec.memory_slices)]
        for profile in spec.profiles.values():
            for placement in profile.placements:
                assert valid_placements(spec, [(profile.name, placement)], full) == []


def test_max_count_is_enforced_even_where_placements_remain() -> None:
    spec = SPECS["A100-40GB"]
    # 1g.10gb (REV2) on an A100 40GB: 4 instances, by its placements {0,2,4,6}:2
    layout = [("1g.10gb", Placement(s, 2)) for s in (0, 2, 4, 6)]
    assert is_valid_layout(spec, layout)
    assert valid_placements(spec, layout, "1g.10gb") == []
    # a 1g.5gb+me fits next to five 1g.5gb, but only one of it
    layout = [("1g.5gb", Placement(s, 1)) for s in range(5)]
    assert _starts(valid_placements(spec, layout, "1g.5gb+me")) == [5, 6]


def test_compute_slices_are_limited() -> None:
    spec = _h100()
    # 4g + 3g: 7 compute slices in use (supported since R510, per the guide)
    layout = [("4g.40gb", Placement(0, 4)), ("3g.40gb", Placement(4, 4))]
    assert is_valid_layout(spec, layout)
    assert free_compute_slices(spec, layout) == 0
    # a hand-made layout that exceeds the compute slices is not valid
    assert not is_valid_layout(spec, [("7g.80gb", Placement(0, 8)), ("1g.10gb", Placement(0, 1))])


def test_unknown_profile_raises() -> None:
    spec = _h100()
    with pytest.raises(KeyError):
        can_place(spec, [], "1g.5gb", Placement(0, 1))
    with pytest.raises(KeyError):
        valid_placements(spec, [("9g.1gb", Placement(0, 1))], "1g.10gb")
    with pytest.raises(KeyError):
        best_placement(spec, [], SPECS["A100-40GB"].profile("1g.5gb"))
    assert not is_valid_layout(spec, [("1g.5gb", Placement(0, 1))])


def test_wrong_placement_is_refused() -> None:
    spec = _h100()
    assert not can_place(spec, [], "3g.40gb", Placement(2, 4))  # not a 3g start
    assert not can_place(spec, [], "3g.40gb", Placement(0, 3))  # 3g occupies 4 slices
    assert not can_place(spec, [], "1g.20gb", Placement(1, 2))
    assert can_place(spec, [], "1g.20gb", Placement(6, 2))


# --------------------------------------------------------------------------
# best_placement
# --------------------------------------------------------------------------


def test_best_placement_keeps_3g_and_4g_placeable_after_a_1g() -> None:
    spec = _h100()
    first = best_placement(spec, [], "1g.10gb")
    # slot 6: keeps 4g (slots 0-3), a 3g (slots 0-3) and all three 2g starts
    assert first == Placement(6, 1)
    layout = [("1g.10gb", first)]
    assert valid_placements(spec, layout, "4g.40gb") == [Placement(0, 4)]
    assert valid_placements(spec, layout, "3g.40gb") == [Placement(0, 4)]
    assert valid_placements(spec, layout, "2g.20gb") == [
        Placement(0, 2),
        Placement(2, 2),
        Placement(4, 2),
    ]
    # the lowest slot would have broken the 4g and one 3g half
    worst = [("1g.10gb", Placement(0, 1))]
    assert valid_placements(spec, worst, "4g.40gb") == []
    # the next 1g instances fill the upper half first
    second = best_placement(spec, layout, "1g.10gb")
    assert second == Placement(4, 1)
    third = best_placement(spec, [*layout, ("1g.10gb", second)], "1g.10gb")
    assert third == Placement(5, 1)
    upper_full = [*layout, ("1g.10gb", second), ("1g.10gb", third)]
    assert valid_placements(spec, upper_full, "3g.40gb") == [Placement(0, 4)]
    assert valid_placements(spec, upper_full, "4g.40gb") == [Placement(0, 4)]


def test_best_placement_of_a_3g_keeps_the_4g() -> None:
    spec = _h100()
    assert best_placement(spec, [], "3g.40gb") == Placement(4, 4)
    assert best_placement(spec, [], "2g.20gb") == Placement(4, 2)
    assert best_placement(spec, [], "7g.80gb") == Placement(0, 8)
    assert best_placement(spec, [], "4g.40gb") == Placement(0, 4)


def test_best_placement_on_a30() -> None:
    spec = SPECS["A30-24GB"]
    assert best_placement(spec, [], "2g.12gb") == Placement(0, 2)
    assert best_placement(spec, [("2g.12gb", Placement(0, 2))], "1g.6gb") == Placement(2, 1)


# --------------------------------------------------------------------------
# Property: random add/remove through best_placement never breaks the rules
# --------------------------------------------------------------------------


def _check_invariants(spec: GpuMigSpec, layout: list[tuple[str, Placement]]) -> None:
    used: set[int] = set()
    compute = 0
    for name, placement in layout:
        profile = spec.profiles[name]
        assert placement in profile.placements
        assert placement.start >= 0 and placement.end <= spec.memory_slices
        slices = set(placement.slices)
        assert not slices & used, f"overlap at {placement} in {layout}"
        used |= slices
        compute += profile.compute_slices
    assert compute <= spec.compute_slices
    for profile in spec.profiles.values():
        assert sum(name == profile.name for name, _ in layout) <= profile.max_count
    assert sum(spec.profiles[name].media_extensions for name, _ in layout) <= 1
    assert is_valid_layout(spec, layout)


@settings(max_examples=300, deadline=None)
@given(data=st.data(), spec=st.sampled_from(list(SPECS.values())))
def test_random_add_remove_never_overlaps_or_oversubscribes(
    data: st.DataObject, spec: GpuMigSpec
) -> None:
    names = list(spec.profiles)
    operations = data.draw(
        st.lists(
            st.one_of(
                st.tuples(st.just("add"), st.sampled_from(names)),
                st.tuples(st.just("remove"), st.integers(min_value=0, max_value=6)),
            ),
            max_size=40,
        )
    )
    layout: list[tuple[str, Placement]] = []
    for operation, argument in operations:
        if operation == "add":
            assert isinstance(argument, str)
            choice = best_placement(spec, layout, argument)
            candidates = valid_placements(spec, layout, argument)
            assert (choice is None) == (not candidates)
            if choice is None:
                # refused: either a fragmentation with named blockers, or not
                if is_fragmented(spec, layout, argument):
                    assert blocking(spec, layout, argument)
                continue
            assert choice in candidates
            assert blocking(spec, layout, argument) == []
            layout.append((argument, choice))
        elif layout:
            assert isinstance(argument, int)
            layout.pop(argument % len(layout))
        _check_invariants(spec, layout)


# --------------------------------------------------------------------------
# MIG UUIDs
# --------------------------------------------------------------------------

GPU_UUID = "GPU-e86cb44c-6756-fd30-cd4a-1e6da3caf9b0"  # from the guide's nvidia-smi -L


def test_mig_uuid_format_and_determinism() -> None:
    value = mig_uuid(GPU_UUID, 1, 0)
    assert re.fullmatch(r"MIG-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", value)
    assert value == mig_uuid(GPU_UUID, 1, 0)
    # version 5, RFC 4122 variant -- like the MIG UUIDs printed in the guide
    parsed = uuid.UUID(value.removeprefix("MIG-"))
    assert parsed.version == 5
    assert parsed.variant == uuid.RFC_4122
    assert is_mig_uuid(value)


def test_mig_uuids_differ_by_parent_gi_and_ci() -> None:
    values = {
        mig_uuid(parent, gi, ci)
        for parent in (GPU_UUID, "GPU-5c89852c-d268-c3f3-1b07-005d5ae1dc3f")
        for gi in range(15)
        for ci in range(3)
    }
    assert len(values) == 2 * 15 * 3
    with pytest.raises(ValueError):
        mig_uuid(GPU_UUID, -1, 0)


def test_legacy_mig_uuid() -> None:
    parent = "GPU-5c89852c-d268-c3f3-1b07-005d5ae1dc3f"
    assert legacy_mig_uuid(parent, 7, 0) == f"MIG-{parent}/7/0"
    assert is_mig_uuid(legacy_mig_uuid(parent, 7, 0))
    with pytest.raises(ValueError):
        legacy_mig_uuid("e86cb44c", 1, 0)
    assert not is_mig_uuid(GPU_UUID)
    assert not is_mig_uuid("MIG-nonsense")
    # a real MIG UUID from the guide's nvidia-smi -L output
    assert is_mig_uuid("MIG-c7384736-a75d-5afc-978f-d2f1294409fd")


def test_max_compute_sees_the_slice_a_3g_at_slot_0_strands() -> None:
    spec = mig.spec_for("NVIDIA H100 80GB HBM3")
    assert spec is not None
    P = mig.Placement
    assert mig.max_compute(spec, []) == 7
    assert mig.max_compute(spec, [("3g.40gb", P(4, 4))]) == 7  # a 4g still fits at 0
    assert mig.max_compute(spec, [("3g.40gb", P(0, 4))]) == 6  # slot 7 takes nothing
    assert mig.max_compute(spec, [("1g.10gb", P(i, 1)) for i in range(7)]) == 7
    a30 = mig.spec_for("NVIDIA A30")
    assert a30 is not None and mig.max_compute(a30, []) == 4


def test_least_stranding_placement_prefers_placements_that_keep_every_slice_usable() -> None:
    spec = mig.spec_for("NVIDIA H100 80GB HBM3")
    assert spec is not None
    P = mig.Placement
    assert mig.least_stranding_placement(spec, [], "3g.40gb") == (P(4, 4), 0)
    assert mig.least_stranding_placement(spec, [], "1g.10gb") == (P(6, 1), 0)
    # next to a 3g at 0 every 1g placement keeps 3 more slices usable
    assert mig.least_stranding_placement(spec, [("3g.40gb", P(0, 4))], "1g.10gb") == (P(6, 1), 0)
    full = [("7g.80gb", P(0, 8))]
    assert mig.least_stranding_placement(spec, full, "1g.10gb") is None
