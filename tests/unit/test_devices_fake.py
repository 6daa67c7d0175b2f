"""Tests of the simulated device backend and of load_backend (no GPU needed)."""

from __future__ import annotations

import json
import logging
import re

import pynvml
import pytest
from traitlets.config import Config, Configurable

from gpubroker.devices import load_backend
from gpubroker.devices.base import DeviceBackendError, ProcessInfo
from gpubroker.devices.fake import FakeDeviceBackend, fake_pci_bus_id, parse_inventory_entry
from gpubroker.devices.models import ALIASES, MODELS, lookup_model

UUID_RE = re.compile(r"^GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
PCI_RE = re.compile(r"^[0-9A-F]{8}:[0-9A-F]{2}:[0-9A-F]{2}\.[0-7]$")


def _nvml_available() -> bool:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


needs_no_nvml = pytest.mark.skipif(_nvml_available(), reason="NVML works on this machine")


def fake(*inventory: str, **kwargs: object) -> FakeDeviceBackend:
    kwargs.setdefault("node_name", "node1")
    return FakeDeviceBackend(inventory=list(inventory), **kwargs)


# --- catalog -----------------------------------------------------------------


def test_catalog_has_required_models_with_nvidia_smi_memory():
    expected = {
        "NVIDIA H100 80GB HBM3": 81559,
        "NVIDIA H100 NVL": 95830,
        "NVIDIA H200": 143771,
        "NVIDIA A100-SXM4-80GB": 81920,
        "NVIDIA A100-SXM4-40GB": 40960,
        "NVIDIA A100 80GB PCIe": 81920,
        "NVIDIA A30": 24576,
        "NVIDIA L40S": 46068,
        "NVIDIA L4": 23034,
        "Tesla T4": 15360,
        "Tesla V100-SXM2-32GB": 32768,
    }
    for name, mib in expected.items():
        assert MODELS[name].memory_total_mib == mib
    assert MODELS["NVIDIA A30"].mig_capable
    assert not MODELS["Tesla T4"].mig_capable
    assert all(target in MODELS for target in ALIASES.values())


def test_lookup_model_aliases_and_case():
    assert lookup_model("H100").name == "NVIDIA H100 80GB HBM3"
    assert lookup_model("a100-40gb").name == "NVIDIA A100-SXM4-40GB"
    assert lookup_model("nvidia  h200").name == "NVIDIA H200"
    with pytest.raises(KeyError):
        lookup_model("GeForce 256")


# --- inventory parsing -----------------------------------------------------------


@pytest.mark.parametrize(
    ("entry", "count", "name"),
    [
        ("8 x NVIDIA H100 80GB HBM3", 8, "NVIDIA H100 80GB HBM3"),
        ("2 x H100", 2, "NVIDIA H100 80GB HBM3"),
        ("2x A100-80GB", 2, "NVIDIA A100-SXM4-80GB"),
        ("4\u00d7T4", 4, "Tesla T4"),
        ("  3 X L40S ", 3, "NVIDIA L40S"),
        ("NVIDIA A30", 1, "NVIDIA A30"),
        ("L4", 1, "NVIDIA L4"),
    ],
)
def test_parse_inventory_entry(entry, count, name):
    parsed_count, model = parse_inventory_entry(entry)
    assert (parsed_count, model.name) == (count, name)


@pytest.mark.parametrize("entry", ["2 x GeForce 256", "", "3x", "0 x H100", "x H100"])
def test_bad_inventory_entry_names_entry_and_known_models(entry):
    with pytest.raises(DeviceBackendError) as info:
        parse_inventory_entry(entry)
    assert repr(entry) in str(info.value)


def test_unknown_model_error_lists_known_models():
    with pytest.raises(DeviceBackendError, match=r"known models: .*NVIDIA H100 80GB HBM3.*T4"):
        fake("2 x GeForce 256")


def test_default_inventory_is_eight_h100():
    devices = FakeDeviceBackend().devices()
    assert len(devices) == 8
    assert {d.name for d in devices} == {"NVIDIA H100 80GB HBM3"}
    assert FakeDeviceBackend.kind == "fake"
    assert FakeDeviceBackend.simulated is True


def test_mixed_entries_indices_continue_and_memory_from_catalog():
    devices = fake("2 x H100", "A100-40GB", "3 x T4").devices()
    assert [d.index for d in devices] == list(range(6))
    assert [d.name for d in devices] == (
        ["NVIDIA H100 80GB HBM3"] * 2 + ["NVIDIA A100-SXM4-40GB"] + ["Tesla T4"] * 3
    )
    assert [d.memory_total_mib for d in devices] == [81559, 81559, 40960, 15360, 15360, 15360]
    assert all(d.node == "node1" and d.mig_enabled is False for d in devices)
    assert devices[2].memory_total_gib == 40.0


def test_config_applies_through_parent():
    config = Config()
    config.FakeDeviceBackend.inventory = ["2 x H200"]
    config.FakeDeviceBackend.node_name = "gpu-a"
    parent = Configurable(config=config)
    devices = load_backend("fake", parent=parent).devices()
    assert [(d.node, d.name) for d in devices] == [("gpu-a", "NVIDIA H200")] * 2


# --- identifiers --------------------------------------------------------------------


def test_uuids_have_nvml_format_and_are_stable_and_distinct():
    first = fake("8 x H100", "8 x A30").devices()
    second = fake("8 x H100", "8 x A30").devices()
    uuids = [d.uuid for d in first]
    assert all(UUID_RE.match(u) for u in uuids), uuids
    assert uuids == [d.uuid for d in second]
    assert len(set(uuids)) == len(uuids)
    other_node = fake("8 x H100", "8 x A30", node_name="node2").devices()
    assert not set(uuids) & {d.uuid for d in other_node}


def test_pci_bus_ids_have_nvml_format_and_are_distinct():
    devices = fake("20 x L4").devices()
    ids = [d.pci_bus_id for d in devices]
    assert all(PCI_RE.match(i) for i in ids), ids
    assert len(set(ids)) == len(ids)
    assert ids[:2] == ["00000000:18:00.0", "00000000:2A:00.0"]
    assert fake_pci_bus_id(8) == "00000001:18:00.0"


# --- usage ----------------------------------------------------------------------------


def test_usage_defaults_to_idle_without_state():
    backend = fake("2 x H100", state_file="/nonexistent/dir/state.json")
    usage = backend.usage(backend.devices()[1].uuid)
    assert (usage.utilization_gpu, usage.memory_used_mib, usage.processes) == (0, 0, ())


def test_usage_unknown_uuid_raises_keyerror(tmp_path):
    backend = fake("H100", state_file=str(tmp_path / "state.json"))
    with pytest.raises(KeyError):
        backend.usage("GPU-00000000-0000-0000-0000-000000000000")
    with pytest.raises(KeyError):
        backend.set_usage("GPU-00000000-0000-0000-0000-000000000000", 10, 10)


def test_usage_is_reread_from_state_file(tmp_path):
    state = tmp_path / "state.json"
    backend = fake("2 x H100", state_file=str(state))
    uuid0, uuid1 = (d.uuid for d in backend.devices())
    entry = {
        "utilization_gpu": 80,
        "memory_used_mib": 20480,
        "processes": [{"pid": 123, "used_memory_mib": 20480}],
    }
    state.write_text(json.dumps({uuid0: entry}))
    usage = backend.usage(uuid0)
    assert usage.uuid == uuid0
    assert usage.utilization_gpu == 80
    assert usage.memory_used_mib == 20480
    assert usage.processes == (ProcessInfo(pid=123, used_memory_mib=20480),)
    assert backend.usage(uuid1).memory_used_mib == 0

    state.write_text(json.dumps({uuid0: {"utilization_gpu": 5}}))
    assert backend.usage(uuid0).utilization_gpu == 5
    assert backend.usage(uuid0).memory_used_mib == 0


def test_malformed_state_file_raises_with_path(tmp_path):
    state = tmp_path / "state.json"
    backend = fake("H100", state_file=str(state))
    uuid = backend.devices()[0].uuid
    state.write_text("{not json")
    with pytest.raises(DeviceBackendError, match=re.escape(str(state))):
        backend.usage(uuid)
    state.write_text(json.dumps([1, 2]))
    with pytest.raises(DeviceBackendError, match=re.escape(str(state))):
        backend.usage(uuid)
    state.write_text(json.dumps({uuid: {"utilization_gpu": "high"}}))
    with pytest.raises(DeviceBackendError, match="utilization_gpu"):
        backend.usage(uuid)


def test_set_usage_round_trip_through_file(tmp_path):
    state = tmp_path / "state.json"
    backend = fake("2 x A100-80GB", state_file=str(state))
    uuid0, uuid1 = (d.uuid for d in backend.devices())
    backend.set_usage(uuid0, utilization_gpu=80, processes=[{"pid": 7, "used_memory_mib": 1000}])
    backend.set_usage(uuid1, utilization_gpu=None, memory_used_mib=512)

    reader = fake("2 x A100-80GB", state_file=str(state))
    usage0 = reader.usage(uuid0)
    assert (usage0.utilization_gpu, usage0.memory_used_mib) == (80, 1000)
    assert usage0.processes == (ProcessInfo(7, 1000),)
    usage1 = reader.usage(uuid1)
    assert (usage1.utilization_gpu, usage1.memory_used_mib, usage1.processes) == (None, 512, ())
    assert json.loads(state.read_text())[uuid0]["utilization_gpu"] == 80
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]  # no temp files left

    backend.set_usage(uuid0)
    assert reader.usage(uuid0).memory_used_mib == 0


