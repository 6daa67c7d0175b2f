"""MIG profile catalog and placement rules (pure: no NVML, no I/O).

This module answers, for one MIG-capable GPU, "which GPU-instance profiles
exist, where may each one start, and can this one still be created next to
the instances that already exist?"  The scheduler and the fake backend use
it; the real backend can use it to explain a failed ``nvmlDeviceCreateGpuInstance``.

The hardware model
------------------
NVIDIA Multi-Instance GPU User Guide, "Concepts → Terminology": a GPU memory
slice is roughly 1/8 of the GPU memory (with its memory controllers and L2);
a GPU SM slice is roughly 1/7 of the SMs.  A100, H100 and H200 therefore have
**8 memory slices and 7 compute slices**; the A30 has **4 and 4** ("A30 MIG
Profiles" table, fractions in quarters).

A GPU instance (GI) occupies a contiguous run of memory slices, its
*placement* ``start:size`` (NVML ``nvmlGpuInstancePlacement_t``: "start: index
of first occupied memory slice; size: number of memory slices occupied"), and
a number of compute slices (the ``g`` in ``3g.40gb``).  NVML's
``nvmlDeviceGetGpuInstancePossiblePlacements_v2``: "Creation of new GPU
instance will fail if there is overlap with the already occupied memory
slices."  Each profile may start only at the slots the driver lists with
``nvidia-smi mig -lgipp``; the guide ("Getting Started with MIG → List GPU
Instance Profiles") shows, for an A100::

    GPU  0 Profile ID 19 Placements: {0,1,2,3,4,5,6}:1     1g.5gb
    GPU  0 Profile ID 20 Placements: {0,1,2,3,4,5,6}:1     1g.5gb+me
    GPU  0 Profile ID 15 Placements: {0,2,4,6}:2           1g.10gb
    GPU  0 Profile ID 14 Placements: {0,2,4}:2             2g.10gb
    GPU  0 Profile ID  9 Placements: {0,4}:4               3g.20gb
    GPU  0 Profile ID  5 Placement : {0}:4                 4g.20gb
    GPU  0 Profile ID  0 Placement : {0}:8                 7g.40gb

Note what the table implies: a ``3g`` instance occupies **four** memory
slices, ``7g`` occupies all **eight**, and no 1-slice profile can start at
slot 7 -- so seven ``1g.10gb`` on an H100 leave slot 7 empty and an eighth
does not fit.  The same ``-lgipp`` output is published for the H100 80GB and
the H100 NVL (sources at each table below).

Rules enforced by :func:`can_place`
-----------------------------------
1. the placement is one the profile allows (``-lgipp``);
2. it overlaps no existing instance's memory slices (NVML, above);
3. compute slices in use stay within :attr:`GpuMigSpec.compute_slices`;
4. at most :attr:`MigProfile.max_count` instances of the profile ("Number of
   Instances Available" column of the "Supported MIG Profiles" tables);
5. at most one media-extension (``+me``) instance per GPU: the tables say "A
   single 1g profile can include media extensions" (A30: "A single 2g
   profile ...", and the +me profiles take the GPU's only JPEG/OFA engines,
   so a 1g+me and a 2g+me cannot coexist either).

MIG UUIDs
---------
See :func:`mig_uuid` for the ``MIG-xxxxxxxx-...`` format (R470+ drivers) and
:func:`legacy_mig_uuid` for the older ``MIG-GPU-<uuid>/<gi>/<ci>`` one.
"""

from __future__ import annotations

import functools
import re
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import NamedTuple

__all__ = [
    "NVML_GPU_INSTANCE_PROFILES",
    "PROFILE_NAME_RE",
    "SPECS",
    "GpuMigSpec",
    "Layout",
    "MigInstance",
    "MigProfile",
    "Placement",
    "best_placement",
    "blocking",
    "can_place",
    "free_compute_slices",
    "free_memory_slices",
    "is_fragmented",
    "is_mig_uuid",
    "is_valid_layout",
    "least_stranding_placement",
    "legacy_mig_uuid",
    "max_compute",
    "mig_uuid",
    "placement_problem",
    "spec_for",
    "valid_placements",
]

#: NVML GPU-instance profile constants (``nvml.h`` / nvidia-ml-py ``pynvml``),
#: copied so that this module never imports NVML.  The unit tests check them
#: against ``pynvml``.
NVML_GPU_INSTANCE_PROFILES: Mapping[str, int] = MappingProxyType(
    {
        "NVML_GPU_INSTANCE_PROFILE_1_SLICE": 0x0,
        "NVML_GPU_INSTANCE_PROFILE_2_SLICE": 0x1,
        "NVML_GPU_INSTANCE_PROFILE_3_SLICE": 0x2,
        "NVML_GPU_INSTANCE_PROFILE_4_SLICE": 0x3,
        "NVML_GPU_INSTANCE_PROFILE_7_SLICE": 0x4,
        "NVML_GPU_INSTANCE_PROFILE_8_SLICE": 0x5,
        "NVML_GPU_INSTANCE_PROFILE_6_SLICE": 0x6,
        "NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1": 0x7,
        "NVML_GPU_INSTANCE_PROFILE_2_SLICE_REV1": 0x8,
        "NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2": 0x9,
    }
)


