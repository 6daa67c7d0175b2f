"""gpubroker start-up hook: framework memory caps in a share's Python processes.

This directory is put first on ``PYTHONPATH`` by
``gpubroker.enforce.caps.framework_env``, so Python's ``site`` module
imports this file as ``sitecustomize`` when any Python process of the
share starts (not under ``python -E``, ``-I`` or ``-S``). It runs inside
users' kernels: standard library only, quiet, and it never breaks an import.

1. It first runs any other ``sitecustomize`` found later on ``sys.path``
   (Python imports only the first one; e.g. Debian ships one), under the
   name ``sitecustomize``; an error there is written to standard error, as
   ``site`` itself would.
2. When ``GPUBROKER_MEMORY_LIMIT_MIB`` is set (MiB), it installs a
   ``sys.meta_path`` post-import hook:

   - ``torch``: ``torch.cuda.set_per_process_memory_fraction(fraction,
     device=i)`` for every visible device ``i`` (PyTorch docs: the caching
     allocator then refuses allocations beyond ``fraction`` of the device's
     total memory with an out-of-memory error). ``fraction`` is
     ``GPUBROKER_MEMORY_FRACTION``. Because that call initialises CUDA, it is
     queued to run when the process first initialises CUDA itself
     (``torch.cuda._lazy_call``, as ``torch.cuda.manual_seed`` does), so
     ``import torch`` alone creates no CUDA context (which would take device
     memory and break fork-based multiprocessing); without ``_lazy_call``
     it runs at import when ``torch.cuda.is_available()``.
   - ``tensorflow``: ``tf.config.set_logical_device_configuration(gpu,
     [tf.config.LogicalDeviceConfiguration(memory_limit=<MiB>)])`` for every
     physical GPU (TensorFlow GPU guide, "Limiting GPU memory growth"),
     right after import, before TensorFlow initialises its runtime.

   Any error in a hook is written to standard error as a warning; the
   user's import goes on.
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False  # no runtime import of typing: this runs in every process
if TYPE_CHECKING:
    from collections.abc import Callable
    from importlib.machinery import ModuleSpec
    from types import ModuleType
    from typing import Any

    Hook = Callable[[ModuleType], None]

_MARK = "_gpubroker_caps"


def _warn(message: str) -> None:
    """Write ``gpubroker: warning: <message>`` to standard error, never raising."""
    try:
        sys.stderr.write(f"gpubroker: warning: {message}\n")
        sys.stderr.flush()
    except Exception:
        pass


# -- 1. chain to the next sitecustomize on sys.path ---------------------------------


def _real(entry: str) -> str:
    """The real path of a ``sys.path`` entry (``''`` is the current directory)."""
    try:
        return os.path.realpath(entry or os.getcwd())
    except Exception:
        return entry


def _chain() -> None:
    """Run the next ``sitecustomize`` on ``sys.path`` after this file's directory."""
    import importlib.machinery
    import importlib.util

    me = os.path.realpath(__file__)
    here = os.path.dirname(me)
    entries = [p for p in sys.path if isinstance(p, str)]
    reals = [_real(p) for p in entries]
    start = reals.index(here) + 1 if here in reals else 0
    rest = [entries[i] for i in range(start, len(entries)) if reals[i] != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    if spec.origin and os.path.realpath(spec.origin) == me:
        return
    module = importlib.util.module_from_spec(spec)
    ours = sys.modules.get("sitecustomize")
    sys.modules["sitecustomize"] = module  # as if it had been imported first
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        _warn(f"error in {spec.origin} (sitecustomize): {type(err).__name__}: {err}")
    finally:
        if ours is not None:
            sys.modules["sitecustomize"] = ours


# -- 2. post-import hooks --------------------------------------------------------------


class _HookedLoader:
    """Wraps a module's loader: runs the real ``exec_module``, puts the real
    loader back on the module, then runs the hook (errors only warned)."""

    def __init__(self, loader: Any, name: str, hook: Hook) -> None:
        self._loader = loader
        self._name = name
        self._hook = hook

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._loader, attr)

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        create = getattr(self._loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        try:
            module.__loader__ = self._loader
            spec = getattr(module, "__spec__", None)
            if spec is not None:
                spec.loader = self._loader
        except Exception:
            pass
        _run_hook(self._name, self._hook, module)


def _run_hook(name: str, hook: Hook, module: ModuleType) -> None:
    try:
        hook(module)
    except Exception as err:
        _warn(f"could not cap {name} memory: {type(err).__name__}: {err}")


class _CapFinder:
    """A ``sys.meta_path`` finder that finds nothing itself: for a hooked
    name it asks the other finders and wraps the found loader."""

    _gpubroker_caps = True

    def __init__(self, hooks: dict[str, Hook]) -> None:
        self.hooks = dict(hooks)

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> ModuleSpec | None:
        hook = self.hooks.get(fullname)
        if hook is None:
            return None
        spec: ModuleSpec | None = None
        for finder in list(sys.meta_path):  # as the import system would, without us
            find = getattr(finder, "find_spec", None)
            if finder is self or getattr(finder, _MARK, False) or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                break
        if spec is None:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        del self.hooks[fullname]
        spec.loader = _HookedLoader(loader, fullname, hook)  # type: ignore[assignment]  # duck-typed Loader
        return spec

    def invalidate_caches(self) -> None:
        pass


def _torch_hook(fraction: float) -> Hook:
    def cap(torch: Any) -> None:
        cuda = torch.cuda

        def apply() -> None:
            try:
                for index in range(cuda.device_count()):
                    cuda.set_per_process_memory_fraction(fraction, device=index)
            except Exception as err:  # raising here would fail the user's CUDA init
                _warn(f"could not cap torch memory: {type(err).__name__}: {err}")

        lazy = getattr(cuda, "_lazy_call", None)
        if lazy is not None and not cuda.is_initialized():
            lazy(apply)
        elif cuda.is_available():
            apply()

    return cap


def _tensorflow_hook(limit_mib: int) -> Hook:
    def cap(tf: Any) -> None:
        config = tf.config
        for gpu in config.list_physical_devices("GPU"):
            try:
                config.set_logical_device_configuration(
                    gpu, [config.LogicalDeviceConfiguration(memory_limit=limit_mib)]
                )
            except Exception as err:
                name = getattr(gpu, "name", gpu)
                _warn(f"could not cap tensorflow memory on {name}: {type(err).__name__}: {err}")

    return cap


def _install() -> None:
    """Install the post-import hooks when ``GPUBROKER_MEMORY_LIMIT_MIB`` is set."""
    raw = os.environ.get("GPUBROKER_MEMORY_LIMIT_MIB", "").strip()
    if not raw:
        return
    if any(getattr(f, _MARK, False) for f in sys.meta_path):
        return
    try:
        limit_mib = int(raw)
        if limit_mib < 1:
            raise ValueError("below 1")
    except ValueError:
        _warn(f"GPUBROKER_MEMORY_LIMIT_MIB={raw!r} is not a positive integer; no caps")
        return
    hooks: dict[str, Hook] = {"tensorflow": _tensorflow_hook(limit_mib)}
    raw_fraction = os.environ.get("GPUBROKER_MEMORY_FRACTION", "").strip()
    try:
        fraction = float(raw_fraction)
        if not 0.0 < fraction <= 1.0:
            raise ValueError("outside (0, 1]")
        hooks["torch"] = _torch_hook(fraction)
    except ValueError:
        _warn(f"GPUBROKER_MEMORY_FRACTION={raw_fraction!r} is not in (0, 1]; torch not capped")
    ready = {name: hook for name, hook in hooks.items() if name in sys.modules}
    for name, hook in ready.items():  # imported before us (unusual): cap now
        _run_hook(name, hook, sys.modules[name])
    finder = _CapFinder({n: h for n, h in hooks.items() if n not in ready})
    sys.meta_path.insert(0, finder)


try:
    _chain()
except Exception as _err:
    _warn(f"could not run the next sitecustomize: {type(_err).__name__}: {_err}")
try:
    _install()
except Exception as _err:
    _warn(f"could not install memory caps: {type(_err).__name__}: {_err}")
