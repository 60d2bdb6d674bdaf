"""Never crash the interpreter: deepcopy, save/load, pickle, storages, host reads.

Each case is a snippet that asserts what it needs. All snippets run in ONE
child process (one import of torchtpu), each reporting its own result; if a
snippet kills the child (a segfault, an abort), that snippet fails with the
signal and the rest continue in a fresh child. So a crash regression fails
its test instead of taking pytest down, at the price of one import.
Every known crasher of shared/DESIGN.md has a case here.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

CASES: dict[str, str] = {}


def case(name, code):
    CASES[name] = textwrap.dedent(code)


# ---------------------------------------------------------------- copy.deepcopy (DESIGN: segfault)
case("deepcopy_tensor", """
    a = torch.arange(6.0, device="tpu").reshape(2, 3)
    b = copy.deepcopy(a)
    assert b.device.type == "tpu" and b.shape == (2, 3)
    same(b, torch.arange(6.0).reshape(2, 3))
    b.add_(1)  # the copy is independent
    same(a, torch.arange(6.0).reshape(2, 3))
    same(b, torch.arange(6.0).reshape(2, 3) + 1)
""")
case("deepcopy_views_keep_sharing", """
    a = torch.arange(4.0, device="tpu")
    x, v = copy.deepcopy([a, a[1:3]])
    assert v.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    assert x.untyped_storage().data_ptr() != a.untyped_storage().data_ptr()
    v.mul_(10)  # the copied view still aliases the copied base
    same(x, torch.tensor([0.0, 10.0, 20.0, 3.0]))
    same(a, torch.arange(4.0))
""")
case("deepcopy_dtypes", """
    for t in (torch.tensor([True, False]), torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
              torch.tensor([2**40, -3]), torch.tensor([1 + 2j]), torch.tensor([1, 2], dtype=torch.int8)):
        same(copy.deepcopy(t.to("tpu")), t)
""")
case("deepcopy_parameter_and_grad", """
    p = torch.nn.Parameter(torch.ones(3, device="tpu"))
    q = copy.deepcopy(p)
    assert type(q) is torch.nn.Parameter and q.requires_grad and q.device.type == "tpu"
    same(q, torch.ones(3))
    x = torch.ones(3, device="tpu", requires_grad=True)
    (x * 2).sum().backward()
    y = copy.deepcopy(x)  # a leaf tensor's deepcopy carries its grad
    assert y.requires_grad and y.grad is not None
    same(y.grad, torch.full((3,), 2.0))
""")
case("deepcopy_module", """
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)).to("tpu")
    m.register_buffer("steps", torch.zeros((), dtype=torch.int64, device="tpu"))
    m2 = copy.deepcopy(m)
    x = torch.randn(3, 4, device="tpu")
    same(m2(x), m(x).cpu())
    with torch.no_grad():
        m2[0].weight.add_(1)
    assert not torch.equal(m2[0].weight.cpu(), m[0].weight.cpu())
    assert m2.steps.device.type == "tpu"
""")

# ---------------------------------------------------------------- torch.save / torch.load (DESIGN: fails)
case("save_load_tensor", """
    a = torch.arange(6.0, device="tpu").reshape(2, 3)
    for kw in ({}, {"_use_new_zipfile_serialization": False}):
        f = io.BytesIO(); torch.save(a, f, **kw); f.seek(0)
        b = torch.load(f)
        assert b.device == torch.device("tpu", 0)
        same(b, a.cpu())
""")
case("save_load_map_location", """
    d = {"a": torch.arange(4.0, device="tpu"), "h": torch.ones(2, dtype=torch.bfloat16, device="tpu"),
         "i": torch.tensor([2**40], device="tpu"), "b": torch.tensor([True], device="tpu")}
    d["view"] = d["a"][1:3]
    f = io.BytesIO(); torch.save(d, f)
    for loc, want in ((None, "tpu"), ("cpu", "cpu"), ("tpu", "tpu"), (torch.device("cpu"), "cpu"),
                      ({"tpu:0": "cpu"}, "cpu"), (lambda s, l: s, "cpu")):
        f.seek(0)
        e = torch.load(f, map_location=loc)
        for k, v in d.items():
            assert e[k].device.type == want, (loc, k, e[k].device)
            assert e[k].dtype == v.dtype
            same(e[k], v.cpu())
        # views saved together still share storage after loading
        assert e["view"].untyped_storage().data_ptr() == e["a"].untyped_storage().data_ptr()