# --------------------------------------------------------------------------
# Data types
# --------------------------------------------------------------------------


@dataclass(frozen=True, order=True)
class Placement:
    """Where a GPU instance sits: ``size`` memory slices from slot ``start``.

    Same meaning as NVML's ``nvmlGpuInstancePlacement_t`` and the
    ``Start:Size`` column of ``nvidia-smi mig -lgi``.
    """

    start: int
    size: int

    def __post_init__(self) -> None:
        if self.start < 0 or self.size < 1:
            raise ValueError(f"invalid placement start={self.start} size={self.size}")

    @property
    def end(self) -> int:
        """One past the last occupied memory slice."""
        return self.start + self.size

    @property
    def slices(self) -> range:
        """The memory slices this placement occupies."""
        return range(self.start, self.end)

    def overlaps(self, other: Placement) -> bool:
        """Whether the two placements share at least one memory slice."""
        return self.start < other.end and other.start < self.end

    def __str__(self) -> str:
        return f"{self.start}:{self.size}"


class MigInstance(NamedTuple):
    """One existing GPU instance on a GPU: its profile name and placement."""

    profile: str
    placement: Placement


#: The GPU instances on one GPU.  Plain ``(profile name, Placement)`` tuples
#: are accepted; :class:`MigInstance` is such a tuple with field names.
Layout = Sequence[tuple[str, Placement]]


@dataclass(frozen=True)
class MigProfile:
    """One GPU-instance profile of one GPU model.

    Attributes:
        name: short profile name as ``nvidia-smi`` prints it without the
            ``MIG`` prefix, e.g. ``1g.10gb``, ``1g.10gb+me``.
        gpu_model: :attr:`GpuMigSpec.name` of the GPU it belongs to.
        compute_slices: SM slices (the ``g`` number).
        memory_slices: memory slices occupied ("Fraction of Memory" column
            times the GPU's memory slices; equals the ``-lgipp`` size).
        memory_gib: memory as the name says (``10`` for ``1g.10gb``).
        max_count: "Number of Instances Available" column.
        nvml_profile: name of the NVML ``NVML_GPU_INSTANCE_PROFILE_*``
            constant to pass to ``nvmlDeviceGetGpuInstanceProfileInfo``.
        placements: every start slot the profile may use (``-lgipp``), each
            with ``size == memory_slices``.
        media_extensions: a ``+me`` profile (NVDEC/JPEG/OFA media engines).
        memory_mib: memory in MiB as ``nvidia-smi mig -lgip`` reports it,
            where the MIG user guide prints that listing (A100 40GB only);
            ``None`` elsewhere.  It varies with the driver version.
        profile_id: the GPU-instance profile ID (``nvidia-smi mig -lgip``
            "ID" column, ``nvmlGpuInstanceProfileInfo_t.id``), e.g. 19 for
            ``1g.10gb`` on an H100; ``None`` where no listing was found.
    """

    name: str
    gpu_model: str
    compute_slices: int
    memory_slices: int
    memory_gib: int
    max_count: int
    nvml_profile: str
    placements: tuple[Placement, ...]
    media_extensions: bool
    memory_mib: int | None = None
    profile_id: int | None = None

    @property
    def nvml_profile_value(self) -> int:
        """Numeric value of :attr:`nvml_profile` (e.g. 0 for ``..._1_SLICE``)."""
        return NVML_GPU_INSTANCE_PROFILES[self.nvml_profile]

    @property
    def display_name(self) -> str:
        """The name as ``nvidia-smi`` prints it, e.g. ``MIG 1g.10gb``."""
        return f"MIG {self.name}"


@dataclass(frozen=True)
class GpuMigSpec:
    """MIG geometry of one GPU model.

    Attributes:
        name: short catalog key, e.g. ``H100-80GB``.
        model_names: NVML product names (``nvmlDeviceGetName``) this applies to.
        memory_slices: memory slices of the whole GPU (8, A30: 4).
        compute_slices: SM slices of the whole GPU (7, A30: 4).
        profiles: profile name -> :class:`MigProfile` (read-only mapping).
        memory_gib: the GPU's nominal memory, GB as in the product name.
        source: where the numbers come from (guide section, URLs).
    """

    name: str
    model_names: tuple[str, ...]
    memory_slices: int
    compute_slices: int
    profiles: Mapping[str, MigProfile] = field(hash=False)
    memory_gib: int
    source: str

    def profile(self, name: str) -> MigProfile:
        """The profile called ``name`` (a ``MIG`` prefix is optional).

        Raises:
            KeyError: the GPU has no such profile.
        """
        key = name.removeprefix("MIG ").strip()
        try:
            return self.profiles[key]
        except KeyError:
            known = ", ".join(self.profiles)
            raise KeyError(f"{self.name} has no MIG profile {name!r} (known: {known})") from None

    @property
    def profiles_largest_first(self) -> tuple[MigProfile, ...]:
        """Profiles ordered by memory slices, then compute slices, descending."""
        return tuple(
            sorted(
                self.profiles.values(),
                key=lambda p: (-p.memory_slices, -p.compute_slices, p.media_extensions, p.name),
            )
        )


