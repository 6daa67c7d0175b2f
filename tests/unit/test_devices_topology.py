"""Tests of GPU interconnect topology: the pure helpers, the fake and base
backends, and the NVML backend against a stubbed pynvml (no GPU needed)."""

from __future__ import annotations

from itertools import combinations
from types import SimpleNamespace

import pynvml
import pytest

from gpubroker.devices.base import DeviceBackend, DeviceBackendError, DeviceInfo, DeviceUsage
from gpubroker.devices.fake import FakeDeviceBackend
from gpubroker.devices.topology import (
    LinkLevel,
    dgx_like,
    uniform,
    validate,
    worst_link,
)

# --- LinkLevel -----------------------------------------------------------------------


def test_link_levels_mirror_nvml_topology_levels():
    assert LinkLevel.SELF == 0
    assert LinkLevel.NVLINK == 5
    assert LinkLevel.PCIE_SWITCH == pynvml.NVML_TOPOLOGY_SINGLE
    assert LinkLevel.PCIE_MULTI == pynvml.NVML_TOPOLOGY_MULTIPLE
    assert LinkLevel.HOSTBRIDGE == pynvml.NVML_TOPOLOGY_HOSTBRIDGE
    assert LinkLevel.NUMA_NODE == pynvml.NVML_TOPOLOGY_NODE
    assert LinkLevel.SYSTEM == pynvml.NVML_TOPOLOGY_SYSTEM
    assert list(LinkLevel) == sorted(LinkLevel)  # declared closest first


# --- uniform / validate ------------------------------------------------------------------


def test_uniform_has_self_diagonal_and_level_elsewhere():
    matrix = uniform(3, LinkLevel.PCIE_MULTI)
    assert matrix == ((0, 20, 20), (20, 0, 20), (20, 20, 0))
    assert all(isinstance(v, LinkLevel) for row in matrix for v in row)
    assert validate(matrix) == matrix
    assert uniform(0, LinkLevel.SYSTEM) == ()
    assert uniform(1, LinkLevel.SYSTEM) == ((0,),)


@pytest.mark.parametrize(
    ("n", "level", "message"),
    [(-1, LinkLevel.SYSTEM, ">= 0"), (2, LinkLevel.SELF, "SELF"), (2, 7, "not a link level")],
)
def test_uniform_rejects_bad_arguments(n, level, message):
    with pytest.raises(ValueError, match=message):
        uniform(n, level)


def test_validate_accepts_lists_and_returns_link_levels():
    matrix = validate([[0, 5], [5, 0]])
    assert matrix == ((LinkLevel.SELF, LinkLevel.NVLINK), (LinkLevel.NVLINK, LinkLevel.SELF))
    assert isinstance(matrix, tuple) and isinstance(matrix[0], tuple)
    assert isinstance(matrix[0][1], LinkLevel)
    assert validate([]) == ()


@pytest.mark.parametrize(
    ("matrix", "message"),
    [
        ([[0, 5], [5]], r"not square: row 1 has 1 entries, not 2"),
        ([[0, 5, 5], [5, 0, 5]], r"not square: row 0 has 3 entries, not 2"),
        ([[0, 7], [7, 0]], r"entry \[0\]\[1\] is 7, not a link level \(SELF=0, NVLINK=5"),
        ([[0, "5"], [5, 0]], r"entry \[0\]\[1\] is '5'"),
        ([[0, True], [True, 0]], r"entry \[0\]\[1\] is True"),
        ([[0, 5], [5, 10]], r"diagonal entry \[1\]\[1\] is PCIE_SWITCH \(10\), not SELF"),
        ([[0, 5], [10, 0]], r"not symmetric: \[0\]\[1\] is NVLINK \(5\) but \[1\]\[0\] is PCIE"),
        ([[0, 0], [0, 0]], r"entry \[0\]\[1\] is SELF \(0\) between distinct GPUs"),
    ],
)
def test_validate_names_the_problem(matrix, message):
    with pytest.raises(ValueError, match=message):
        validate(matrix)


def test_worst_link_is_the_gangs_bottleneck():
    matrix = dgx_like(8)
    assert worst_link(matrix, []) == LinkLevel.SELF
    assert worst_link(matrix, [5]) == LinkLevel.SELF
    assert worst_link(matrix, [0, 1, 2, 3]) == LinkLevel.NVLINK
    assert worst_link(matrix, [4, 7, 7]) == LinkLevel.NVLINK
    assert worst_link(matrix, [0, 1, 2, 4]) == LinkLevel.SYSTEM
    for bad in ([0, 8], [-1, 0]):
        with pytest.raises(IndexError):
            worst_link(matrix, bad)


# --- dgx_like ------------------------------------------------------------------------------


