"""The CPU kernel for the decode rows' attention (``csrc/decode_attention.cpp``), built at load.

A decode step's attention is one query token per row over its own KV slot. SDPA's CPU flash
kernel took half of a compiled decode step on a 10-layer model (issue 34): 2.5 to 3 ms a layer
for 32 rows of ~150 positions, in its per-(row, head) blocking around small matrix products, on
keys and values padded to the longest row with a mask. The kernel reads each (row, key/value head)'s
keys, then its values, once and only up to the row's own position, as two contiguous streams,
with no mask and no gathered copy of the rows' slots: the steps' attention 1.5 to 2 times
faster (docs/benchmarks.md, "The decode attention on a CPU").

``load`` builds it with torch's C++ extension loader (``torch.utils.cpp_extension``: a C++
compiler, as the compiled forward needs, and ninja) once per machine and source, into torch's
extension directory (``TORCH_EXTENSIONS_DIR``, by default ``~/.cache/torch_extensions``), about
10 s, then loads it in well under a second. Where it cannot be built, the engine logs why and
runs SDPA, as it does on other devices and dtypes. The op is ``torch.ops.spool_cpu.decode_attention``.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "decode_attention.cpp"
_loaded: bool | None = None  # None: not tried in this process


@contextlib.contextmanager
def _build_lock(build_dir: Path) -> Iterator[None]:
    """Hold the build directory against Spool's other processes while torch loads the kernel.

    NOTE: torch's loader marks a build with a ``lock`` file, taken at every load (it runs ninja,
    which finds the build up to date) and waited for by every other process while it exists. A
    process killed meanwhile (SIGKILL: a test's, an OOM kill) leaves the file for good, and every
    worker started after it hangs at load. An flock is dropped by the kernel when its holder dies:
    whoever holds it knows a ``lock`` file left there is a dead process's, and removes it."""
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "spool.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        (build_dir / "lock").unlink(missing_ok=True)
        yield


def load() -> bool:
    """Build (or find built) and load the kernel; False, logged, where that fails."""
    global _loaded
    if _loaded is None:
        started = time.perf_counter()
        try:
            from torch.utils import cpp_extension

            # The name carries the instruction set it is built for (-march=native): a cache
            # directory shared by different CPUs never loads another's build.
            name = f"spool_decode_attention_{torch.backends.cpu.get_cpu_capability().lower()}"
            with _build_lock(Path(cpp_extension._get_build_directory(name, False))):
                cpp_extension.load(
                    name,
                    [str(SOURCE)],
                    extra_cflags=["-O3", "-march=native", "-fopenmp"],
                    is_python_module=False,
                )
            _loaded = True
            log.info("decode attention kernel loaded in %.1f s", time.perf_counter() - started)
        except Exception as e:  # no C++ compiler (the Dockerfile's slim image), ...
            _loaded = False
            # The compiler's first complaint (a build failure's text starts with its command lines).
            lines = str(e).strip().splitlines() or [type(e).__name__]
            why = next((x for x in lines[1:] if "error" in x.lower() or "not found" in x), lines[0][:200])
            log.warning("decode attention kernel not built (%s); decoding with SDPA", why)
            log.debug("decode attention kernel build", exc_info=True)
    return _loaded