# --------------------------------------------------------------------------
# The catalog
# --------------------------------------------------------------------------

_GUIDE = "https://docs.nvidia.com/datacenter/tesla/mig-user-guide/"
_PROFILES_PAGE = _GUIDE + "supported-mig-profiles.html"
_LGIPP_PAGE = _GUIDE + "getting-started-with-mig.html#list-gpu-instance-profiles"

# Start slots on the 8-slice GPUs (GA100 / GH100), from ``nvidia-smi mig -lgipp``.
_ALL_1 = (0, 1, 2, 3, 4, 5, 6)
_EVEN_1_OF_2 = (0, 2, 4, 6)
_EVEN_2 = (0, 2, 4)
_HALVES = (0, 4)
_ZERO = (0,)

_P1 = "NVML_GPU_INSTANCE_PROFILE_1_SLICE"
_P1_REV1 = "NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1"
_P1_REV2 = "NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2"
_P2 = "NVML_GPU_INSTANCE_PROFILE_2_SLICE"
_P2_REV1 = "NVML_GPU_INSTANCE_PROFILE_2_SLICE_REV1"
_P3 = "NVML_GPU_INSTANCE_PROFILE_3_SLICE"
_P4 = "NVML_GPU_INSTANCE_PROFILE_4_SLICE"
_P7 = "NVML_GPU_INSTANCE_PROFILE_7_SLICE"

#: a GPU-instance profile name as nvidia-smi prints it (without "MIG "), e.g. 1g.10gb+me
PROFILE_NAME_RE = re.compile(r"^(?P<g>\d+)g\.(?P<gb>\d+)gb(?P<me>\+me)?$")


class _Row(NamedTuple):
    name: str
    compute: int
    memory_slices: int
    max_count: int
    nvml: str
    starts: tuple[int, ...]
    profile_id: int | None = None
    memory_mib: int | None = None


def _spec(
    name: str,
    model_names: tuple[str, ...],
    *,
    memory_slices: int,
    compute_slices: int,
    memory_gib: int,
    source: str,
    rows: Iterable[_Row],
) -> GpuMigSpec:
    profiles: dict[str, MigProfile] = {}
    for row in rows:
        match = PROFILE_NAME_RE.match(row.name)
        if match is None or int(match["g"]) != row.compute:
            raise ValueError(f"{name}: bad profile row {row}")
        placements = tuple(Placement(start, row.memory_slices) for start in row.starts)
        if any(p.end > memory_slices for p in placements):
            raise ValueError(f"{name}: {row.name} placement beyond slot {memory_slices}")
        profiles[row.name] = MigProfile(
            name=row.name,
            gpu_model=name,
            compute_slices=row.compute,
            memory_slices=row.memory_slices,
            memory_gib=int(match["gb"]),
            max_count=row.max_count,
            nvml_profile=row.nvml,
            placements=placements,
            media_extensions=match["me"] is not None,
            memory_mib=row.memory_mib,
            profile_id=row.profile_id,
        )
    return GpuMigSpec(
        name=name,
        model_names=model_names,
        memory_slices=memory_slices,
        compute_slices=compute_slices,
        profiles=MappingProxyType(profiles),
        memory_gib=memory_gib,
        source=source,
    )


A100_40GB = _spec(
    "A100-40GB",
    ("NVIDIA A100-SXM4-40GB", "NVIDIA A100-PCIE-40GB"),
    memory_slices=8,
    compute_slices=7,
    memory_gib=40,
    source=(
        "NVIDIA MIG User Guide, Supported MIG Profiles, A100 MIG Profiles, table "
        "'GPU Instance Profiles on A100' (A100-SXM4-40GB) " + _PROFILES_PAGE + "; "
        "placements, profile IDs and MiB from Getting Started with MIG, List GPU "
        "Instance Profiles (nvidia-smi mig -lgip / -lgipp on an A100-SXM4-40GB) " + _LGIPP_PAGE
    ),
    rows=(
        # name, g, mem slices, max, NVML constant, starts, -lgip ID, -lgip MiB
        _Row("1g.5gb", 1, 1, 7, _P1, _ALL_1, 19, 4864),  # 4.75 GiB
        _Row("1g.5gb+me", 1, 1, 1, _P1_REV1, _ALL_1, 20, 4864),  # 4.75 GiB
        _Row("1g.10gb", 1, 2, 4, _P1_REV2, _EVEN_1_OF_2, 15, 9856),  # 9.62 GiB
        _Row("2g.10gb", 2, 2, 3, _P2, _EVEN_2, 14, 9856),  # 9.62 GiB
        _Row("3g.20gb", 3, 4, 2, _P3, _HALVES, 9, 19968),  # 19.50 GiB
        _Row("4g.20gb", 4, 4, 1, _P4, _ZERO, 5, 19968),  # 19.50 GiB
        _Row("7g.40gb", 7, 8, 1, _P7, _ZERO, 0, 40192),  # 39.25 GiB
    ),
)
"""A100 40GB.  Profiles and counts: NVIDIA MIG User Guide, Supported MIG
Profiles, A100 table (A100-SXM4-40GB).  Placements: the guide's own
``nvidia-smi mig -lgipp`` output (Getting Started with MIG, List GPU Instance
Profiles), taken on an A100-SXM4-40GB."""

