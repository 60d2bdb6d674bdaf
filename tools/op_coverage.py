"""Run PyTorch's OpInfo database on tpu against CPU and write a coverage report.

For every OpInfo entry (``torch.testing._internal.common_methods_invocations.op_db``)
and every dtype asked for (float32, bfloat16, int64, bool by default) that CPU
supports, the op's first few sample inputs run on CPU and on tpu; results are
compared with ``torch.testing.assert_close``. Each (op, dtype) is classified:

* ``pass``     every sample matches CPU with the CPU fallback OFF (pure tpu lowerings);
* ``fallback`` it needs the CPU fallback (the ops that fell back are named), and
               matches CPU with it on;
* ``xfail``    it fails even with the fallback on; the reason says why. A result
               that differs from CPU is reported as ``WRONG RESULT`` (the summary
               counts these separately: the goal is none);
* ``skip``     CPU does not support the dtype, or produced no usable sample.

Ops run in worker subprocesses, so a crash or a hang costs one (op, dtype), never
the run: the parent kills a worker that exceeds ``--timeout`` seconds on one entry
and records a timeout.

    OMP_NUM_THREADS=1 python tools/op_coverage.py --out docs/op_coverage.md
    python tools/op_coverage.py --ops add,sum,cat --dtypes float32 --out /tmp/cov.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback

DTYPE_NAMES = ("float32", "bfloat16", "int64", "bool")

# Ops whose values are random or uninitialized: only shape, dtype and device are
# compared (PyTorch's own OpInfo tests skip value checks for these too).
NONDETERMINISTIC = {
    "bernoulli", "cauchy", "exponential", "geometric", "log_normal", "normal", "normal.in_place",
    "normal.number_mean", "uniform", "multinomial", "rand_like", "randint", "randint_like", "randn",
    "randn_like", "nn.functional.dropout", "nn.functional.dropout2d", "nn.functional.dropout3d",
    "nn.functional.alpha_dropout", "nn.functional.feature_alpha_dropout.with_train",
    "nn.functional.rrelu", "nn.functional.fractional_max_pool2d", "nn.functional.fractional_max_pool3d",
    "empty", "empty_like", "empty_strided", "empty_permuted", "new_empty", "new_empty_strided",
    "svd_lowrank", "pca_lowrank", "nn.functional.multi_head_attention_forward",
}

# Ops whose results are only defined up to sign/ordering conventions that differ
# between LAPACK and XLA: outputs are checked by shape/dtype, and the op's own
# reconstruction is not available here, so these are marked in the report.
_SHAPE_ONLY_REASON = "values random or uninitialized: shape/dtype/device compared"


_NO_DTYPE = "CPU does not support this dtype"

# Why each OpInfo entry that does not pass (float32, bfloat16, int64) does not, as the report's
# "Not passing, and why" section states it. An entry missing here is reported as "no reason
# recorded" (tests/core/test_opinfo.py fails on that): a new failure must be explained.
WHY_NOT = {
    "_upsample_bilinear2d_aa": "no lowering yet for antialiased bilinear resampling (PyTorch's decomposition "
                               "covers only the .vec overload, which calls this one)",
    "chalf": "complex32 has no XLA type: refused at creation with a TypeError naming the dtype",
    "grid_sampler_3d": "no lowering yet (grid_sampler_2d is lowered)",
    "linalg.eig": "XLA's nonsymmetric eigendecomposition runs on the CPU backend only, not on TPUs: kept on the "
                  "CPU fallback",
    "linalg.eigvals": "XLA's nonsymmetric eigendecomposition runs on the CPU backend only, not on TPUs: kept on "
                      "the CPU fallback",
    "linalg.eigh": "eigenvectors are defined up to sign, and XLA and LAPACK choose different signs",
    "linalg.ldl_factor": "no LDL^T (Bunch-Kaufman) factorization in XLA or JAX",
    "linalg.ldl_factor_ex": "no LDL^T (Bunch-Kaufman) factorization in XLA or JAX",
    "linalg.ldl_solve": "no LDL^T (Bunch-Kaufman) factorization in XLA or JAX",
    "linalg.lstsq": "not lowered yet: whether residuals are returned depends on the computed rank (an output "
                    "shape that depends on values)",
    "linalg.lstsq.grad_oriented": "not lowered yet: whether residuals are returned depends on the computed rank "
                                  "(an output shape that depends on values)",
    "matrix_exp": "float32: XLA's Pade scaling-and-squaring differs from CPU's by 5e-4 on one element; "
                  "bfloat16: jax.scipy.linalg.expm refuses bfloat16",
    "nn.functional.ctc_loss": "no lowering yet (the alpha recursion over time as a scan)",
    "nn.functional.fractional_max_pool2d": "no lowering yet (pooling regions drawn at random per call)",
    "nn.functional.fractional_max_pool3d": "no lowering yet (pooling regions drawn at random per call)",
    "sparse.mm.reduce": "sparse CSR tensors are not supported on tpu",
    "sparse.sampled_addmm": "sparse CSR tensors are not supported on tpu",
    "to_sparse": "sparse COO tensors are not supported on tpu",
    **{f"special.{n}": "no JAX implementation with PyTorch's (Cephes) accuracy: jax.scipy.special.bessel_jn "
                       "returns NaN for |x| above ~20, and there is no Y, K or Airy function"
       for n in ("airy_ai", "bessel_j0", "bessel_j1", "bessel_y0", "bessel_y1", "modified_bessel_k0",
                 "modified_bessel_k1", "scaled_modified_bessel_k0", "scaled_modified_bessel_k1")},
}
WHY_DTYPES = ("float32", "bfloat16", "int64")


def _tolerances(dtype):
    import torch

    if dtype in (torch.float32, torch.complex64):
        return dict(rtol=1e-4, atol=1e-4)
    if dtype == torch.float64 or dtype == torch.complex128:
        return dict(rtol=1e-7, atol=1e-7)
    if dtype == torch.bfloat16:
        return dict(rtol=2e-2, atol=2e-2)
    if dtype == torch.float16:
        return dict(rtol=2e-3, atol=2e-3)
    return dict(rtol=0, atol=0)


# Per-op tolerance overrides (rtol, atol) for float32, each with its reason.
_OP_TOL = {
    # ill-conditioned near poles / large arguments: XLA's and CPU's libm round differently
    "tan": (1e-3, 1e-3),
    "lgamma": (1e-3, 1e-3),
    "digamma": (1e-3, 1e-3),
    "polygamma.polygamma_n_1": (1e-3, 1e-3),
    "polygamma.polygamma_n_2": (1e-3, 1e-3),
    "polygamma.polygamma_n_3": (1e-3, 1e-3),
    "polygamma.polygamma_n_4": (1e-3, 1e-3),
    "mvlgamma.mvlgamma_p_1": (1e-3, 1e-3),
    "mvlgamma.mvlgamma_p_3": (1e-3, 1e-3),
    "mvlgamma.mvlgamma_p_5": (1e-3, 1e-3),
    "erfinv": (1e-3, 1e-3),
    "special.ndtri": (1e-3, 1e-3),
    "special.zeta": (1e-3, 1e-3),
    "pow": (1e-3, 1e-3),
    "__rpow__": (1e-3, 1e-3),
    "float_power": (1e-3, 1e-3),
    # float32 products and cumulative sums/products accumulate rounding differently
    "prod": (1e-3, 1e-3),
    "cumprod": (1e-3, 1e-3),
    "masked.cumprod": (1e-3, 1e-3),
    "masked.prod": (1e-3, 1e-3),
    "cumsum": (1e-3, 1e-3),
    "logcumsumexp": (1e-3, 1e-3),
    # matrix products accumulate in a different order
    "addmm": (1e-3, 1e-3), "addmm.decomposed": (1e-3, 1e-3), "addmv": (1e-3, 1e-3),
    "addbmm": (1e-3, 1e-3), "baddbmm": (1e-3, 1e-3), "bmm": (1e-3, 1e-3), "mm": (1e-3, 1e-3),
    "matmul": (1e-3, 1e-3), "__rmatmul__": (1e-3, 1e-3), "einsum": (1e-3, 1e-3),
    "tensordot": (1e-3, 1e-3), "inner": (1e-3, 1e-3), "dot": (1e-3, 1e-3), "vdot": (1e-3, 1e-3),
    "mv": (1e-3, 1e-3), "kron": (1e-3, 1e-3), "linalg.multi_dot": (1e-3, 1e-3),
    "var": (1e-3, 1e-3), "std": (1e-3, 1e-3), "var_mean": (1e-3, 1e-3), "std_mean": (1e-3, 1e-3),
    "var.unbiased": (1e-3, 1e-3), "std.unbiased": (1e-3, 1e-3), "var_mean.unbiased": (1e-3, 1e-3),
    "std_mean.unbiased": (1e-3, 1e-3), "cov": (1e-3, 1e-3), "corrcoef": (1e-3, 1e-3),
}


# ---------------------------------------------------------------------------- worker side
def _setup_worker():
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # the lowerings are what is measured: no op may run through the compile-storm policy's CPU path
    os.environ["TORCHTPU_STORM_EXECUTABLES"] = "0"
    import warnings

    warnings.filterwarnings("ignore")
    import torch

    import torchtpu  # noqa: F401

    torch.set_num_threads(1)
    from torch.testing._internal.common_methods_invocations import op_db

    return op_db


def _full_name(op):
    return op.name + ("." + op.variant_test_name if op.variant_test_name else "")


class _Mismatch(Exception):
    pass


def _to_tpu(x):
    import torch

    if isinstance(x, torch.Tensor):
        if x.device.type == "cpu":
            if x._base is not None and x.layout == torch.strided:
                # a view keeps its place in its base's storage (as_strided with an explicit
                # storage_offset reads outside the view), as a sample built on tpu would
                base = x._base.detach().to("tpu")
                y = base.as_strided(x.shape, x.stride(), x.storage_offset())
            else:
                y = x.detach().to("tpu")
            return y.requires_grad_(x.requires_grad) if x.requires_grad and x.is_leaf else y
        return x
    if isinstance(x, torch.device) and x.type == "cpu":
        return torch.device("tpu")
    return x


def _map(fn, obj):
    from torch.utils import _pytree as pytree

    return pytree.tree_map(fn, obj)


# Ops whose positional arguments PyTorch requires on the CPU (as it does for cuda):
# op name -> argument positions (after the input) left on the CPU.
_CPU_ARGS = {"tensor_split": (0,)}


def _to_tpu_arg(x):
    if isinstance(x, str) and x == "cpu":  # a device given as a string ("cpu" -> "tpu")
        return "tpu"
    return _to_tpu(x)


def _move_sample(sample, name=""):
    """Sample (input, args, kwargs) with every CPU tensor / device moved to tpu."""
    inp = _map(_to_tpu, sample.input)
    keep = _CPU_ARGS.get(name, ())
    args = tuple(a if i in keep else _map(_to_tpu_arg, a) for i, a in enumerate(sample.args))
    kwargs = _map(_to_tpu_arg, dict(sample.kwargs))
    return inp, args, kwargs


def _compare(name, expected, actual, shape_only, tol_override):
    import torch
    from torch.utils import _pytree as pytree

    exp_leaves, exp_spec = pytree.tree_flatten(expected)
    act_leaves, act_spec = pytree.tree_flatten(actual)
    if len(exp_leaves) != len(act_leaves):
        raise _Mismatch(f"structure differs: cpu {exp_spec} vs tpu {act_spec}")
    for i, (e, a) in enumerate(zip(exp_leaves, act_leaves)):
        where = f"output {i}" if len(exp_leaves) > 1 else "output"
        if isinstance(e, torch.Tensor):
            if not isinstance(a, torch.Tensor):
                raise _Mismatch(f"{where}: cpu gives a tensor, tpu gives {type(a).__name__}")
            if e.device.type == "cpu" and a.device.type != "tpu":
                raise _Mismatch(f"{where}: result is on {a.device}, expected tpu")
            if a.dtype != e.dtype:
                raise _Mismatch(f"{where}: dtype {a.dtype} != cpu's {e.dtype}")
            if tuple(a.shape) != tuple(e.shape):
                raise _Mismatch(f"{where}: shape {tuple(a.shape)} != cpu's {tuple(e.shape)}")
            if shape_only:
                continue
            a_cpu = a.detach().cpu()
            e = e.detach()
            if e.is_complex() or a_cpu.is_complex():
                pass
            tol = _tolerances(e.dtype)
            if tol_override is not None and e.dtype in (torch.float32, torch.complex64):
                tol = dict(rtol=tol_override[0], atol=tol_override[1])
            try:
                torch.testing.assert_close(a_cpu, e, equal_nan=True, check_device=False,
                                           check_stride=False, **tol)
            except AssertionError as err:
                msg = " ".join(str(err).split())
                raise _Mismatch(f"{where}: {msg[:300]}") from None
        elif isinstance(e, float):
            if not isinstance(a, (float, int)):
                raise _Mismatch(f"{where}: cpu gives {e!r}, tpu gives {a!r}")
            if not shape_only and not (abs(e - a) <= 1e-4 + 1e-4 * abs(e) or (e != e and a != a)):
                raise _Mismatch(f"{where}: cpu gives {e!r}, tpu gives {a!r}")
        else:
            if isinstance(e, torch.device):
                continue
            if not shape_only and e != a and not (isinstance(e, torch.dtype) and e == a):
                raise _Mismatch(f"{where}: cpu gives {e!r}, tpu gives {a!r}")


def _arg(sample, pos, name, default):
    """Argument ``name`` of a sample: positional ``pos`` (after the input) or keyword."""
    if name in sample.kwargs:
        return sample.kwargs[name]
    return sample.args[pos] if len(sample.args) > pos else default


# Ops whose indices are only defined up to ties (PyTorch documents that the index of
# an equal element is unspecified; CPU's comes from an unstable partial sort): their
# indices are checked by what they point at, not by position.
# name -> (position of dim in args, position of keepdim in args or None, default dim)
_TIE_INDEX_OPS = {
    "kthvalue": (1, 2, -1),
    "median": (0, 1, None),
    "nanmedian": (0, 1, None),
    "mode": (0, 1, -1),
    "topk": (1, None, -1),
    "sort": (0, None, -1),
    "argsort": (0, None, -1),
}


def _check_tie_indices(name, sample, expected, actual, tol_override):
    """Compare (values, indices) outputs of ``_TIE_INDEX_OPS``: values exactly as usual;
    indices must select those values from the input. Returns False if not applicable."""
    import torch

    spec = _TIE_INDEX_OPS.get(name)
    if spec is None or not isinstance(sample.input, torch.Tensor) or sample.input.dim() == 0:
        return False
    dpos, kpos, ddef = spec
    dim = _arg(sample, dpos, "dim", ddef)
    if dim is None:
        return False
    if name in ("sort", "argsort") and _arg(sample, 99, "stable", False):
        return False  # a stable sort has exactly one right answer
    keepdim = True if kpos is None else _arg(sample, kpos, "keepdim", False)
    inp = sample.input
    if name == "argsort":
        if actual.device.type != "tpu" or actual.dtype != expected.dtype or actual.shape != expected.shape:
            raise _Mismatch(f"indices: {actual.dtype}{tuple(actual.shape)} on {actual.device} != cpu's "
                            f"{expected.dtype}{tuple(expected.shape)}")
        try:
            torch.testing.assert_close(inp.gather(dim, actual.cpu()), inp.gather(dim, expected),
                                       rtol=0, atol=0, equal_nan=True)
        except AssertionError as err:
            raise _Mismatch("indices do not sort the input: " + " ".join(str(err).split())[:200]) from None
        return True
    e_vals, e_idx = expected[0], expected[1]
    a_vals, a_idx = actual[0], actual[1]
    _compare(name, e_vals, a_vals, False, tol_override)
    if a_idx.dtype != e_idx.dtype or tuple(a_idx.shape) != tuple(e_idx.shape):
        raise _Mismatch(f"indices: {a_idx.dtype}{tuple(a_idx.shape)} != cpu's {e_idx.dtype}{tuple(e_idx.shape)}")
    idx = a_idx.detach().cpu()
    vals = e_vals
    if not keepdim:
        idx, vals = idx.unsqueeze(dim), vals.unsqueeze(dim)
    if idx.numel() and (idx.min() < 0 or idx.max() >= inp.shape[dim]):
        raise _Mismatch("indices: out of range")
    picked = inp.gather(dim, idx)
    try:
        torch.testing.assert_close(picked, vals, rtol=0, atol=0, equal_nan=True)
    except AssertionError as err:
        raise _Mismatch("indices do not select the values: " + " ".join(str(err).split())[:200]) from None
    return True


def _precise_reference(op, sample, expected):
    """CPU result of ``sample`` computed in higher precision (float32 -> float64,
    bfloat16/float16 -> float32) and rounded back to the expected output dtypes; None
    if the op does not run that way. XLA often rounds once where CPU rounds at each
    step, so a tpu result may be closer to the exact value than CPU's own."""
    import torch
    from torch.utils import _pytree as pytree

    up = {torch.float32: torch.float64, torch.bfloat16: torch.float32, torch.float16: torch.float32}

    def lift(x):
        if isinstance(x, torch.Tensor) and x.dtype in up:
            return x.to(up[x.dtype])
        return x

    try:
        with torch.no_grad():
            out = op(_map(lift, sample.input), *_map(lift, tuple(sample.args)), **_map(lift, dict(sample.kwargs)))
    except Exception:  # noqa: BLE001
        return None
    exp_leaves, exp_spec = pytree.tree_flatten(expected)
    out_leaves, out_spec = pytree.tree_flatten(out)
    if len(exp_leaves) != len(out_leaves):
        return None
    fixed = []
    for e, o in zip(exp_leaves, out_leaves):
        if isinstance(e, torch.Tensor) and isinstance(o, torch.Tensor):
            if o.shape != e.shape:
                return None
            o = o.to(e.dtype)
        fixed.append(o)
    return pytree.tree_unflatten(fixed, exp_spec)