""")
case("save_load_state_dict", """
    torch.manual_seed(0)
    m = torch.nn.Linear(3, 2).to("tpu")
    f = io.BytesIO(); torch.save(m.state_dict(), f); f.seek(0)
    sd = torch.load(f, weights_only=True)
    assert all(v.device.type == "tpu" for v in sd.values())
    m2 = torch.nn.Linear(3, 2).to("tpu")
    m2.load_state_dict(sd)
    x = torch.ones(1, 3, device="tpu")
    same(m2(x), m(x).cpu())
    f.seek(0)
    cpu_m = torch.nn.Linear(3, 2)
    cpu_m.load_state_dict(torch.load(f, map_location="cpu"))
    torch.testing.assert_close(cpu_m(torch.ones(1, 3)), m(x).cpu())
""")
case("save_file_on_disk", """
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "t.pt")
        torch.save({"w": torch.arange(3, device="tpu")}, p)
        same(torch.load(p)["w"], torch.arange(3))
""")

# ---------------------------------------------------------------- pickle (Ray ships tensors)
case("pickle_tensor", """
    a = torch.arange(5.0, device="tpu")
    for proto in (2, pickle.HIGHEST_PROTOCOL):
        b = pickle.loads(pickle.dumps(a, protocol=proto))
        assert b.device == torch.device("tpu", 0)
        same(b, torch.arange(5.0))
    same(pickle.loads(pickle.dumps(a[1:4])), torch.arange(1.0, 4.0))
    p = torch.nn.Parameter(torch.ones(2, device="tpu"))
    q = pickle.loads(pickle.dumps(p))
    assert type(q) is torch.nn.Parameter and q.requires_grad and q.device.type == "tpu"
""")
case("pickle_into_a_fresh_process", """
    import subprocess, sys
    blob = pickle.dumps({"w": torch.arange(3.0, device="tpu")})
    # the receiver never imports torchtpu itself: unpickling must
    code = "import pickle, sys; d = pickle.loads(sys.stdin.buffer.read()); print(d['w'].device, d['w'].tolist())"
    out = subprocess.run([sys.executable, "-c", code], input=blob, capture_output=True, timeout=300)
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    assert out.stdout.decode().split() == ["tpu:0", "[0.0,", "1.0,", "2.0]"], out.stdout
""")
case("pickle_cloudpickle", """
    import ray.cloudpickle as cloudpickle
    a = torch.tensor([[1, 2], [3, 4]], dtype=torch.int32, device="tpu")
    b = cloudpickle.loads(cloudpickle.dumps(a))
    assert b.device.type == "tpu"
    same(b, torch.tensor([[1, 2], [3, 4]], dtype=torch.int32))
""")
case("pickle_torch_multiprocessing", """
    import torch.multiprocessing  # installs torch's shared-memory reducers
    from multiprocessing.reduction import ForkingPickler
    a = torch.arange(4.0, device="tpu", requires_grad=True)
    b = ForkingPickler.loads(bytes(ForkingPickler.dumps(a)))
    assert b.device.type == "tpu" and b.requires_grad
    same(b, torch.arange(4.0))
    p = ForkingPickler.loads(bytes(ForkingPickler.dumps(torch.nn.Parameter(torch.ones(2, device="tpu")))))
    assert type(p) is torch.nn.Parameter and p.device.type == "tpu" and p.requires_grad
    c = torch.arange(3.0)  # CPU tensors still go through shared memory
    same(ForkingPickler.loads(bytes(ForkingPickler.dumps(c))), c)
""")

# ---------------------------------------------------------------- host reads
case("print_item_tolist_bool", """
    a = torch.tensor([[1.5, 2.0], [3.0, 4.0]], device="tpu")
    s = repr(a)
    assert "device='tpu:0'" in s and "1.5000" in s
    str(torch.ones(2, dtype=torch.bfloat16, device="tpu")); str(torch.empty(0, device="tpu"))
    str(torch.arange(2000, device="tpu"))  # summarized printing
    assert a[0, 0].item() == 1.5 and a.tolist() == [[1.5, 2.0], [3.0, 4.0]]
    assert bool(a[1, 1]) is True and bool(torch.zeros((), device="tpu")) is False
    assert torch.tensor(7, device="tpu").item() == 7
    try:
        bool(a)
    except RuntimeError as e:
        assert "ambiguous" in str(e)
    else:
        raise AssertionError("bool of a 4-element tensor must raise")