A100_80GB = _spec(
    "A100-80GB",
    ("NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe"),
    memory_slices=8,
    compute_slices=7,
    memory_gib=80,
    source=(
        "NVIDIA MIG User Guide, Supported MIG Profiles, A100 MIG Profiles: 'For "
        "A100-SXM4-80GB, the profile names will change according to the memory proportion "
        "- for example, 1g.10gb, 1g.10gb+me, 1g.20gb, 2g.20gb, 3g.40gb, 4g.40gb, 7g.80gb "
        "respectively' " + _PROFILES_PAGE + "; same GA100 slices and placements as the "
        "A100 40GB; profile IDs from published nvidia-smi mig -lgip output of an "
        "A100-SXM4-80GB"
    ),
    rows=(
        _Row("1g.10gb", 1, 1, 7, _P1, _ALL_1, 19),
        _Row("1g.10gb+me", 1, 1, 1, _P1_REV1, _ALL_1, 20),
        _Row("1g.20gb", 1, 2, 4, _P1_REV2, _EVEN_1_OF_2, 15),
        _Row("2g.20gb", 2, 2, 3, _P2, _EVEN_2, 14),
        _Row("3g.40gb", 3, 4, 2, _P3, _HALVES, 9),
        _Row("4g.40gb", 4, 4, 1, _P4, _ZERO, 5),
        _Row("7g.80gb", 7, 8, 1, _P7, _ZERO, 0),
    ),
)
"""A100 80GB: the A100 table with the 80GB names (guide note under the A100
table); geometry identical to the A100 40GB."""

A30_24GB = _spec(
    "A30-24GB",
    ("NVIDIA A30",),
    memory_slices=4,
    compute_slices=4,
    memory_gib=24,
    source=(
        "NVIDIA MIG User Guide, Supported MIG Profiles, A30 MIG Profiles, table for the "
        "A30-24GB product " + _PROFILES_PAGE + " (fractions in quarters: 4 memory and 4 "
        "compute slices; 1g.6gb+me needs R470+, 2g.12gb+me R525+ drivers); placements "
        "{0,1,2,3}:1, {0,2}:2, {0}:4 and profile IDs from published nvidia-smi mig "
        "-lgipp / -lgip output of an NVIDIA A30"
    ),
    rows=(
        _Row("1g.6gb", 1, 1, 4, _P1, (0, 1, 2, 3), 14),
        _Row("1g.6gb+me", 1, 1, 1, _P1_REV1, (0, 1, 2, 3), 21),
        _Row("2g.12gb", 2, 2, 2, _P2, (0, 2), 5),
        _Row("2g.12gb+me", 2, 2, 1, _P2_REV1, (0, 2), 6),
        _Row("4g.24gb", 4, 4, 1, _P4, _ZERO, 0),
    ),
)
"""A30 24GB: NVIDIA MIG User Guide, Supported MIG Profiles, A30 table."""

H100_80GB = _spec(
    "H100-80GB",
    ("NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe"),
    memory_slices=8,
    compute_slices=7,
    memory_gib=80,
    source=(
        "NVIDIA MIG User Guide, Supported MIG Profiles, H100 MIG Profiles, table "
        "'GPU Instance Profiles on H100' (H100 80GB, SXM5 and PCIe) " + _PROFILES_PAGE + "; "
        "placements and profile IDs from published nvidia-smi mig -lgipp / -lgip output "
        "of an 'NVIDIA H100 80GB HBM3' (identical to the guide's A100 listing)"
    ),
    rows=(
        _Row("1g.10gb", 1, 1, 7, _P1, _ALL_1, 19),
        _Row("1g.10gb+me", 1, 1, 1, _P1_REV1, _ALL_1, 20),
        _Row("1g.20gb", 1, 2, 4, _P1_REV2, _EVEN_1_OF_2, 15),
        _Row("2g.20gb", 2, 2, 3, _P2, _EVEN_2, 14),
        _Row("3g.40gb", 3, 4, 2, _P3, _HALVES, 9),
        _Row("4g.40gb", 4, 4, 1, _P4, _ZERO, 5),
        _Row("7g.80gb", 7, 8, 1, _P7, _ZERO, 0),
    ),
)
"""H100 80GB (SXM5 and PCIe): NVIDIA MIG User Guide, Supported MIG Profiles,
H100 80GB table."""

