"""Test-only shims that let fla's Triton kernels run under Triton's CPU interpreter (TRITON_INTERPRET=1),
so the CPU suite checks what our wrappers hand fla (tests/test_mixer_kernels_fla.py). Imported only in
a subprocess that set TRITON_INTERPRET=1 before importing triton; never by the library.

Why each one: the interpreter has no benchmarker, so an autotuned kernel takes its first config; it
turns a scalar kernel argument into a one-element array, which `range(T)` cannot index; and its
`range` yields Python ints, on which fla's kernels call `.to(tl.int64)` as compiled code allows."""
from __future__ import annotations

import builtins
import sys

import numpy as np
import triton.language as tl
import triton.runtime.autotuner as autotuner
import triton.runtime.interpreter as interpreter


def _first_config(self, *args, config, **kwargs):
    return [float(self.configs.index(config))] * 3  # the lowest "time" is the first config's


def _tensor_range(*args):
    for i in builtins.range(*(int(a) for a in args)):
        yield tl.core.tensor(interpreter.TensorHandle(np.array([i], dtype=np.int32), tl.int32), tl.int32)


def install(*packages: str, prefix: str = "fla.ops.") -> None:
    """Patch the interpreter, import `packages` (fla's op packages), and give every loaded module under
    `prefix` the interpreter's range."""
    autotuner.Autotuner._bench = _first_config
    autotuner.Autotuner.check_disk_cache = lambda self, key, configs, bench: (bench(), False)[1]
    patch_tensor = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched
    for package in packages:
        __import__(package)
    for name in [m for m in sys.modules if m.startswith(prefix)]:
        sys.modules[name].range = _tensor_range