def test_set_usage_in_memory_without_state_file():
    backend = fake("H100")
    uuid = backend.devices()[0].uuid
    backend.set_usage(uuid, 42, 100, [ProcessInfo(1, 100)])
    usage = backend.usage(uuid)
    assert (usage.utilization_gpu, usage.memory_used_mib) == (42, 100)
    assert usage.processes == (ProcessInfo(1, 100),)


def test_set_usage_rejects_out_of_range_values():
    backend = fake("T4")
    uuid = backend.devices()[0].uuid
    with pytest.raises(ValueError, match="percent"):
        backend.set_usage(uuid, utilization_gpu=101)
    with pytest.raises(ValueError, match="15360"):
        backend.set_usage(uuid, memory_used_mib=15361)
    with pytest.raises(TypeError):
        backend.set_usage(uuid, utilization_gpu=1.5)  # type: ignore[arg-type]


# --- load_backend --------------------------------------------------------------------


@needs_no_nvml
def test_auto_falls_back_to_fake_and_warns_loudly(caplog):
    log = logging.getLogger("test.devices")
    with caplog.at_level(logging.WARNING, logger="test.devices"):
        backend = load_backend("auto", log=log)
    assert isinstance(backend, FakeDeviceBackend)
    assert backend.simulated
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2
    assert "NO NVIDIA DRIVER FOUND" in warnings[0]
    assert "USING SIMULATED GPUS" in warnings[1]