H100_94GB = _spec(
    "H100-94GB",
    ("NVIDIA H100 NVL",),
    memory_slices=8,
    compute_slices=7,
    memory_gib=94,
    source=(
        "NVIDIA MIG User Guide, Supported MIG Profiles, H100 MIG Profiles, table for the "
        "H100 94GB product (PCIe and SXM5) " + _PROFILES_PAGE + "; names and counts as in "
        "NVIDIA mig-parted deployments/systemd/config-default.yaml ('H100 NVL': 1g.12gb x7, "
        "1g.12gb+me x1, 1g.24gb x4, 2g.24gb x3, 3g.47gb x2, 4g.47gb x1, 7g.94gb x1); "
        "placements and profile IDs from published nvidia-smi mig -lgipp / -lgip output of "
        "an 'NVIDIA H100 NVL' (Azure NC H100 v5 walkthrough; Colfax Research, 'Sharing "
        "NVIDIA GPUs at the System Level', 2024)"
    ),
    rows=(
        _Row("1g.12gb", 1, 1, 7, _P1, _ALL_1, 19),
        _Row("1g.12gb+me", 1, 1, 1, _P1_REV1, _ALL_1, 20),
        _Row("1g.24gb", 1, 2, 4, _P1_REV2, _EVEN_1_OF_2, 15),
        _Row("2g.24gb", 2, 2, 3, _P2, _EVEN_2, 14),
        _Row("3g.47gb", 3, 4, 2, _P3, _HALVES, 9),
        _Row("4g.47gb", 4, 4, 1, _P4, _ZERO, 5),
        _Row("7g.94gb", 7, 8, 1, _P7, _ZERO, 0),
    ),
)
"""H100 NVL 94GB: NVIDIA MIG User Guide, Supported MIG Profiles, H100 94GB
table (PCIe and SXM5)."""

H200_141GB = _spec(
    "H200-141GB",
    ("NVIDIA H200", "NVIDIA H200 NVL"),
    memory_slices=8,
    compute_slices=7,
    memory_gib=141,
    source=(
        "NVIDIA MIG User Guide, Supported MIG Profiles, H200 MIG Profiles, table "
        "'GPU Instance Profiles on H200' (H200 141GB) " + _PROFILES_PAGE + "; counts also "
        "in NVIDIA mig-parted config-default.yaml ('H200-141GB'); placements: same GH100 "
        "8-memory/7-compute slice geometry and memory fractions as the H100 tables (no "
        "-lgipp listing for an H200 was found); profile IDs 19/20/14/0 seen in published "
        "nvidia-smi mig -lgip output of an H200, 15/9/5 by the same GH100 numbering"
    ),
    rows=(
        _Row("1g.18gb", 1, 1, 7, _P1, _ALL_1, 19),
        _Row("1g.18gb+me", 1, 1, 1, _P1_REV1, _ALL_1, 20),
        _Row("1g.35gb", 1, 2, 4, _P1_REV2, _EVEN_1_OF_2, 15),
        _Row("2g.35gb", 2, 2, 3, _P2, _EVEN_2, 14),
        _Row("3g.71gb", 3, 4, 2, _P3, _HALVES, 9),
        _Row("4g.71gb", 4, 4, 1, _P4, _ZERO, 5),
        _Row("7g.141gb", 7, 8, 1, _P7, _ZERO, 0),
    ),
)
"""H200 141GB (SXM and NVL): NVIDIA MIG User Guide, Supported MIG Profiles,
H200 table."""

#: Every GPU model in the catalog, by :attr:`GpuMigSpec.name`.
SPECS: Mapping[str, GpuMigSpec] = MappingProxyType(
    {spec.name: spec for spec in (A100_40GB, A100_80GB, A30_24GB, H100_80GB, H100_94GB, H200_141GB)}
)


def _fold(model_name: str) -> str:
    folded = " ".join(model_name.split()).casefold()
    return folded.removeprefix("nvidia ")


_BY_MODEL_NAME: Mapping[str, GpuMigSpec] = MappingProxyType(
    {_fold(model): spec for spec in SPECS.values() for model in spec.model_names}
)


def spec_for(model_name: str) -> GpuMigSpec | None:
    """The MIG geometry of the GPU NVML calls ``model_name``, or ``None``.

    Matching ignores case, repeated blanks and a leading ``NVIDIA `` (older
    drivers print ``A100-SXM4-40GB``, newer ``NVIDIA A100-SXM4-40GB``).  GPUs
    without MIG, and MIG GPUs not in the catalog, give ``None``.
    """
    return _BY_MODEL_NAME.get(_fold(model_name))