def _run_samples(op, samples, expected, fallback, shape_only, tol_override):
    """Run ``samples`` on tpu; raise on the first error or mismatch.
    Returns (ops that fell back, samples that matched only the higher-precision reference)."""
    import torch

    import torchtpu

    name = _full_name(op)
    torchtpu.set_cpu_fallback(fallback)
    before = dict(torchtpu.metrics.snapshot()["cpu_fallbacks"])
    precise = 0
    try:
        for sample, exp in zip(samples, expected):
            inp, args, kwargs = _move_sample(sample, name)
            with torch.no_grad():
                out = op(inp, *args, **kwargs)
            try:
                if not _check_tie_indices(name, sample, exp, out, tol_override):
                    # a sample with dropout draws random values: shapes only, as for NONDETERMINISTIC
                    random_sample = (sample.kwargs.get("dropout_p") or 0) > 0
                    _compare(name, exp, out, shape_only or random_sample, tol_override)
            except _Mismatch as first:
                alt = _precise_reference(op, sample, exp)
                if alt is None:
                    raise
                try:
                    if not _check_tie_indices(name, sample, alt, out, tol_override):
                        _compare(name, alt, out, shape_only, tol_override)
                except _Mismatch:
                    raise first from None
                precise += 1
    finally:
        torchtpu.set_cpu_fallback(True)
    after = torchtpu.metrics.snapshot()["cpu_fallbacks"]
    return sorted(k for k, v in after.items() if v != before.get(k, 0)), precise