@needs_no_nvml
def test_nvml_without_driver_raises_backend_error():
    with pytest.raises(DeviceBackendError, match="NVML"):
        load_backend("nvml")


def test_fake_kind_says_loudly_that_gpus_are_simulated(caplog):
    log = logging.getLogger("test.devices")
    with caplog.at_level(logging.WARNING, logger="test.devices"):
        assert isinstance(load_backend("fake", log=log), FakeDeviceBackend)
    assert "USING SIMULATED GPUS" in caplog.records[-1].getMessage()


def test_unknown_kind_raises_valueerror_naming_valid_kinds():
    with pytest.raises(ValueError, match=r"'bogus'.*auto, fake, nvml"):
        load_backend("bogus")


# --- NVML backend against a stubbed pynvml (the real one runs in tests/gpu) -----------


class _Proc:
    pid = 5
    usedGpuMemory = None  # NVML reports no per-process memory, e.g. in some containers


def _not_supported(*_args: object) -> None:
    raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)


def _handle_by_uuid(uuid: str) -> int:
    if uuid != "GPU-a":
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
    return 0


@pytest.fixture
def stub_nvml(monkeypatch):
    from types import SimpleNamespace
    from unittest import mock

    shutdown = mock.Mock()
    stubs = {
        "nvmlInit": lambda: None,
        "nvmlShutdown": shutdown,
        "nvmlDeviceGetCount": lambda: 2,
        "nvmlDeviceGetHandleByIndex": lambda i: i,
        "nvmlDeviceGetUUID": lambda h: ["GPU-a", "GPU-b"][h],
        "nvmlDeviceGetName": lambda h: b"NVIDIA H200",
        "nvmlDeviceGetMemoryInfo": lambda h: SimpleNamespace(
            total=143771 * 2**20, used=3 * 2**20 + 5
        ),
        "nvmlDeviceGetPciInfo": lambda h: SimpleNamespace(busId=b"00000000:18:00.0"),
        "nvmlDeviceGetMigMode": lambda h: _not_supported() if h else [1, 0],
        "nvmlDeviceGetHandleByUUID": _handle_by_uuid,
        "nvmlDeviceGetUtilizationRates": _not_supported,
        "nvmlDeviceGetComputeRunningProcesses": lambda h: [_Proc()],
        # under MPS the users' processes are listed apart (an MPS client, and
        # the same PID again, which counts once)
        "nvmlDeviceGetMPSComputeRunningProcesses": lambda h: [
            SimpleNamespace(pid=77, usedGpuMemory=512 * 2**20),
            _Proc(),
        ],
    }
    for name, stub in stubs.items():
        monkeypatch.setattr(pynvml, name, stub)
    return shutdown


def test_nvml_backend_with_stubbed_pynvml(stub_nvml):
    from gpubroker.devices.nvml import NVMLDeviceBackend

    backend = NVMLDeviceBackend(node_name="n")
    first, second = backend.devices()
    assert (first.uuid, first.name, first.memory_total_mib) == ("GPU-a", "NVIDIA H200", 143771)
    assert first.pci_bus_id == "00000000:18:00.0"
    assert (first.mig_enabled, second.mig_enabled) == (True, False)
    usage = backend.usage("GPU-a")
    assert (usage.utilization_gpu, usage.memory_used_mib) == (None, 3)
    assert usage.processes == (
        ProcessInfo(pid=5, used_memory_mib=None),  # not reported: unknown, not 0
        ProcessInfo(pid=77, used_memory_mib=512),
    )
    with pytest.raises(KeyError):
        backend.usage("GPU-z")
    backend.close()
    backend.close()
    assert stub_nvml.call_count == 1