def test_dgx_like_eight_gpus():
    matrix = dgx_like()
    assert validate(matrix) == matrix  # square, symmetric, SELF diagonal
    assert len(matrix) == 8
    islands = [range(0, 4), range(4, 8)]
    for island in islands:
        for i, j in combinations(island, 2):
            assert matrix[i][j] == LinkLevel.NVLINK, (i, j)
    for i in islands[0]:
        for j in islands[1]:
            assert matrix[i][j] == LinkLevel.SYSTEM, (i, j)
    for i in (0, 2, 4, 6):
        assert matrix[i][i + 1] <= LinkLevel.PCIE_SWITCH
    # placement matters: a 4-GPU gang inside an island beats one across islands
    assert worst_link(matrix, [4, 5, 6, 7]) < worst_link(matrix, [2, 3, 4, 5])


@pytest.mark.parametrize("n", [0, 1, 2, 3, 4, 5, 6, 7, 9, 12, 16])
def test_dgx_like_generalises_to_islands_of_four(n):
    matrix = dgx_like(n)
    assert validate(matrix) == matrix
    assert len(matrix) == n
    for i, j in combinations(range(n), 2):
        expected = LinkLevel.NVLINK if i // 4 == j // 4 else LinkLevel.SYSTEM
        assert matrix[i][j] == expected, (n, i, j)
        if i // 2 == j // 2:
            assert matrix[i][j] <= LinkLevel.PCIE_SWITCH


def test_dgx_like_rejects_negative_count():
    with pytest.raises(ValueError, match=">= 0"):
        dgx_like(-1)


# --- fake and base backends ----------------------------------------------------------------


def test_fake_topology_defaults_to_dgx():
    backend = FakeDeviceBackend(node_name="n")
    assert backend.topology_model == "dgx"
    assert backend.topology() == dgx_like(8)


def test_fake_topology_uniform():
    backend = FakeDeviceBackend(
        node_name="n", inventory=["4 x A100-80GB"], topology_model="uniform"
    )
    assert backend.topology() == uniform(4, LinkLevel.PCIE_MULTI)


def test_fake_topology_rejects_unknown_model():
    from traitlets import TraitError

    with pytest.raises(TraitError):
        FakeDeviceBackend(node_name="n", topology_model="torus")


@pytest.mark.parametrize("model", ["dgx", "uniform"])
def test_fake_topology_spans_all_inventory_entries(model):
    backend = FakeDeviceBackend(
        node_name="n", inventory=["3 x H100", "3 x A30"], topology_model=model
    )
    matrix = backend.topology()
    assert len(matrix) == len(backend.devices()) == 6
    assert validate(matrix) == matrix
    if model == "dgx":
        assert matrix == dgx_like(6)
        assert matrix[0][3] == LinkLevel.NVLINK  # island 0-3 spans both entries
        assert matrix[3][4] == LinkLevel.SYSTEM
    else:
        assert matrix == uniform(6, LinkLevel.PCIE_MULTI)


def test_fake_topology_model_from_config():
    from traitlets.config import Config, Configurable

    from gpubroker.devices import load_backend

    config = Config()
    config.FakeDeviceBackend.inventory = ["2 x H100"]
    config.FakeDeviceBackend.topology_model = "uniform"
    backend = load_backend("fake", parent=Configurable(config=config))
    assert backend.topology() == ((0, 20), (20, 0))


class _MinimalBackend(DeviceBackend):
    """A backend that implements only the abstract methods."""

    def devices(self) -> list[DeviceInfo]:
        return [DeviceInfo("n", i, f"GPU-{i}", "X", 1024, f"0:{i}") for i in range(3)]

    def usage(self, uuid: str) -> DeviceUsage:
        return DeviceUsage(uuid, 0, 0)


def test_base_topology_defaults_to_all_system():
    matrix = _MinimalBackend().topology()
    assert matrix == uniform(3, LinkLevel.SYSTEM)
    assert [matrix[i][i] for i in range(3)] == [0, 0, 0]
    assert validate(matrix) == matrix


# --- NVML backend against a stubbed pynvml --------------------------------------------------

BUSES = ["00000000:18:00.0", "00000000:2A:00.0", "00000000:3A:00.0", "00000000:5D:00.0"]
SWITCH_BUS = "00000000:C1:00.0"
GPU, SWITCH = pynvml.NVML_NVLINK_DEVICE_TYPE_GPU, pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH

#: (handle, link) -> (remote device type, remote bus id, active?)
#: GPU 0 link 0: NVLink bridge to GPU 1, seen only from GPU 0 (legacy 4-digit
#: domain, lower case); GPU 0 link 1: an inactive link to GPU 3;
#: GPUs 2 and 3: active links to an NVSwitch. GPU 1: NVLink not supported.
LINKS = {
    (0, 0): (GPU, b"0000:2a:00.0", True),
    (0, 1): (GPU, BUSES[3], False),
    (2, 0): (SWITCH, SWITCH_BUS, True),
    (2, 1): (SWITCH, SWITCH_BUS, True),
    (3, 5): (SWITCH, SWITCH_BUS, True),
}
#: PCIe common ancestors of pairs without NVLink; missing pair: not supported
ANCESTORS = {
    (0, 2): pynvml.NVML_TOPOLOGY_SINGLE,
    (0, 3): pynvml.NVML_TOPOLOGY_INTERNAL,
    (1, 2): pynvml.NVML_TOPOLOGY_NODE,
    (2, 3): pynvml.NVML_TOPOLOGY_HOSTBRIDGE,  # only used when switches are not recognised
}
MAX_LINKS = 18  # links past the device's last one: NVML_ERROR_INVALID_ARGUMENT


