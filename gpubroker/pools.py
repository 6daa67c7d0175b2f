"""Pools: named sets of devices with one sharing mode and a purpose.

An admin lists pools in ``Pools.pools``; each device goes to the first pool
whose selectors match it, else to the default pool (exclusive, interactive).
Selectors::

    "*"                    every device
    "GPU-8f6c…"            one device by NVML UUID
    "node-a:0-3"           devices 0 to 3 of node-a (indices: "0-3,6")
    "*:4-7"                devices 4 to 7 of every node
    "model=H100"           every device of a model: an alias of the fake
                           backend's catalog, else any device whose NVML
                           name contains the text (case-insensitive)
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from traitlets import Dict, List, TraitError, Unicode, observe, validate
from traitlets.config import LoggingConfigurable

from .devices.models import lookup_model
from .scheduler import PoolMode

PURPOSES = ("interactive", "batch")
MIG_LAYOUTS = ("on-demand", "static")
_KEYS = {"name", "mode", "purpose", "devices", "reserve_gib", "mig_layout", "description"}
_NODE_INDICES = re.compile(r"^(?P<node>[^:=]+):(?P<ranges>\d+(-\d+)?(,\d+(-\d+)?)*)$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


@dataclass(frozen=True)
class PoolSpec:
    """One pool as configured.

    Attributes:
        name: pool name (letters, digits, ``_.-``; at most 64).
        mode: ``exclusive``, ``mig`` or ``timeslice``.
        purpose: ``interactive`` or ``batch``.
        selectors: device selectors (module docstring).
        reserve_mib: ``timeslice`` only: memory per device never handed out
            as shares, MiB.
        mig_layout: ``mig`` only: ``on-demand`` (the broker creates and
            destroys instances) or ``static`` (the instances present on the
            device are handed out as they are).
        description: free text for admins and the spawn form.
    """

    name: str
    mode: str = PoolMode.exclusive.value
    purpose: str = "interactive"
    selectors: tuple[str, ...] = ("*",)
    reserve_mib: int = 0
    mig_layout: str = "on-demand"
    description: str = ""


def _ranges(text: str) -> list[tuple[int, int]]:
    """``"0-3,6"`` -> ``[(0, 3), (6, 6)]`` (inclusive bounds)."""
    bounds = []
    for part in text.split(","):
        first, _, last = part.partition("-")
        bounds.append((int(first), int(last or first)))
    return bounds


def _in_ranges(index: int, text: str) -> bool:
    return any(low <= index <= high for low, high in _ranges(text))


def check_selector(selector: str) -> None:
    """Raise ``ValueError`` naming ``selector`` when it is not of a known form."""
    match = _NODE_INDICES.match(selector)
    if match is not None:
        for low, high in _ranges(match["ranges"]):
            if low > high:
                raise ValueError(f"bad index range {low}-{high} in selector {selector!r}")
        return
    if selector == "*" or selector.startswith("GPU-"):
        return
    if selector.startswith("model="):
        if not selector.removeprefix("model=").strip():
            raise ValueError(f"empty model in selector {selector!r}")
        return
    raise ValueError(
        f"bad device selector {selector!r}: expected '*', 'GPU-<uuid>', '<node>:<indices>'"
        " or 'model=<name>'"
    )


def matches(selector: str, uuid: str, node: str, index: int, model: str) -> bool:
    """Whether ``selector`` picks the device (``uuid``, ``node``, ``index``, NVML ``model``)."""
    if selector == "*":
        return True
    if selector.startswith("GPU-"):
        return selector == uuid
    if selector.startswith("model="):
        wanted = selector.removeprefix("model=")
        try:
            return lookup_model(wanted).name == model
        except KeyError:  # a model the simulator does not know: match the NVML name
            return " ".join(wanted.split()).casefold() in " ".join(model.split()).casefold()
    match = _NODE_INDICES.match(selector)
    if match is None:
        return False
    return match["node"] in ("*", node) and _in_ranges(index, match["ranges"])


def parse_pool(item: Any, where: str) -> PoolSpec:
    """A ``Pools.pools`` entry (a dict) -> :class:`PoolSpec`.

    Raises:
        ValueError: unknown keys, missing or bad name, unknown mode or
            purpose, bad selectors, negative reserve; the message names
            ``where`` and the field.
    """
    if not isinstance(item, dict):
        raise ValueError(f"{where}: must be a dict, got {item!r}")
    unknown = sorted(set(item) - _KEYS)
    if unknown:
        raise ValueError(f"{where}.{unknown[0]}: unknown key (allowed: {', '.join(sorted(_KEYS))})")
    name = item.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"{where}.name: must be 1-64 letters, digits, '_', '.', '-'; got {name!r}")
    mode = item.get("mode", PoolMode.exclusive.value)
    if mode not in {m.value for m in PoolMode}:
        raise ValueError(f"{where}.mode: must be exclusive, mig or timeslice; got {mode!r}")
    purpose = item.get("purpose", "interactive")
    if purpose not in PURPOSES:
        raise ValueError(f"{where}.purpose: must be one of {PURPOSES}; got {purpose!r}")
    selectors = item.get("devices", ["*"])
    if isinstance(selectors, str) or not isinstance(selectors, list | tuple):
        raise ValueError(f"{where}.devices: must be a list of selectors, got {selectors!r}")
    for selector in selectors:
        try:
            check_selector(str(selector))
        except ValueError as err:
            raise ValueError(f"{where}.devices: {err}") from None
    reserve = item.get("reserve_gib", 0)
    if isinstance(reserve, bool) or not isinstance(reserve, int | float) or reserve < 0:
        raise ValueError(f"{where}.reserve_gib: must be a number >= 0, got {reserve!r}")
    layout = item.get("mig_layout", "on-demand")
    if layout not in MIG_LAYOUTS:
        raise ValueError(f"{where}.mig_layout: must be one of {MIG_LAYOUTS}; got {layout!r}")
    return PoolSpec(
        name=name,
        mode=mode,
        purpose=purpose,
        selectors=tuple(str(s) for s in selectors),
        reserve_mib=int(reserve * 1024),
        mig_layout=layout,
        description=str(item.get("description", "")),
    )


class Pools(LoggingConfigurable):
    """The broker's pools (see the admin guide, "Pools and GPU sharing")."""

    pools = List(
        Dict(),
        help="""Pools, each a dict: name, mode ("exclusive", "mig" or
        "timeslice"), purpose ("interactive" or "batch"), devices (selectors:
        "\\*" for all, "GPU-<uuid>", "<node>:<indices>" such as "gpu-a:0-3",
        "\\*:4-7" for indices 4-7 of every node, or "model=H100"),
        reserve_gib (timeslice: GiB per device never handed out as shares,
        default 0), mig_layout (mig: "on-demand", the default, or
        "static"), description. A device goes to the first pool that
        selects it; devices no pool selects go to the pool named
        `default_pool` (exclusive unless configured here).""",
    ).tag(config=True)

    default_pool = Unicode(
        "default",
        help="""Name of the exclusive, interactive pool of devices no entry
        of `pools` selects.""",
    ).tag(config=True)

    @validate("pools")
    def _check_pools(self, proposal: Any) -> list[dict[str, Any]]:
        names: set[str] = set()
        for i, item in enumerate(proposal["value"]):
            try:
                spec = parse_pool(item, f"Pools.pools[{i}]")
            except ValueError as err:
                raise TraitError(str(err)) from None
            if spec.name in names:
                raise TraitError(f"Pools.pools[{i}].name: {spec.name!r} is used twice")
            names.add(spec.name)
        return list(proposal["value"])

    @observe("pools", "default_pool")
    def _forget_specs(self, change: Any) -> None:
        self._specs = None

    def _configured(self) -> list[PoolSpec]:
        """The configured pools, parsed once per configuration."""
        if getattr(self, "_specs", None) is None:
            self._specs = [
                parse_pool(item, f"Pools.pools[{i}]") for i, item in enumerate(self.pools)
            ]
        return list(self._specs)

    def specs(self) -> list[PoolSpec]:
        """Every pool, the configured ones first, then the default pool."""
        configured = self._configured()
        if all(spec.name != self.default_pool for spec in configured):
            configured.append(PoolSpec(self.default_pool))
        return configured

    def spec(self, name: str) -> PoolSpec | None:
        """The pool called ``name``, or ``None``."""
        return next((s for s in self.specs() if s.name == name), None)

    def assign(self, devices: Iterable[tuple[str, str, int, str]]) -> dict[str, PoolSpec]:
        """The pool of each device, keyed by UUID.

        Args:
            devices: ``(uuid, node, index, NVML model name)`` of each device.
        """
        default = next(s for s in self.specs() if s.name == self.default_pool)
        configured = self._configured()
        result = {}
        for uuid, node, index, model in devices:
            result[uuid] = next(
                (
                    spec
                    for spec in configured
                    if any(matches(sel, uuid, node, index, model) for sel in spec.selectors)
                ),
                default,
            )
        return result
