"""Framework caps: the environment, and the start-up hook in real Python
processes (and a real IPython kernel) with stand-in ``torch`` and
``tensorflow`` packages that record the calls made to them (the real
frameworks with a GPU are not installable here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from jupyter_client.manager import start_new_kernel

from gpubroker.enforce.caps import STARTUP_DIR, framework_env, memory_fraction

# -- the environment -------------------------------------------------------------------


def test_the_cuda_context_is_left_out_of_the_allocators_cap() -> None:
    from gpubroker.enforce.caps import allocator_mib

    env = framework_env(10240, 81559, context_mib=512)
    assert env["GPUBROKER_MEMORY_LIMIT_MIB"] == "9728"
    assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == env["GPUBROKER_MEMORY_FRACTION"] == "0.119275"
    # a share too small for a context keeps half of itself for the allocator
    assert allocator_mib(256, 512) == 128 and allocator_mib(1024, 0) == 1024
    with pytest.raises(ValueError, match="must be at most device_memory_mib"):
        framework_env(90000, 81559, context_mib=10000)


def test_framework_env_values() -> None:
    env = framework_env(10240, 81559)
    assert env == {
        "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.125553",
        "XLA_CLIENT_MEM_FRACTION": "0.125553",
        "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
        "TF_FORCE_GPU_ALLOW_GROWTH": "true",
        "GPUBROKER_MEMORY_LIMIT_MIB": "10240",
        "GPUBROKER_MEMORY_FRACTION": "0.125553",
        "PYTHONPATH": STARTUP_DIR,
    }
    assert Path(STARTUP_DIR, "sitecustomize.py").is_file()


@pytest.mark.parametrize(
    ("memory", "device", "fraction"),
    [
        (40960, 81920, "0.500000"),
        (81920, 81920, "1.000000"),
        (81919, 81920, "0.999987"),
        (1, 1000, "0.001000"),
        (1999, 1000 * 1000, "0.001999"),
        (512, 143771, "0.003561"),  # a 1 GiB share's allocator on an H200 (was 0.003)
        (24576, 97871, "0.251106"),
    ],
)
def test_memory_fraction_rounds_down(memory: int, device: int, fraction: str) -> None:
    assert memory_fraction(memory, device) == fraction


@given(st.integers(1, 2**20), st.integers(1, 2**20))
def test_memory_fraction_never_exceeds_the_share(a: int, b: int) -> None:
    memory, device = min(a, b), max(a, b)
    if memory * 10**6 < device:
        return  # under a millionth: refused, see below
    value = memory_fraction(memory, device)
    assert len(value.split(".")[1]) == 6
    assert int(value.replace(".", "")) * device <= memory * 10**6  # exact: never above
    assert (int(value.replace(".", "")) + 1) * device > memory * 10**6  # largest such


def test_pythonpath_keeps_existing_entries_after_the_startup_dir() -> None:
    sep = os.pathsep
    env = framework_env(1024, 8192, existing_pythonpath=f"/a{sep}{sep}/b{sep}{STARTUP_DIR}")
    assert env["PYTHONPATH"] == sep.join([STARTUP_DIR, "/a", "/b"])
    assert framework_env(1024, 8192, existing_pythonpath="")["PYTHONPATH"] == STARTUP_DIR


@pytest.mark.parametrize(
    ("memory", "device", "field"),
    [
        (0, 8192, "memory_mib"),
        (-1, 8192, "memory_mib"),
        (1.5, 8192, "memory_mib"),
        (True, 8192, "memory_mib"),
        (1024, 0, "device_memory_mib"),
        (1024, "8192", "device_memory_mib"),
        (8193, 8192, "at most device_memory_mib"),
        (1, 2 * 10**6, "at least a millionth"),
    ],
)
def test_framework_env_rejects_bad_sizes(memory: int, device: int, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        framework_env(memory, device)


# -- the start-up hook in real processes -------------------------------------------------

TORCH_CUDA = '''
"""Stand-in torch.cuda: records calls; ``init()`` runs queued lazy calls as torch does."""
import json, os

_queued = []
_initialized = False


def _record(*call):
    with open(os.environ["STANDIN_LOG"], "a") as f:
        f.write(json.dumps(call) + "\\n")


def is_available():
    _record("is_available")
    return True


def is_initialized():
    return _initialized


def device_count():
    return int(os.environ.get("STANDIN_DEVICES", "1"))


def _lazy_call(callable, **kwargs):
    _record("lazy_call")
    if _initialized:
        callable()
    else:
        _queued.append(callable)


def init():
    global _initialized
    if _initialized:
        return
    _initialized = True
    _record("cuda_init")
    for call in _queued:
        call()


def set_per_process_memory_fraction(fraction, device=None):
    if os.environ.get("STANDIN_FAIL"):
        raise RuntimeError("stand-in torch refuses")
    _record("set_per_process_memory_fraction", fraction, device)


if os.environ.get("STANDIN_NO_LAZY"):
    del _lazy_call
'''

TF_CONFIG = '''
"""Stand-in tensorflow.config: records calls."""
import json, os


def _record(*call):
    with open(os.environ["STANDIN_LOG"], "a") as f:
        f.write(json.dumps(call) + "\\n")


class PhysicalDevice:
    def __init__(self, name, device_type):
        self.name, self.device_type = name, device_type


class LogicalDeviceConfiguration:
    def __init__(self, memory_limit=None, experimental_priority=None):
        self.memory_limit = memory_limit


def list_physical_devices(device_type=None):
    count = int(os.environ.get("STANDIN_DEVICES", "1"))
    return [PhysicalDevice(f"/physical_device:GPU:{i}", "GPU") for i in range(count)]


def set_logical_device_configuration(device, logical_devices):
    if os.environ.get("STANDIN_FAIL"):
        raise RuntimeError("stand-in tensorflow refuses")
    _record(
        "set_logical_device_configuration",
        device.name,
        [c.memory_limit for c in logical_devices],
    )
'''

OTHER_SITECUSTOMIZE = """
import json, os, sys
with open(os.environ["STANDIN_LOG"], "a") as f:
    f.write(json.dumps(["other_sitecustomize", __name__]) + "\\n")