""")
case("numpy_error", """
    try:
        torch.ones(2, device="tpu").numpy()
    except TypeError as e:
        assert "Tensor.cpu()" in str(e), e
    else:
        raise AssertionError("numpy() of a tpu tensor must raise")
""")
case("to_jax_from_jax_zero_copy", """
    import jax, jax.numpy as jnp
    t = torch.ones(2, 3, device="tpu") * torch.arange(3.0, device="tpu")
    j = torchtpu.to_jax(t)
    assert isinstance(j, jax.Array) and j.shape == (2, 3)
    assert j is torchtpu.to_jax(t, flat=True)  # the storage's own buffer, not a copy
    np.testing.assert_array_equal(np.asarray(j), np.ones((2, 3)) * np.arange(3.0))
    a = jnp.arange(4, dtype=jnp.float32) * 2
    u = torchtpu.from_jax(a)
    assert u.device.type == "tpu" and u.dtype == torch.float32
    assert torchtpu.to_jax(u) is a
    assert torchtpu.to_jax(u).unsafe_buffer_pointer() == a.unsafe_buffer_pointer()
    same(u, torch.arange(4.0) * 2)
    same(torchtpu.from_jax(jnp.array([1, 2], dtype=jnp.bfloat16)), torch.tensor([1, 2], dtype=torch.bfloat16))
    # a strided view gets its own (device-side) array with the view's values
    np.testing.assert_array_equal(np.asarray(torchtpu.to_jax(t.t())), (np.ones((2, 3)) * np.arange(3.0)).T)
""")

# ---------------------------------------------------------------- storages (DESIGN: UntypedStorage segfaults)
case("untyped_storage_new", """
    s = torch.UntypedStorage(8, device="tpu")
    assert s.device.type == "tpu" and s.nbytes() == 8 and s.tolist() == [0] * 8
    s.copy_(torch.UntypedStorage(list(range(1, 9))))
    assert s.cpu().tolist() == list(range(1, 9))
    assert torch.UntypedStorage([5, 6], device="tpu").tolist() == [5, 6]
    assert torch.UntypedStorage(device="tpu").nbytes() == 0
    # a float tensor over raw bytes reads them as floats
    raw = torch.tensor([1.0, -2.5]).untyped_storage()
    dev = torch.UntypedStorage(8, device="tpu"); dev.copy_(raw)
    t = torch.empty(0, device="tpu").set_(dev)
    same(t, torch.tensor([1.0, -2.5]))
    t.mul_(2)
    assert dev.cpu().tolist() == torch.tensor([2.0, -5.0]).untyped_storage().tolist()
    same(torch.empty(0, dtype=torch.int16, device="tpu").set_(dev, 1, (2,)),
         torch.tensor([2.0, -5.0]).view(torch.int16)[1:3])
    assert torch.UntypedStorage(4).to(device="tpu").device.type == "tpu"
    assert torch.UntypedStorage(4).tpu().device.type == "tpu"
""")
case("untyped_storage_more", """
    s = torch.UntypedStorage(4, device=0)  # a bare index means the current accelerator: tpu
    assert s.device == torch.device("tpu", 0)
    t = torch.tensor([1.0, 2.0], device="tpu")
    ref = torch.tensor([1.0, 2.0]).untyped_storage()
    ref.byteswap(torch.float32)
    t.untyped_storage().byteswap(torch.float32)  # torch.load of a big-endian file does this on tpu
    assert t.untyped_storage().tolist() == ref.tolist()
    t.untyped_storage().byteswap(torch.float32)
    same(t, torch.tensor([1.0, 2.0]))
    for bad in (lambda: t.untyped_storage()[0:4], lambda: t.untyped_storage().resize_(16)):
        try:
            bad()
        except RuntimeError as e:
            assert "tpu storage" in str(e), e
        else:
            raise AssertionError("must raise")
    u = torch.arange(4.0, device="tpu")
    held = torch.tpu.memory_allocated()
    u.untyped_storage().resize_(0)  # FSDP2 frees an unsharded parameter's memory so between uses
    assert torch.tpu.memory_allocated() == held - 16
    u.untyped_storage().resize_(16)  # and gives it back before writing it
    u.copy_(torch.ones(4))
    same(u, torch.ones(4))
    c = copy.copy(t.untyped_storage())
    assert c.device.type == "tpu" and c.tolist() == t.untyped_storage().tolist()