# --------------------------------------------------------------------------
# Placement rules
# --------------------------------------------------------------------------


def _resolve(spec: GpuMigSpec, profile: str | MigProfile) -> MigProfile:
    if isinstance(profile, MigProfile):
        if spec.profiles.get(profile.name) != profile:
            raise KeyError(f"{profile.name} of {profile.gpu_model} is not a profile of {spec.name}")
        return profile
    return spec.profile(profile)


def can_place(
    spec: GpuMigSpec, layout: Layout, profile: str | MigProfile, placement: Placement
) -> bool:
    """Whether a ``profile`` instance can be created at ``placement``.

    ``layout`` holds the instances already on the GPU.  The rules are those
    listed in the module docstring: an allowed start slot, no shared memory
    slice, enough compute slices, the profile's instance limit, and one
    ``+me`` instance per GPU.

    Raises:
        KeyError: ``profile`` or a profile in ``layout`` is not one of ``spec``.
    """
    wanted = _resolve(spec, profile)
    if placement not in wanted.placements:
        return False
    compute = wanted.compute_slices
    same = 0
    for name, existing in layout:
        held = _resolve(spec, name)
        if existing.overlaps(placement):
            return False
        compute += held.compute_slices
        same += held.name == wanted.name
        if wanted.media_extensions and held.media_extensions:
            return False
    return compute <= spec.compute_slices and same < wanted.max_count


def placement_problem(
    spec: GpuMigSpec, layout: Layout, profile: str | MigProfile, placement: Placement
) -> str | None:
    """Why :func:`can_place` refuses ``profile`` at ``placement``, or ``None``.

    Returns ``None`` exactly when ``can_place(spec, layout, profile,
    placement)`` is true; otherwise a short phrase naming the first rule
    broken, in the order of the module docstring, e.g.
    ``"placement 3:2 not allowed for 2g.20gb (allowed starts 0,2,4)"``,
    ``"overlaps 1g.10gb at 2:1"``, ``"needs 3 compute slices, 2 of 7 free"``,
    ``"at most 7 1g.10gb instances per GPU (7 exist)"`` or
    ``"only one media-extension (+me) instance per GPU (1g.10gb+me at 0:1
    exists)"``.  Used to explain a refusal to the user.

    Raises:
        KeyError: ``profile`` or a profile in ``layout`` is not one of ``spec``.
    """
    wanted = _resolve(spec, profile)
    if placement not in wanted.placements:
        starts = ",".join(str(p.start) for p in wanted.placements)
        return (
            f"placement {placement} not allowed for {wanted.name} "
            f"(allowed starts {starts}, size {wanted.memory_slices})"
        )
    held = [(_resolve(spec, name), existing) for name, existing in layout]
    for other, existing in held:
        if existing.overlaps(placement):
            return f"overlaps {other.name} at {existing}"
    if wanted.media_extensions:
        for other, existing in held:
            if other.media_extensions:
                return (
                    "only one media-extension (+me) instance per GPU "
                    f"({other.name} at {existing} exists)"
                )
    free = spec.compute_slices - sum(other.compute_slices for other, _ in held)
    if wanted.compute_slices > free:
        return f"needs {wanted.compute_slices} compute slices, {free} of {spec.compute_slices} free"
    same = sum(other.name == wanted.name for other, _ in held)
    if same >= wanted.max_count:
        return f"at most {wanted.max_count} {wanted.name} instances per GPU ({same} exist)"
    return None


def valid_placements(
    spec: GpuMigSpec, layout: Layout, profile: str | MigProfile
) -> list[Placement]:
    """Every placement at which ``profile`` can be created now, lowest start first."""
    wanted = _resolve(spec, profile)
    return [p for p in wanted.placements if can_place(spec, layout, wanted, p)]


def _room_left(spec: GpuMigSpec, layout: Layout) -> tuple[tuple[bool, ...], tuple[int, ...]]:
    counts = tuple(len(valid_placements(spec, layout, p)) for p in spec.profiles_largest_first)
    return tuple(count > 0 for count in counts), counts


def best_placement(spec: GpuMigSpec, layout: Layout, profile: str | MigProfile) -> Placement | None:
    """The valid placement that fragments the GPU least, or ``None``.

    Each candidate is scored by what the GPU could still take afterwards,
    for every profile from the largest to the smallest (see
    :attr:`GpuMigSpec.profiles_largest_first`): first whether each profile
    can still be placed at all (so a placement that keeps a ``4g`` or ``3g``
    possible beats one that does not), then how many placements each
    profile keeps.  Ties go to the lowest start slot.

    On an empty H100 the first ``1g.10gb`` therefore goes to slot 6: slots
    4-6 keep the ``4g`` (slots 0-3) and a ``3g`` possible, and slot 6 alone
    also keeps all three ``2g`` placements.  The NVIDIA driver's own choice
    (``nvidia-smi mig -cgi``) is not guaranteed to be the same.
    """
    wanted = _resolve(spec, profile)
    best: Placement | None = None
    best_score: tuple[tuple[bool, ...], tuple[int, ...], int] | None = None
    for candidate in valid_placements(spec, layout, wanted):
        flags, counts = _room_left(spec, [*layout, (wanted.name, candidate)])
        score = (flags, counts, -candidate.start)
        if best_score is None or score > best_score:
            best, best_score = candidate, score
    return best