def _error(code: int) -> pynvml.NVMLError:
    return pynvml.NVMLError(code)


def _link(handle: int, link: int) -> tuple[int, str | bytes, bool] | None:
    if handle == 1:
        raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
    if link >= MAX_LINKS:
        raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    return LINKS.get((handle, link))


def _link_state(handle: int, link: int) -> int:
    entry = _link(handle, link)
    active = entry is not None and entry[2]
    return pynvml.NVML_FEATURE_ENABLED if active else pynvml.NVML_FEATURE_DISABLED


def _remote_pci(handle: int, link: int) -> SimpleNamespace:
    entry = _link(handle, link)
    if entry is None:
        raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    return SimpleNamespace(busId=entry[1])


def _remote_type(handle: int, link: int) -> int:
    entry = _link(handle, link)
    if entry is None:
        raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    return entry[0]


def _ancestor(first: int, second: int) -> int:
    key = (min(first, second), max(first, second))
    if key not in ANCESTORS:
        raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
    return ANCESTORS[key]


def _forbidden(name: str):
    def call(*_args: object) -> None:
        raise AssertionError(f"topology() must be read-only but called {name}")

    return call


@pytest.fixture
def nvml_topology(monkeypatch):
    """Stub pynvml with four GPUs; every setter/reset call fails the test."""
    for name in dir(pynvml):
        if name.startswith(("nvmlDeviceSet", "nvmlDeviceReset", "nvmlDeviceClear")):
            monkeypatch.setattr(pynvml, name, _forbidden(name))
    stubs = {
        "nvmlInit": lambda: None,
        "nvmlShutdown": lambda: None,
        "nvmlDeviceGetCount": lambda: len(BUSES),
        "nvmlDeviceGetHandleByIndex": lambda i: i,
        "nvmlDeviceGetPciInfo": lambda h: SimpleNamespace(busId=BUSES[h].encode()),
        "nvmlDeviceGetNvLinkState": _link_state,
        "nvmlDeviceGetNvLinkRemotePciInfo": _remote_pci,
        "nvmlDeviceGetNvLinkRemoteDeviceType": _remote_type,
        "nvmlDeviceGetTopologyCommonAncestor": _ancestor,
    }
    for name, stub in stubs.items():
        monkeypatch.setattr(pynvml, name, stub)
    from gpubroker.devices.nvml import NVMLDeviceBackend

    backend = NVMLDeviceBackend(node_name="n")
    yield backend
    backend.close()


def test_nvml_topology_nvlink_nvswitch_and_pcie(nvml_topology):
    matrix = nvml_topology.topology()
    assert validate(matrix) == matrix
    S, NV, PIX, NODE, SYS = 0, 5, 10, 40, 50
    # 0-1: NVLink bridge seen from GPU 0 only; 0-2: SINGLE; 0-3: link inactive,
    # INTERNAL -> PCIE_SWITCH; 1-2: NODE; 1-3: ancestor not supported -> SYSTEM;
    # 2-3: both NVLinked to NVSwitches
    assert matrix == (
        (S, NV, PIX, PIX),
        (NV, S, NODE, SYS),
        (PIX, NODE, S, NV),
        (PIX, SYS, NV, S),
    )


def test_nvml_topology_without_remote_device_type(nvml_topology, monkeypatch):
    monkeypatch.delattr(pynvml, "nvmlDeviceGetNvLinkRemoteDeviceType")
    matrix = nvml_topology.topology()
    assert matrix[0][1] == LinkLevel.NVLINK
    assert matrix[2][3] == LinkLevel.HOSTBRIDGE  # switch not recognised: PCIe level


def test_nvml_topology_unknown_ancestor_level_is_system(nvml_topology, monkeypatch):
    monkeypatch.setattr(pynvml, "nvmlDeviceGetTopologyCommonAncestor", lambda a, b: 99)
    matrix = nvml_topology.topology()
    assert matrix[0][2] == LinkLevel.SYSTEM
    assert matrix[0][1] == matrix[2][3] == LinkLevel.NVLINK


def test_nvml_topology_wraps_other_nvml_errors(nvml_topology, monkeypatch):
    def unknown(*_args: object) -> int:
        raise _error(pynvml.NVML_ERROR_UNKNOWN)

    monkeypatch.setattr(pynvml, "nvmlDeviceGetTopologyCommonAncestor", unknown)
    with pytest.raises(DeviceBackendError, match="NVML: cannot read the GPU topology"):
        nvml_topology.topology()


def test_pci_key_normalises_domain_width_and_case():
    from gpubroker.devices.nvml import _pci_key

    assert _pci_key(b"0000:2a:00.0") == _pci_key("00000000:2A:00.0") == "00000000:2A:00.0"
    assert _pci_key(" weird ") == "WEIRD"