def _precise_note(n):
    return f"; {n} matched the higher-precision result rather than CPU's rounding" if n else ""


def _short(err):
    msg = " ".join(str(err).split())
    return f"{type(err).__name__}: {msg[:240]}"


def _is_no_lowering(err):
    return isinstance(err, NotImplementedError) and "CPU fallback is off" in str(err)


def _missing_op(err):
    # "torchtpu: no tpu lowering for aten::foo and CPU fallback is off"
    s = str(err)
    i = s.find("no tpu lowering for ")
    return s[i + len("no tpu lowering for "):].split()[0] if i >= 0 else "?"


def classify(op, dtype, max_samples):
    """(status, reason) for one OpInfo entry and dtype."""
    import torch

    name = _full_name(op)
    if dtype not in op.supported_dtypes("cpu"):
        return "skip", _NO_DTYPE
    torch.manual_seed(0)
    try:
        samples = []
        for s in op.sample_inputs("cpu", dtype, requires_grad=False):
            samples.append(s)
            if len(samples) >= max_samples:
                break
    except Exception as e:  # noqa: BLE001
        return "skip", "sample generation failed on CPU: " + _short(e)
    expected = []
    kept = []
    for s in samples:
        try:
            with torch.no_grad():
                expected.append(op(s.input, *s.args, **s.kwargs))
            kept.append(s)
        except Exception:  # noqa: BLE001
            continue  # a sample CPU itself rejects says nothing about tpu
    if not kept:
        return "skip", "no sample input runs on CPU"
    shape_only = name in NONDETERMINISTIC
    tol = _OP_TOL.get(name)
    note = f" ({_SHAPE_ONLY_REASON})" if shape_only else ""
    try:
        _, precise = _run_samples(op, kept, expected, False, shape_only, tol)
        return "pass", f"{len(kept)} samples{note}{_precise_note(precise)}"
    except _Mismatch as e:
        return "xfail", f"WRONG RESULT (no fallback): {e}"
    except Exception as e:  # noqa: BLE001
        first = e
    if not _is_no_lowering(first):
        return "xfail", "error: " + _short(first)
    missing = _missing_op(first)
    try:
        fell, precise = _run_samples(op, kept, expected, True, shape_only, tol)
    except _Mismatch as e:
        return "xfail", f"WRONG RESULT (with fallback for {missing}): {e}"
    except Exception as e:  # noqa: BLE001
        return "xfail", f"error (with fallback for {missing}): " + _short(e)
    return "fallback", "falls back: " + ", ".join(fell or [missing]) + _precise_note(precise)