def max_compute(spec: GpuMigSpec, layout: Layout) -> int:
    """The most compute slices the GPU can hold with ``layout`` in place:
    those of ``layout`` plus the best packing of further instances into the
    free slices (exhaustive over layouts, memoized by the sorted layout, so
    each reachable layout is searched once; ``+me`` profiles left out).

    A placement that lowers this number *strands* slices: on an H100 a
    ``3g`` at slot 0 leaves room for 3 more compute slices at most (slot 7
    takes no 1- or 2-slice profile), a ``3g`` at slot 4 for a ``4g`` (4).
    """
    key = tuple(sorted((name, p.start, p.size) for name, p in layout))
    return _max_compute(spec.name, key)


@functools.lru_cache(maxsize=65536)
def _max_compute(spec_name: str, key: tuple[tuple[str, int, int], ...]) -> int:
    spec = SPECS[spec_name]
    layout = [(name, Placement(start, size)) for name, start, size in key]
    used = sum(spec.profiles[name].compute_slices for name, _s, _z in key)
    best = used
    for profile in spec.profiles.values():
        if profile.media_extensions:
            continue
        for placement in valid_placements(spec, layout, profile):
            grown = tuple(sorted((*key, (profile.name, placement.start, placement.size))))
            best = max(best, _max_compute(spec_name, grown))
            if best == spec.compute_slices:
                return best
    return best


def least_stranding_placement(
    spec: GpuMigSpec, layout: Layout, profile: str | MigProfile
) -> tuple[Placement, int] | None:
    """The valid placement of ``profile`` that strands the fewest compute
    slices (:func:`max_compute` before minus after), ties broken as
    :func:`best_placement` does; with the slices it strands, or ``None``."""
    wanted = _resolve(spec, profile)
    before = max_compute(spec, layout)
    best: tuple[Placement, int] | None = None
    best_score: tuple[int, tuple[bool, ...], tuple[int, ...], int] | None = None
    for candidate in valid_placements(spec, layout, wanted):
        grown = [*layout, (wanted.name, candidate)]
        stranded = before - max_compute(spec, grown)
        flags, counts = _room_left(spec, grown)
        score = (-stranded, flags, counts, -candidate.start)
        if best_score is None or score > best_score:
            best, best_score = (candidate, stranded), score
    return best


def blocking(
    spec: GpuMigSpec, layout: Layout, profile: str | MigProfile
) -> list[tuple[str, Placement]]:
    """The existing instances whose memory slices keep ``profile`` out.

    When every allowed placement of ``profile`` overlaps at least one
    existing instance, the answer is those instances (each once, in layout
    order): the ones to wait for, or to reclaim, for a "Fragmented" wait
    reason.  When some allowed placement is free of overlap -- the profile
    fits, or is refused for another reason (compute slices, instance limit,
    ``+me``) -- memory placement is not the obstacle and the answer is ``[]``.
    """
    wanted = _resolve(spec, profile)
    for candidate in wanted.placements:
        if not any(existing.overlaps(candidate) for _name, existing in layout):
            return []
    return [
        (name, existing)
        for name, existing in layout
        if any(existing.overlaps(candidate) for candidate in wanted.placements)
    ]


def free_memory_slices(spec: GpuMigSpec, layout: Layout) -> int:
    """Memory slices no instance occupies."""
    used: set[int] = set()
    for _name, placement in layout:
        used.update(placement.slices)
    return spec.memory_slices - len(used & set(range(spec.memory_slices)))


def free_compute_slices(spec: GpuMigSpec, layout: Layout) -> int:
    """Compute slices no instance holds."""
    return spec.compute_slices - sum(_resolve(spec, name).compute_slices for name, _ in layout)


def is_fragmented(spec: GpuMigSpec, layout: Layout, profile: str | MigProfile) -> bool:
    """``profile`` does not fit although enough memory and compute slices are free.

    That is, the free slices are scattered (see :func:`blocking` for who is
    in the way).  ``False`` when it fits, or when the GPU is simply full.
    """
    wanted = _resolve(spec, profile)
    return (
        not valid_placements(spec, layout, wanted)
        and free_memory_slices(spec, layout) >= wanted.memory_slices
        and free_compute_slices(spec, layout) >= wanted.compute_slices
        and bool(blocking(spec, layout, wanted))
    )