if os.environ.get("STANDIN_OTHER_FAIL"):
    raise RuntimeError("the other sitecustomize fails")
"""


@pytest.fixture
def fakes(tmp_path: Path) -> Path:
    """A directory with stand-in torch and tensorflow, and another
    sitecustomize in a directory after it."""
    root = tmp_path / "fakes"
    (root / "torch").mkdir(parents=True)
    (root / "torch" / "__init__.py").write_text("from . import cuda\n__version__ = '0.0'\n")
    (root / "torch" / "cuda.py").write_text(TORCH_CUDA)
    (root / "tensorflow").mkdir()
    (root / "tensorflow" / "__init__.py").write_text("from . import config\n")
    (root / "tensorflow" / "config.py").write_text(TF_CONFIG)
    other = tmp_path / "other"
    other.mkdir()
    (other / "sitecustomize.py").write_text(OTHER_SITECUSTOMIZE)
    return tmp_path


def hook_env(tmp_path: Path, caps: bool = True, **extra: str) -> dict[str, str]:
    """The kernel's environment: the broker's env for a 10 GiB share of an
    80 GiB device, the fakes on PYTHONPATH and the other sitecustomize after them."""
    base = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    existing = os.pathsep.join([str(tmp_path / "fakes"), str(tmp_path / "other")])
    if caps:
        base.update(framework_env(10240, 81920, existing_pythonpath=existing))
    else:
        base["PYTHONPATH"] = os.pathsep.join([STARTUP_DIR, existing])
    base["STANDIN_LOG"] = str(tmp_path / "calls.jsonl")
    base["STANDIN_DEVICES"] = "2"
    base.update(extra)
    return base


def run_python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def calls(tmp_path: Path) -> list[list[object]]:
    log = tmp_path / "calls.jsonl"
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines()]


def test_torch_is_capped_when_cuda_initialises(fakes: Path) -> None:
    proc = run_python(
        """
        import torch
        import json, os
        with open(os.environ["STANDIN_LOG"], "a") as f:
            f.write(json.dumps(["imported"]) + "\\n")
        torch.cuda.init()
        """,
        hook_env(fakes),
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    assert calls(fakes) == [
        ["other_sitecustomize", "sitecustomize"],
        ["lazy_call"],
        ["imported"],  # import torch alone does not initialise CUDA
        ["cuda_init"],
        ["set_per_process_memory_fraction", 0.125, 0],
        ["set_per_process_memory_fraction", 0.125, 1],
    ]


def test_torch_without_lazy_call_is_capped_at_import(fakes: Path) -> None:
    proc = run_python("import torch", hook_env(fakes, STANDIN_NO_LAZY="1"))
    assert proc.returncode == 0, proc.stderr
    assert calls(fakes)[1:] == [
        ["is_available"],
        ["set_per_process_memory_fraction", 0.125, 0],
        ["set_per_process_memory_fraction", 0.125, 1],
    ]


def test_tensorflow_gets_a_logical_device_limit_per_gpu(fakes: Path) -> None:
    proc = run_python("import tensorflow as tf\nprint(tf.config.__name__)", hook_env(fakes))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "tensorflow.config"
    assert calls(fakes)[1:] == [
        ["set_logical_device_configuration", "/physical_device:GPU:0", [10240]],
        ["set_logical_device_configuration", "/physical_device:GPU:1", [10240]],
    ]


def test_hooked_modules_keep_their_own_loader_and_other_imports_work(fakes: Path) -> None:
    proc = run_python(
        """
        import importlib.machinery, sys
        import json, email.mime.text  # unrelated imports are untouched
        import torch.cuda, tensorflow
        for mod in (torch, tensorflow):
            assert type(mod.__loader__) is importlib.machinery.SourceFileLoader, mod.__loader__
            assert mod.__spec__.loader is mod.__loader__
        assert sys.modules["sitecustomize"].__file__.startswith(sys.argv[1]), sys.argv[1]
        import torch as again
        assert again is torch
        print("ok")
        """.replace("sys.argv[1]", repr(STARTUP_DIR)),
        hook_env(fakes),
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


def test_failing_caps_warn_and_never_break_the_import(fakes: Path) -> None:
    proc = run_python(
        """
        import torch, tensorflow
        torch.cuda.init()
        print("imported", torch.__version__, tensorflow.config.__name__)
        """,
        hook_env(fakes, STANDIN_FAIL="1"),
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "imported 0.0 tensorflow.config"
    assert "gpubroker: warning: could not cap torch memory: RuntimeError" in proc.stderr
    assert "could not cap tensorflow memory on /physical_device:GPU:0" in proc.stderr
    assert "could not cap tensorflow memory on /physical_device:GPU:1" in proc.stderr


def test_a_hook_that_raises_on_a_broken_framework_only_warns(fakes: Path) -> None:
    # a "torch" whose cuda attribute is missing: the hook itself raises
    (fakes / "fakes" / "torch" / "__init__.py").write_text("__version__ = 'broken'\n")
    proc = run_python("import torch\nprint(torch.__version__)", hook_env(fakes))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "broken"
    assert "gpubroker: warning: could not cap torch memory: AttributeError" in proc.stderr


def test_no_caps_without_the_limit_but_the_other_sitecustomize_still_runs(fakes: Path) -> None:
    proc = run_python("import torch, tensorflow\ntorch.cuda.init()", hook_env(fakes, caps=False))
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    assert calls(fakes) == [["other_sitecustomize", "sitecustomize"], ["cuda_init"]]


def test_a_failing_other_sitecustomize_is_reported_and_caps_still_apply(fakes: Path) -> None:
    proc = run_python("import tensorflow", hook_env(fakes, STANDIN_OTHER_FAIL="1"))
    assert proc.returncode == 0, proc.stderr
    assert "gpubroker: warning: error in" in proc.stderr
    assert "the other sitecustomize fails" in proc.stderr
    assert [c[0] for c in calls(fakes)] == ["other_sitecustomize"] + [
        "set_logical_device_configuration"
    ] * 2


def test_a_bad_limit_warns_and_caps_nothing(fakes: Path) -> None:
    proc = run_python("import tensorflow", hook_env(fakes, GPUBROKER_MEMORY_LIMIT_MIB="lots"))
    assert proc.returncode == 0, proc.stderr
    assert "GPUBROKER_MEMORY_LIMIT_MIB='lots' is not a positive integer" in proc.stderr
    assert calls(fakes) == [["other_sitecustomize", "sitecustomize"]]


def test_a_real_kernel_gets_the_caps(fakes: Path) -> None:
    km, kc = start_new_kernel(kernel_name="python3", startup_timeout=60, env=hook_env(fakes))
    try:
        reply = kc.execute_interactive(
            "import torch, tensorflow\ntorch.cuda.init()", timeout=60, store_history=False
        )
        assert reply["content"]["status"] == "ok"
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    seen = calls(fakes)
    assert ["other_sitecustomize", "sitecustomize"] in seen
    assert ["set_per_process_memory_fraction", 0.125, 0] in seen
    assert ["set_per_process_memory_fraction", 0.125, 1] in seen
    assert ["set_logical_device_configuration", "/physical_device:GPU:1", [10240]] in seen