""")
case("cpu_checkpoint_onto_tpu", """
    f = io.BytesIO(); torch.save({"w": torch.arange(4.0)}, f); f.seek(0)
    w = torch.load(f, map_location="tpu")["w"]
    assert w.device.type == "tpu"
    same(w * 2, torch.arange(4.0) * 2)
""")
case("pending_buffers_defer_and_fuse", """
    x = torch.arange(4.0, device="tpu")
    with torchtpu.execution_mode("defer_and_fuse"):
        y = x * 2 + 1  # pending: no value computed yet
        same(copy.deepcopy(y), torch.arange(4.0) * 2 + 1)
        z = x * 3
        f = io.BytesIO(); torch.save(z, f); f.seek(0)
        same(torch.load(f), torch.arange(4.0) * 3)
        w = x - 1
        same(pickle.loads(pickle.dumps(w)), torch.arange(4.0) - 1)
        v = x + 10
        assert v.untyped_storage().tolist() == (torch.arange(4.0) + 10).untyped_storage().tolist()
""")
case("tensor_storage_access", """
    a = torch.tensor([1.0, 2.0, 3.0], device="tpu")
    s = a.untyped_storage()
    assert s.device.type == "tpu" and s.nbytes() == 12
    assert s.tolist() == torch.tensor([1.0, 2.0, 3.0]).untyped_storage().tolist()
    assert s[4] == torch.tensor([1.0, 2.0, 3.0]).untyped_storage()[4]
    repr(s)
    ts = a.storage()  # TypedStorage
    assert ts.dtype == torch.float32 and ts.size() == 3 and ts.tolist() == [1.0, 2.0, 3.0]
    repr(ts)
    same(a + 1, torch.tensor([2.0, 3.0, 4.0]))  # the tensor reads correctly after byte views
    c = s.clone()
    assert c.device.type == "tpu" and c.data_ptr() != s.data_ptr() and c.tolist() == s.tolist()
    assert s.cpu().device.type == "cpu"
""")
case("data_ptr", """
    a = torch.zeros(4, device="tpu")
    b = torch.zeros(4, device="tpu")
    p = a.data_ptr()
    assert isinstance(p, int) and p != 0 and p != b.data_ptr()
    assert a[1:].data_ptr() == p + 4  # views are offsets into their base, as on every device
    assert a.untyped_storage().data_ptr() == p
""")
case("share_memory_and_new_methods", """
    a = torch.arange(3.0, device="tpu")
    assert a.share_memory_() is a
    a.is_shared()
    same(a, torch.arange(3.0))
    same(a.new_tensor([1, 2]), torch.tensor([1.0, 2.0]))  # new_tensor keeps self's dtype
    same(a.new_zeros(2, 2), torch.zeros(2, 2))
    same(a.new_ones(3), torch.ones(3))
    same(a.new_full((2,), 4.0), torch.full((2,), 4.0))
    assert a.new_empty(5).device.type == "tpu" and a.new_empty(5).shape == (5,)
""")

case("storage_size_checks", """
    # DESIGN: tpu storages once had zero bytes and torch's size checks failed (t_() crashed)
    x = torch.arange(6.0, device="tpu").reshape(2, 3)
    x.t_()
    assert x.shape == (3, 2)
    same(x, torch.arange(6.0).reshape(2, 3).t())
    y = torch.arange(6.0, device="tpu")
    y.as_strided_((2, 2), (1, 2), 1)
    same(y, torch.arange(6.0).as_strided((2, 2), (1, 2), 1))
    z = torch.ones(2, device="tpu")
    z.resize_(5)
    assert z.shape == (5,) and z.untyped_storage().nbytes() >= 20
    same(z[:2], torch.ones(2))
    w = torch.ones(3, 1, device="tpu")
    w.squeeze_(); w.unsqueeze_(0)
    assert w.shape == (1, 3)