def is_valid_layout(spec: GpuMigSpec, layout: Layout) -> bool:
    """Whether the instances in ``layout`` could all exist together on one GPU."""
    placed: list[tuple[str, Placement]] = []
    for name, placement in layout:
        if name not in spec.profiles or not can_place(spec, placed, name, placement):
            return False
        placed.append((name, placement))
    return True


# --------------------------------------------------------------------------
# MIG UUIDs
# --------------------------------------------------------------------------

#: Namespace of the name-based UUIDs made by :func:`mig_uuid`.
_MIG_UUID_NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "https://gpubroker/fake-nvml/mig-device")

_UUID_RE = re.compile(r"^MIG-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
_LEGACY_RE = re.compile(r"^MIG-GPU-[0-9a-fA-F]{8}(-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12}/\d+/\d+$")


def mig_uuid(parent_gpu_uuid: str, gi_id: int, ci_id: int, generation: int = 0) -> str:
    """A deterministic MIG device UUID in the format of R470+ drivers.

    Since the R470 datacenter drivers each MIG device (a GPU instance plus a
    compute instance) has its own UUID, ``MIG-`` followed by a standard
    8-4-4-4-12 hexadecimal UUID, e.g. ``MIG-c7384736-a75d-5afc-978f-d2f1294409fd``
    (NVIDIA MIG User Guide, MIG Device Names → CUDA Device Enumeration, and
    the ``nvidia-smi -L`` output in Getting Started with MIG).  That is the
    string ``CUDA_VISIBLE_DEVICES`` takes.  The published UUIDs all carry
    version 5 and the RFC 4122 variant; this function makes exactly such a
    name-based (SHA-1) UUID from the parent GPU UUID and the GPU-instance and
    compute-instance IDs, so the fake backend gives the same MIG device the
    same UUID on every run.  It is not the driver's own derivation, which is
    not published.

    A real driver gives a MIG device a new UUID each time one is created,
    even with the same IDs; ``generation`` (how many were created on the GPU
    before, 0 for the first) makes the fake's differ the same way.

    Older drivers (R450/R460) named MIG devices ``MIG-GPU-<gpu uuid>/<gi>/<ci>``
    instead; see :func:`legacy_mig_uuid`.
    """
    if gi_id < 0 or ci_id < 0:
        raise ValueError(f"GPU/compute instance IDs must be >= 0, got {gi_id}/{ci_id}")
    name = f"{parent_gpu_uuid.strip()}/{gi_id}/{ci_id}"
    if generation:
        name += f"#{generation}"
    return f"MIG-{uuid.uuid5(_MIG_UUID_NAMESPACE, name)}"


def legacy_mig_uuid(parent_gpu_uuid: str, gi_id: int, ci_id: int) -> str:
    """The pre-R470 MIG device name ``MIG-GPU-<gpu uuid>/<gi>/<ci>``.

    E.g. ``MIG-GPU-5c89852c-d268-c3f3-1b07-005d5ae1dc3f/7/0``; R450/R460
    drivers print it in ``nvidia-smi -L`` and accept it in
    ``CUDA_VISIBLE_DEVICES``.
    """
    parent = parent_gpu_uuid.strip()
    if not parent.startswith("GPU-"):
        raise ValueError(f"not a GPU UUID: {parent_gpu_uuid!r}")
    if gi_id < 0 or ci_id < 0:
        raise ValueError(f"GPU/compute instance IDs must be >= 0, got {gi_id}/{ci_id}")
    return f"MIG-{parent}/{gi_id}/{ci_id}"


def is_mig_uuid(value: str) -> bool:
    """Whether ``value`` is a MIG device UUID in either format."""
    value = value.strip()
    if not value.startswith("MIG-"):
        return False
    if _UUID_RE.match("MIG-" + value[4:].lower()):
        return True
    return _LEGACY_RE.match(value) is not None


def profile_for_many(profile: str, count: int) -> dict[str, str]:
    """The smallest single profile that holds ``count`` instances' worth of
    ``profile`` (compute and memory), per GPU model that offers ``profile``.

    A MIG request is one instance; someone asking for two ``1g.10gb`` on an
    H100 wants ``2g.20gb``. Profiles with media extensions are not offered.

    Args:
        profile: a profile name, e.g. ``1g.10gb``.
        count: how many of it were asked for, >= 2.

    Returns:
        model spec name → suggested profile name; models where nothing is
        large enough are left out (an empty dict when none fits).
    """
    found: dict[str, str] = {}
    for spec in SPECS.values():
        one = spec.profiles.get(profile)
        if one is None:
            continue
        fits = [
            p
            for p in spec.profiles.values()
            if not p.media_extensions
            and p.compute_slices >= count * one.compute_slices
            # slices, not the GB in the names: those are rounded (on an H100
            # NVL four 1g.12gb fit a 4g.47gb, 47 < 4 x 12)
            and p.memory_slices >= count * one.memory_slices
        ]
        if fits:
            best = min(fits, key=lambda p: (p.compute_slices, p.memory_slices, p.name))
            found[spec.name] = best.name
    return found
