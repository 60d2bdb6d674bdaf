"""What a pure-Python pinned-memory route would cost every CPU factory call, vs the C++ hooks torchtpu uses.

torch 2.13 sends ``empty(..., pin_memory=True)`` to the CPU factory kernel, which asks the
accelerator's C++ hooks for the pinned allocator (torchtpu/runtime/pinned.py). A backend with Python
hooks only could serve ``pin_memory=True`` by putting a Python kernel in front of the CPU factories:
at ``BackendSelect`` for ``empty.memory_format`` and ``empty_strided``, handing every ordinary call
on to the CPU kernel. This times CPU ``torch.empty``, ``torch.zeros`` and ``torch.empty_strided``
(small tensors: the per-call cost, not memory bandwidth) three ways, in one process:

* ``cpp_hooks``: as torchtpu runs (the C++ hooks loaded; ordinary CPU factories never reach them);
* ``python_route``: the same calls with that Python interception installed;
* ``cpp_hooks_again``: interception removed (the first figure once more: the machine's drift).

    python benchmarks/bench_pinned.py --out runs/bench_pinned.json
    python benchmarks/bench_pinned.py --quick
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import early_threads, environment, pin_threads, time_per_iter, write_json  # noqa: E402


def _python_route():
    """Python kernels at BackendSelect for the CPU factories that take ``pin_memory``; returns the library
    (``_destroy()`` removes them). Ordinary calls are handed on to the CPU kernel unchanged."""
    import torch

    cpu = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
    lib = torch.library.Library("aten", "IMPL")
    for name, op in (("empty.memory_format", torch.ops.aten.empty.memory_format),
                     ("empty_strided", torch.ops.aten.empty_strided.default)):
        def kernel(*args, op=op, **kwargs):
            if kwargs.get("pin_memory"):
                raise NotImplementedError("the pinned allocation itself is not part of this measurement")
            return op.redispatch(cpu, *args, **kwargs)
        lib.impl(name, kernel, "BackendSelect")
    return lib


def main():
    threads = early_threads()
    pin_threads(threads)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--iters", type=int, default=20000)
    ap.add_argument("--threads", type=int, default=threads)
    ap.add_argument("--out", default="runs/bench_pinned.json")
    args = ap.parse_args()
    if args.quick:
        args.repeats, args.iters = 3, 2000

    import torch

    import torchtpu  # noqa: F401
    from torchtpu.runtime import pinned

    assert pinned.pinned_hooks_active(), "build the C++ hooks first (scripts/setup.sh)"
    calls = {
        "empty": lambda: torch.empty(64),
        "zeros": lambda: torch.zeros(64),
        "empty_strided": lambda: torch.empty_strided((8, 8), (1, 8)),
    }

    def measure():
        return {name: time_per_iter(fn, iters=args.iters, repeats=args.repeats, warmup=100)["median_us"]
                for name, fn in calls.items()}

    t0 = time.time()
    results = {"cpp_hooks": measure()}
    lib = _python_route()
    assert torch.empty(3).shape == (3,)  # still works, through the Python kernel
    results["python_route"] = measure()
    lib._destroy()
    results["cpp_hooks_again"] = measure()
    ratios = {name: results["python_route"][name] / min(results["cpp_hooks"][name], results["cpp_hooks_again"][name])
              for name in calls}
    print(f"{'call':<15}{'cpp_hooks us':>14}{'python_route us':>17}{'again us':>10}{'python/cpp':>12}")
    for name in calls:
        print(f"{name:<15}{results['cpp_hooks'][name]:>14.2f}{results['python_route'][name]:>17.2f}"
              f"{results['cpp_hooks_again'][name]:>10.2f}{ratios[name]:>12.2f}")
    write_json(args.out, {"benchmark": "pinned", "quick": args.quick, "wall_s": time.time() - t0,
                          "environment": environment(args.threads), "us_per_call": results,
                          "python_over_cpp": ratios})


if __name__ == "__main__":
    main()