def worker(task_file, result_file, max_samples):
    op_db = _setup_worker()
    import torch

    with open(task_file) as f:
        tasks = json.load(f)
    with open(result_file, "a", buffering=1) as out:
        for idx, dname in tasks:
            op = op_db[idx]
            out.write(json.dumps({"begin": [idx, dname], "t": time.time()}) + "\n")
            t0 = time.time()
            try:
                status, reason = classify(op, getattr(torch, dname), max_samples)
            except BaseException as e:  # noqa: BLE001
                status, reason = "xfail", "harness error: " + _short(e)
                traceback.print_exc()
            out.write(json.dumps({"done": [idx, dname], "status": status, "reason": reason,
                                  "secs": round(time.time() - t0, 2)}) + "\n")


# ---------------------------------------------------------------------------- parent side
def _select(op_db, ops, exclude):
    sel = []
    for i, op in enumerate(op_db):
        n = _full_name(op)
        if ops and n not in ops and op.name not in ops:
            continue
        if exclude and (n in exclude or op.name in exclude):
            continue
        sel.append(i)
    return sel


def run_all(args):
    from torch.testing._internal.common_methods_invocations import op_db

    ops = set(args.ops.split(",")) if args.ops else None
    exclude = set(args.exclude.split(",")) if args.exclude else None
    indices = _select(op_db, ops, exclude)
    dnames = args.dtypes.split(",")
    tasks = [(i, d) for i in indices for d in dnames]
    names = {i: _full_name(op_db[i]) for i in indices}
    results: dict = {}
    tmp = tempfile.mkdtemp(prefix="op_coverage_")
    result_file = os.path.join(tmp, "results.jsonl")
    open(result_file, "w").close()
    pending = list(tasks)
    pos = 0  # how far the results file has been read (workers append to it)
    failed_starts = 0
    t_start = time.time()
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    if args.execution_mode:
        env["TORCHTPU_EXECUTION_MODE"] = args.execution_mode
    while pending:
        chunk = pending[: args.chunk]
        task_file = os.path.join(tmp, "tasks.json")
        with open(task_file, "w") as f:
            json.dump(chunk, f)
        log = open(os.path.join(tmp, "worker.log"), "a")
        proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--worker", task_file, result_file,
             "--max-samples", str(args.max_samples)],
            stdout=log, stderr=subprocess.STDOUT, env=env,
        )
        current, since = None, time.time()
        done_before = len(results)
        while True:
            rc = proc.poll()
            with open(result_file) as f:
                f.seek(pos)
                data = f.read()
            lines = data.split("\n")
            # keep a trailing partial line for the next read
            pos += len(data) - len(lines[-1])
            for line in lines[:-1]:
                rec = json.loads(line)
                if "begin" in rec:
                    current, since = tuple(rec["begin"]), time.time()
                else:
                    key = tuple(rec["done"])
                    results[key] = (rec["status"], rec["reason"])
                    current = None
                    if args.verbose:
                        print(f"{names[key[0]]:40s} {key[1]:9s} {rec['status']:8s} {rec['secs']:6.1f}s "
                              f"{rec['reason'][:110]}", flush=True)
            if rc is not None:
                break
            if current is not None and time.time() - since > args.timeout:
                proc.kill()
                proc.wait()
                break
            time.sleep(0.2)
        log.close()
        if done_before == len(results) and current is None:
            # the worker died before finishing anything: retry a few times, then give up
            failed_starts += 1
            if failed_starts >= 3:
                raise SystemExit(f"op_coverage: workers keep dying at start; see {tmp}/worker.log")
            time.sleep(2)
            continue
        failed_starts = 0
        if current is not None and current not in results:
            why = "timeout" if proc.returncode in (-9,) else f"worker died (exit {proc.returncode})"
            results[current] = ("xfail", f"{why} after {time.time() - since:.0f}s")
            if args.verbose:
                print(f"{names[current[0]]:40s} {current[1]:9s} xfail    {why}", flush=True)
        pending = [t for t in pending if tuple(t) not in results]
        done = len(tasks) - len(pending)
        print(f"[{time.time() - t_start:7.0f}s] {done}/{len(tasks)} done", file=sys.stderr, flush=True)
    rows = [(names[i], d, *results[(i, d)]) for i, d in tasks]
    write_report(args.out, rows, dnames, time.time() - t_start, args)
    return rows


