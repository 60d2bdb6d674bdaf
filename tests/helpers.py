"""Helpers shared by test modules (pytest puts tests/ on sys.path)."""

import contextlib
import time

import torchtpu


@contextlib.contextmanager
def no_fallback():
    """CPU fallback off inside the block, and no op may have fallen back in it."""
    before = dict(torchtpu.metrics.snapshot()["cpu_fallbacks"])
    torchtpu.set_cpu_fallback(False)
    try:
        yield
    finally:
        torchtpu.set_cpu_fallback(True)
    assert dict(torchtpu.metrics.snapshot()["cpu_fallbacks"]) == before


def free_port() -> int:
    """A free TCP port on localhost (for a spawned process group's rendezvous)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_spawned(worker, nprocs: int, tmpdir) -> dict:
    """Run ``worker(rank, port, tmpdir)`` in ``nprocs`` spawned processes (a rendezvous port is given).

    Returns the results of the named checks the workers ran (see :func:`named_checks`):
    ``{check name: {rank: traceback or None}}``, for :func:`assert_check` to assert one test item per
    check. A process that fails outside a check fails the call, with its traceback."""
    import json
    import pathlib

    import torch.multiprocessing as mp

    mp.start_processes(worker, args=(free_port(), str(tmpdir)), nprocs=nprocs, join=True, start_method="spawn")
    table: dict = {}
    for rank in range(nprocs):
        path = pathlib.Path(tmpdir) / f"checks_{rank}.json"
        ran = json.loads(path.read_text()) if path.exists() else {}
        for name, error in ran.items():
            table.setdefault(name, {})[rank] = error
    return table


def assert_check(table: dict, name: str, nprocs: int) -> None:
    """One check of a spawned job passed on every rank (``table`` from :func:`run_spawned`)."""
    ranks = table.get(name, {})
    missing = [r for r in range(nprocs) if r not in ranks]
    assert not missing, f"check {name!r} did not run on rank(s) {missing} (an earlier failure stopped them?)"
    errors = [f"rank {r}:\n{e}" for r, e in sorted(ranks.items()) if e is not None]
    assert not errors, f"check {name!r} failed:\n" + "\n".join(errors)


def named_checks(rank: int, tmpdir):
    """``check(name, fn)`` for a spawned worker: runs ``fn`` and records its traceback (or None) under
    ``name`` in ``tmpdir/checks_<rank>.json`` after each check, so a failing check neither hides the
    next ones nor is lost if the process dies later. ``REC_TEST_ONLY=a,b`` runs only the named checks;
    ``REC_TEST_VERBOSE=1`` prints each check's time as it ends."""
    import json
    import os
    import pathlib
    import time
    import traceback

    results: dict = {}
    path = pathlib.Path(tmpdir) / f"checks_{rank}.json"

    def check(name, fn):
        only = os.environ.get("REC_TEST_ONLY")
        if only and name not in only.split(","):
            return
        t0, c0 = time.time(), time.process_time()
        try:
            fn()
            results[name] = None
        except Exception:
            results[name] = traceback.format_exc()
        if os.environ.get("REC_TEST_VERBOSE"):
            print(rank, name, f"{time.time() - t0:.1f}s, cpu {time.process_time() - c0:.1f}s",
                  "ok" if results[name] is None else "FAILED", flush=True)
        path.write_text(json.dumps(results))

    return check


def expect_owner_index_error(run, rank: int, owner: int, feature: str) -> None:
    """``run()`` feeds a DMP an out-of-range id of ``feature``: the rank owning its table must raise an
    IndexError naming the feature; the other rank may see its output all-to-all lose its peer."""
    try:
        run()
    except IndexError as e:
        if rank == owner:
            assert feature in str(e), str(e)
        return
    except RuntimeError:
        if rank != owner:  # the owner's error leaves the other rank's output all-to-all without a peer
            return
        raise
    if rank == owner:
        raise AssertionError(f"an out-of-range id of {feature} did not raise on rank {owner}, which owns its table")


def tpu_dmp(module, per_param, sharder, world: int, path: str = "", env=None):
    """``module`` (built on the meta device) sharded on tpu by DMP with the per-parameter plan
    ``per_param`` (``construct_module_sharding_plan``'s form) of its embedding module at ``path`` ("" for
    the module itself) over ``world`` ranks of one host (``env``: a ShardingEnv of a subgroup)."""
    import torch
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan
    from torchrec.distributed.types import ShardingPlan

    from torchtpu_rec.sharding import tpu_data_parallel_wrapper

    target = module.get_submodule(path) if path else module
    plan = construct_module_sharding_plan(target, per_param, local_size=world, world_size=world,
                                          device_type="tpu", sharder=sharder)
    return DistributedModelParallel(module, env=env, device=torch.device("tpu"), sharders=[sharder],
                                    plan=ShardingPlan({path: plan}), data_parallel_wrapper=tpu_data_parallel_wrapper())


HF_CAUSAL_LM_FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "phi3")


def tiny_hf_causal_lm(family: str = "qwen2", vocab_size: int = 64, hidden_size: int = 32, num_layers: int = 2,
                      seed: int = 0, **config):
    """A small randomly initialized Hugging Face causal LM of ``family`` (on CPU, float32), built from its
    config class, as a checkpoint directory of that architecture would load. ``config`` overrides fields."""
    import torch
    import transformers

    classes = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config", "mistral": "MistralConfig",
               "gemma2": "Gemma2Config", "phi3": "Phi3Config"}
    fields = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                  num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=hidden_size // 4, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
                  pad_token_id=0)
    fields.update(config)
    cfg = getattr(transformers, classes[family])(**fields)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    return model.eval()


def listening_sockets(pids) -> list:
    """``(address, port)`` of every TCP socket in LISTEN state held by ``pids`` (/proc/net/tcp{,6})."""
    import ipaddress
    import os

    inodes = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    link = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if link.startswith("socket:["):
                        inodes.add(link[8:-1])
    out = []
    for fam in ("tcp", "tcp6"):
        with open(f"/proc/net/{fam}") as f:
            for line in f.read().splitlines()[1:]:
                cols = line.split()
                if cols[3] != "0A" or cols[9] not in inodes:
                    continue
                hexaddr, hexport = cols[1].split(":")
                raw = bytes.fromhex(hexaddr)
                # /proc/net stores each 32-bit word of the address in host (little-endian) order
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                addr = ipaddress.ip_address(raw)
                if getattr(addr, "ipv4_mapped", None):
                    addr = addr.ipv4_mapped
                out.append((str(addr), int(hexport, 16)))
    return out


def eventually(cond, timeout_s=60.0, what="condition"):
    """Poll ``cond`` until it returns a true value (returned): Ray frees resources and reports deaths
    asynchronously."""
    deadline = time.monotonic() + timeout_s
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.2)