""")

# ---------------------------------------------------------------- pin_memory (DESIGN: needs a pinned allocator)
case("pin_memory", """
    c = torch.arange(6.0).reshape(2, 3)
    p = c.pin_memory()
    assert p.device.type == "cpu" and torch.equal(p, c)
    assert p.data_ptr() != c.data_ptr()  # a copy, as pin_memory promises
    same(p.to("tpu", non_blocking=True), c)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(8.0)),
                                         batch_size=4, pin_memory=True)
    got = [b[0].to("tpu", non_blocking=True) for b in loader]
    same(torch.cat(got), torch.arange(8.0))
    try:
        c.pin_memory("tpu:1")
    except RuntimeError as e:
        assert "device index 1" in str(e)
    else:
        raise AssertionError("pin_memory('tpu:1') must raise")
""")

# ---------------------------------------------------------------- autograd and the device guard (DESIGN: abort)
case("autograd_runs", """
    x = torch.arange(3.0, device="tpu", requires_grad=True)
    (x * x).sum().backward()
    same(x.grad, torch.arange(3.0) * 2)
    torch.accelerator.synchronize()
""")

# ---------------------------------------------------------------- the kernel executor checks what lowerings return (DESIGN)
case("bad_lowering_results_are_errors", """
    import jax.numpy as jnp
    from torchtpu.dispatch import install, lowering
    lib = torch.library.Library("tpusafety", "DEF")
    for n in ("ret_none", "ret_shape", "ret_two"):
        lib.define(n + "(Tensor x) -> Tensor")
        lib.impl(n, lambda x: torch.empty_like(x), "Meta")
    lowering.lower("tpusafety::ret_none")(lambda x: None)
    lowering.lower("tpusafety::ret_shape")(lambda x: jnp.zeros((5,)))
    lowering.lower("tpusafety::ret_two")(lambda x: (x, x))
    install.install()
    a = torch.ones(3, device="tpu")
    for n in ("ret_none", "ret_shape", "ret_two"):
        try:
            r = getattr(torch.ops.tpusafety, n)(a)
        except (RuntimeError, TypeError, ValueError):
            pass
        else:
            raise AssertionError(f"{n} returned {r!r} instead of raising")
""")

# ---------------------------------------------------------------- the runner
# ---------------------------------------------------------------- allocations that cannot succeed (issue 33)
# An overflowing size aborted the interpreter inside XLA (SIGABRT); a size over the free memory raised
# XLA's JaxRuntimeError. CPU raises RuntimeError for the first, CUDA torch.OutOfMemoryError for the second.
case("alloc_overflow_is_cpus_runtime_error", """
    x = torch.ones(1, device="tpu")
    for make in (lambda: torch.empty(2**61, device="tpu"), lambda: torch.zeros(2**61, device="tpu"),
                 lambda: torch.empty(2**31, 2**31, 4, device="tpu"), lambda: x.new_zeros(2**61),
                 lambda: x.repeat(2**62), lambda: torch.ones(2, device="tpu").resize_(2**61)):
        try:
            make()
        except RuntimeError as e:
            assert "overflow" in str(e) and not isinstance(e, torch.OutOfMemoryError), e
        else:
            raise AssertionError("no error")
    with torchtpu.execution_mode("defer_and_fuse"):
        try:
            x.repeat(2**62)
        except RuntimeError as e:
            assert "overflow" in str(e), e
        else:
            raise AssertionError("no error")