def summarize(rows, dnames):
    summary = {}
    for d in dnames:
        rs = [r for r in rows if r[1] == d]
        counts = {s: sum(1 for r in rs if r[2] == s) for s in ("pass", "fallback", "xfail", "skip")}
        wrong = sum(1 for r in rs if r[2] == "xfail" and "WRONG RESULT" in r[3])
        supported = len(rs) - counts["skip"]
        pct = 100.0 * counts["pass"] / supported if supported else 0.0
        summary[d] = dict(counts, wrong=wrong, supported=supported, pct=pct)
    return summary


def write_report(path, rows, dnames, secs, args, date=None):
    import jax
    import torch

    s = summarize(rows, dnames)
    lines = ["# OpInfo coverage on tpu", ""]
    lines.append(
        "Generated by `python tools/op_coverage.py` on "
        f"{date or datetime.date.today().isoformat()} (torch {torch.__version__}, jax {jax.__version__}, "
        f"execution mode {args.execution_mode or os.environ.get('TORCHTPU_EXECUTION_MODE', 'strict_eager')}, "
        f"first {args.max_samples} sample inputs per op and dtype, {secs / 60:.0f} min). Every entry of "
        "PyTorch's OpInfo database (`torch.testing._internal.common_methods_invocations.op_db`) runs "
        "its sample inputs on CPU and on tpu and compares results with `torch.testing.assert_close`."
    )
    lines.append("")
    lines.append("- **pass**: every sample matches CPU with the CPU fallback turned off (tpu lowerings only).")
    lines.append("- **fallback**: needs the CPU fallback for the ops named, and matches CPU with it on.")
    lines.append("- **xfail**: fails even with the fallback on; `WRONG RESULT` marks a mismatch with CPU.")
    lines.append("- **skip**: CPU does not support the dtype (or CPU runs none of its samples).")
    lines.append("")
    lines.append("## Summary")
    lines.append("")
    if "float32" in s:
        f = s["float32"]
        lines.append(
            f"**float32: {f['pass']} of {f['supported']} OpInfo ops that CPU supports pass on tpu "
            f"with no CPU fallback: {f['pct']:.1f}%** (target: at least 95% in float32, bfloat16 and int64)."
        )
        lines.append("")
    lines.append("| dtype | ops CPU supports | pass (no fallback) | fallback | xfail | of which wrong result | skip | pass % |")
    lines.append("|---|---|---|---|---|---|---|---|")
    for d in dnames:
        x = s[d]
        lines.append(
            f"| {d} | {x['supported']} | {x['pass']} | {x['fallback']} | {x['xfail']} | {x['wrong']} | "
            f"{x['skip']} | {x['pct']:.1f}% |"
        )
    lines.append("")
    for d in dnames:
        lines.append(f"<!-- summary {d}: supported={s[d]['supported']} pass={s[d]['pass']} "
                     f"fallback={s[d]['fallback']} xfail={s[d]['xfail']} wrong={s[d]['wrong']} "
                     f"pct={s[d]['pct']:.2f} -->")
    lines.append("")
    lines.append("## Not passing, and why")
    lines.append("")
    lines.append("Every entry that does not pass in " + ", ".join(WHY_DTYPES) + " (the table below has the "
                 "error or the ops that fall back):")
    lines.append("")
    failing = {}
    for name, d, status, _ in rows:
        if d in WHY_DTYPES and status in ("fallback", "xfail"):
            failing.setdefault(name, []).append(d)
    for name in sorted(failing):
        lines.append(f"- `{name}` ({', '.join(failing[name])}): {WHY_NOT.get(name, 'no reason recorded')}")
    lines.append("")
    lines.append("## Per op")
    lines.append("")
    lines.append("| op | dtype | status | reason |")
    lines.append("|---|---|---|---|")
    for name, d, status, reason in sorted(rows, key=lambda r: (r[0], dnames.index(r[1]))):
        if status == "skip" and reason == _NO_DTYPE and not args.show_skips:
            continue
        reason = reason.replace("|", "\\|").replace("\n", " ")
        lines.append(f"| `{name}` | {d} | {status} | {reason} |")
    lines.append("")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write("\n".join(lines))
    for d in dnames:
        x = s[d]
        print(f"{d:9s}: {x['pass']}/{x['supported']} pass ({x['pct']:.1f}%), {x['fallback']} fallback, "
              f"{x['xfail']} xfail ({x['wrong']} wrong result)", file=sys.stderr)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--worker":
        p = argparse.ArgumentParser()
        p.add_argument("--worker", nargs=2)
        p.add_argument("--max-samples", type=int, default=5)
        a = p.parse_args(argv)
        worker(a.worker[0], a.worker[1], a.max_samples)
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="docs/op_coverage.md", help="report path (markdown)")
    p.add_argument("--ops", default="", help="comma-separated OpInfo names (e.g. add,sum,max.binary)")
    p.add_argument("--exclude", default="", help="comma-separated OpInfo names to leave out")
    p.add_argument("--dtypes", default=",".join(DTYPE_NAMES), help="comma-separated dtypes")
    p.add_argument("--max-samples", type=int, default=5, help="sample inputs per op and dtype")
    p.add_argument("--timeout", type=float, default=90.0, help="seconds per (op, dtype) before it is killed")
    p.add_argument("--chunk", type=int, default=250, help="(op, dtype) entries per worker process")
    p.add_argument("--show-skips", action="store_true", help="also list dtypes CPU does not support")
    p.add_argument("--execution-mode", default=None,
                   help="torchtpu execution mode for the tpu runs (default: torchtpu's default, strict_eager)")
    p.add_argument("-v", "--verbose", action="store_true", help="print each result as it comes")
    p.add_argument("--rerender", action="store_true",
                   help="rewrite --out from the results already in it (no op runs): after editing WHY_NOT")
    args = p.parse_args(argv)
    if args.rerender:
        rerender(args)
        return
    run_all(args)


def rerender(args):
    """Rewrite the report at ``args.out`` from its own per-op table, keeping its header facts."""
    import re

    with open(args.out) as f:
        text = f.read()
    rows = [(n, d, st, r.replace("\\|", "|"))
            for n, d, st, r in re.findall(r"^\| `([^`]+)` \| (\w+) \| (\w+) \| (.*) \|$", text, flags=re.M)]
    head = re.search(r"on (\d{4}-\d\d-\d\d) \(.*?execution mode (\w+), first (\d+) sample.*?, (\d+) min\)", text)
    dnames = [d for d in DTYPE_NAMES if any(r[1] == d for r in rows)]
    args.max_samples = int(head.group(3))
    args.execution_mode = head.group(2)
    write_report(args.out, rows, dnames, 60 * int(head.group(4)), args, date=head.group(1))


if __name__ == "__main__":
    main()