""")
case("alloc_over_free_memory_is_out_of_memory", r"""
    import re
    free, total = torch.tpu.mem_get_info()
    n = total + (1 << 30)  # float32 elements: four times the device's bytes, and more
    x = torch.ones(1, device="tpu")
    makes = {"empty": lambda: torch.empty(n, device="tpu"), "ones": lambda: torch.ones(n, device="tpu"),
             "randn": lambda: torch.randn(n, device="tpu"), "expand+contiguous": lambda: x.expand(n).contiguous(),
             "repeat": lambda: x.repeat(n), "resize_": lambda: torch.ones(2, device="tpu").resize_(n),
             "compiled": lambda: torch.compile(lambda x: x.expand(n) * 2, backend="tpu")(x)}
    for mode in ("strict_eager", "defer_and_fuse"):
        with torchtpu.execution_mode(mode):
            for what, make in makes.items():
                try:
                    make().cpu()
                except torch.OutOfMemoryError as e:
                    msg = str(e)
                    # the requested bytes and the free / total bytes, as CUDA words it
                    asked = int(re.search(r"Tried to allocate .*? \((\d+) bytes\)", msg).group(1))
                    assert asked >= 4 * n - 8, (what, msg)
                    assert re.search(r"total capacity of .*? \(%d bytes\)" % total, msg), (what, msg)
                    assert re.search(r"of which .*? \((\d+) bytes\) is free", msg), (what, msg)
                else:
                    raise AssertionError(f"{what}: no error")
    assert issubclass(torch.OutOfMemoryError, RuntimeError)
    same(torch.ones(3, device="tpu") * 2, torch.full((3,), 2.0))  # the device still works
""")


_PRELUDE = """
import copy, io, os, pickle, warnings
import numpy as np
import torch
import torchtpu
warnings.simplefilter("ignore")

def same(t, ref):
    assert isinstance(t, torch.Tensor), type(t)
    torch.testing.assert_close(t.cpu(), ref.cpu() if isinstance(ref, torch.Tensor) else ref,
                               rtol=0, atol=0)
"""

# A case that hangs is a failure too: the watchdog dumps its stack and ends the child.
CASE_TIMEOUT_S = 120

_RUNNER = r"""
import faulthandler, json, sys, traceback
cases = json.loads(sys.stdin.read())
exec(compile(PRELUDE, "<prelude>", "exec"), globals())
for name, code in cases:
    print(json.dumps({"start": name}), flush=True)
    faulthandler.dump_traceback_later(TIMEOUT, exit=True)
    try:
        exec(compile(code, f"<case {name}>", "exec"), dict(globals()))
        res = {"name": name, "ok": True}
    except BaseException:
        res = {"name": name, "ok": False, "error": traceback.format_exc()}
    faulthandler.cancel_dump_traceback_later()
    print(json.dumps(res), flush=True)
"""


def _run_all(cases):
    """Run ``cases`` (list of (name, code)) in child processes; name -> result dict."""
    results = {}
    todo = list(cases)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    script = _RUNNER.replace("PRELUDE", repr(_PRELUDE)).replace("TIMEOUT", str(CASE_TIMEOUT_S))
    while todo:
        proc = subprocess.run([sys.executable, "-c", script], input=json.dumps(todo), capture_output=True,
                              text=True, env=env)
        started = None
        for line in proc.stdout.splitlines():
            if not line.startswith("{"):
                continue
            msg = json.loads(line)
            if "start" in msg:
                started = msg["start"]
            else:
                results[msg["name"]] = msg
                started = None
        if started is not None:  # the child died inside this case
            rc = proc.returncode
            why = f"was killed by {signal.Signals(-rc).name}" if rc < 0 else f"exited with status {rc}"
            if "Timeout (" in proc.stderr:
                why = f"hung for {CASE_TIMEOUT_S} s"
            results[started] = {"name": started, "ok": False,
                                "error": f"the process {why} in this case\n{proc.stderr[-3000:]}"}
        left = [(n, c) for n, c in todo if n not in results]
        if len(left) == len(todo):  # no case even started: the child fails before them
            raise RuntimeError(f"the case runner failed to start:\n{proc.stderr[-3000:]}")
        todo = left
    return results


# The harness's own check: a case that segfaults must be reported as such. It runs
# last in the batch, so it costs no extra child process.
_CRASH = ("_harness_segfault", "import ctypes; ctypes.string_at(0)")


@pytest.fixture(scope="module")
def results():
    return _run_all(list(CASES.items()) + [_CRASH])


@pytest.mark.parametrize("name", list(CASES))
def test_no_crash(name, results):
    r = results[name]
    assert r["ok"], r["error"]


def test_harness_reports_a_segfault(results):
    r = results[_CRASH[0]]
    assert not r["ok"] and "SIGSEGV" in r["error"], r
