"""`python -m ray_integration` / `torchtpu-ray`: a local Ray head and job submission.

    torchtpu-ray head start [--run-dir .run/ray] [--num-cpus 2] [--bind 127.0.0.1] [--simulate v4-16 [--slices 1]]
    torchtpu-ray head status | head stop
    torchtpu-ray slices
    torchtpu-ray job submit [--working-dir .] [--env K=V ...] [--entrypoint-resources '{"TPU": 4}'] [--no-wait]
                            -- python examples/quickstart.py
    torchtpu-ray job list | job logs JOB_ID [--follow] | job status JOB_ID | job stop JOB_ID

Options go before or after the subcommand (``--run-dir X head start`` = ``head start --run-dir X``).
Job commands take ``--address http://127.0.0.1:<port>`` (the dashboard), else ``RAY_API_SERVER_ADDRESS``
or an ``http`` ``RAY_ADDRESS``, else the head recorded in ``--run-dir``; the auth token comes from
``--token-file``, else ``RAY_AUTH_TOKEN``/``RAY_AUTH_TOKEN_PATH``, else that head's ``auth_token``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import List, Optional

from . import jobs
from .cluster import DEFAULT_BIND, DEFAULT_RUN_DIR, LocalHead, start_simulated_slice
from .discovery import SliceSpec, alive_nodes, slices_from_nodes


def _job_address(args) -> str:
    if args.address:
        return args.address
    for var in ("RAY_API_SERVER_ADDRESS", "RAY_ADDRESS"):
        v = os.environ.get(var, "")
        if v.startswith(("http://", "https://")):
            return v
    head = LocalHead.attach(args.run_dir)
    if not head.dashboard_url:
        raise SystemExit(f"the head in {args.run_dir} was started without a dashboard: jobs need one")
    return head.dashboard_url


def _job_token(args) -> Optional[str]:
    if args.token_file:
        try:
            with open(args.token_file) as f:
                return f.read().strip()
        except OSError as e:
            raise SystemExit(f"--token-file {args.token_file!r}: {e}") from e
    if os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH"):
        return None  # jobs reads them
    try:
        head = LocalHead.attach(args.run_dir)
    except (FileNotFoundError, ValueError):
        return None
    return head.token()


def _print(obj, as_json: bool) -> None:
    if as_json:
        print(json.dumps(obj, indent=2, default=str))
    else:
        for k, v in obj.items():
            print(f"{k}: {v}")


def cmd_head_start(args) -> int:
    try:
        st = LocalHead.attach(args.run_dir)
    except FileNotFoundError:
        st = None
    except ValueError as e:  # unreadable record: nothing in it can be proven ours
        print(f"{e}: removing it", file=sys.stderr)
        os.unlink(os.path.join(os.path.abspath(args.run_dir), "head.json"))
        st = None
    if st is not None:
        if st.alive():
            print(f"a head is already running from {args.run_dir}: {st.address} (dashboard {st.dashboard_url})",
                  file=sys.stderr)
            return 1
        # stale record of a head that is gone: stop what is provably left of it, drop the record
        for line in st.stop():
            print(f"stale head record in {args.run_dir}: {line}", file=sys.stderr)
    head = LocalHead(args.run_dir, num_cpus=args.num_cpus, object_store_memory=args.object_store_mb * 1024**2,
                     include_dashboard=not args.no_dashboard, detach=True, bind=args.bind, auth=args.auth)
    head.start(timeout_s=args.timeout)
    try:
        if args.simulate:
            spec = SliceSpec.parse(args.simulate)
            for i in range(args.slices):
                start_simulated_slice(head, spec, name=f"sim-{spec.pod_type}-{i}", timeout_s=args.timeout)
        head.write_state()
    except BaseException:
        head.stop()
        raise
    # The head processes run in their own sessions and outlive this command (stop: `head stop`).
    _print(_where(head, {"pid": head.head.pid, "simulated_hosts": len(head.nodes)}), args.json)
    return 0


def _where(head: LocalHead, extra: dict) -> dict:
    """Where a head listens and how a client gets in (printed by `head start` and `head status`)."""
    return {"address": head.address, "dashboard_url": head.dashboard_url, "run_dir": str(head.run_dir),
            "bind": head.bind, "auth": head.auth, "token_file": str(head.token_path) if head.token_path else None,
            "client_env": " ".join(f"{k}={v}" for k, v in head.client_env().items()),
            "ports": head.ports, **extra}


def _attach_or_report(run_dir) -> Optional[LocalHead]:
    """The head recorded in `run_dir`, or None after saying on stderr that there is none."""
    try:
        return LocalHead.attach(run_dir)
    except (FileNotFoundError, ValueError) as e:
        print(str(e), file=sys.stderr)
        return None


def cmd_head_stop(args) -> int:
    """Signals only processes proven ours (LocalHead.stop); says per node what it did."""
    head = _attach_or_report(args.run_dir)
    if head is None:
        return 1
    was_alive = head.alive()
    for line in head.stop():
        print(line)
    print(f"{'stopped the Ray head' if was_alive else 'removed the stale head record'} of {head.run_dir}")
    return 0


def cmd_head_status(args) -> int:
    head = _attach_or_report(args.run_dir)
    if head is None:
        return 1
    st = _where(head, {"pid": head.head.pid if head.head else None, "alive": head.alive()})
    if st["alive"]:
        head.use_auth()
        try:
            nodes = alive_nodes(head.address, timeout_s=5)
            st["nodes"] = len(nodes)
            st["slices"] = {n: {"pod_type": s.spec.pod_type, "hosts": len(s.nodes), "complete": s.complete}
                            for n, s in slices_from_nodes(nodes).items()}
        except Exception as e:
            st["error"] = f"GCS not answering: {e}"
    _print(st, args.json)
    return 0 if st["alive"] else 1


def cmd_slices(args) -> int:
    if args.gcs_address:
        address = args.gcs_address  # auth from RAY_AUTH_MODE / RAY_AUTH_TOKEN[_PATH], as Ray's own clients
    else:
        head = LocalHead.attach(args.run_dir)
        head.use_auth()
        address = head.address
    out = {n: {"pod_type": s.spec.pod_type, "topology": s.spec.topology, "hosts": sorted(s.nodes),
               "chips_per_host": s.spec.chips_per_host, "complete": s.complete, "simulated": s.simulated}
           for n, s in slices_from_nodes(alive_nodes(address)).items()}
    print(json.dumps(out, indent=2))
    return 0


def _parse_env(pairs: List[str]) -> dict:
    env = {}
    for p in pairs or []:
        if "=" not in p:
            raise SystemExit(f"--env {p!r}: expected KEY=VALUE")
        k, v = p.split("=", 1)
        env[k] = v
    return env


def cmd_job_submit(args) -> int:
    entry = list(args.entrypoint)
    if entry and entry[0] == "--":
        entry = entry[1:]
    if not entry:
        raise SystemExit("job submit: give the entrypoint after `--`, e.g. -- python examples/quickstart.py")
    address, token = _job_address(args), _job_token(args)
    renv = _json_arg("--runtime-env-json", args.runtime_env_json)
    res = _json_arg("--entrypoint-resources", args.entrypoint_resources)
    if res is not None and (not isinstance(res, dict) or not all(
            isinstance(v, (int, float)) and v >= 0 for v in res.values())):
        raise SystemExit(f"--entrypoint-resources must be a JSON object of non-negative numbers, got {res!r}")
    if res and {"CPU", "GPU"} & set(res):
        raise SystemExit(f"--entrypoint-resources {res}: give CPUs with --entrypoint-num-cpus (Ray refuses CPU and "
                         "GPU among custom resources)")
    job_id = jobs.submit(address, entry if len(entry) > 1 else entry[0], working_dir=args.working_dir,
                         env_vars=_parse_env(args.env), runtime_env=renv, submission_id=args.submission_id,
                         entrypoint_resources=res, entrypoint_num_cpus=args.entrypoint_num_cpus, token=token)
    print(f"submitted job {job_id} to {address}", file=sys.stderr)
    print(job_id, flush=True)
    if args.no_wait:
        return 0
    final = jobs.follow_logs(address, job_id, token=token)
    print(f"job {job_id} {final}", file=sys.stderr)
    return 0 if final == "SUCCEEDED" else 1


def _json_arg(flag: str, text: Optional[str]):
    if not text:
        return None
    try:
        return json.loads(text)
    except ValueError as e:
        raise SystemExit(f"{flag}: not valid JSON ({e}): {text!r}") from e


def cmd_job_logs(args) -> int:
    address, token = _job_address(args), _job_token(args)
    if args.follow:
        final = jobs.follow_logs(address, args.job_id, token=token)
        return 0 if final == "SUCCEEDED" else 1
    sys.stdout.write(jobs.logs(address, args.job_id, token=token))
    return 0


def cmd_job_status(args) -> int:
    inf = jobs.info(_job_address(args), args.job_id, token=_job_token(args))
    _print(inf, args.json)
    return 0


def cmd_job_list(args) -> int:
    rows = jobs.list_jobs(_job_address(args), token=_job_token(args))
    if args.json:
        print(json.dumps(rows, indent=2, default=str))
    else:
        for r in sorted(rows, key=lambda r: r["start_time"] or 0):
            print(f"{r['submission_id']}\t{r['status']}\t{r['entrypoint']}")
    return 0


def cmd_job_stop(args) -> int:
    ok = jobs.stop(_job_address(args), args.job_id, token=_job_token(args))
    print(f"job {args.job_id}: {'stop requested' if ok else 'already finished'}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    # --run-dir is accepted before or after the subcommand: the subcommands' copy has no default of
    # its own (SUPPRESS), so it overrides the top-level one only when given.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--run-dir", default=argparse.SUPPRESS,
                        help="the local head's RAY_TMPDIR and state (default: $TORCHTPU_RAY_RUN_DIR or "
                             f"{DEFAULT_RUN_DIR}; keep it short)")
    p = argparse.ArgumentParser(prog="torchtpu-ray", description=__doc__.split("\n")[0])
    p.add_argument("--run-dir", default=os.environ.get("TORCHTPU_RAY_RUN_DIR", DEFAULT_RUN_DIR),
                   help="the local head's RAY_TMPDIR and state (default: %(default)s; keep it short)")
    sub = p.add_subparsers(dest="cmd", required=True)

    head = sub.add_parser("head", help="a local Ray head").add_subparsers(dest="action", required=True)
    s = head.add_parser("start", parents=[common],
                        help="start a head (and simulated TPU hosts) that outlives this command")
    s.add_argument("--bind", default=DEFAULT_BIND,
                   help="address the head's servers and dashboard listen on (default: %(default)s, this host only; "
                        "Ray's --node-ip-address)")
    s.add_argument("--auth", choices=("token", "disabled"), default=None,
                   help="Ray auth mode (default: $RAY_AUTH_MODE, else token; the token goes to <run-dir>/auth_token)")
    s.add_argument("--num-cpus", type=int, default=2)
    s.add_argument("--object-store-mb", type=int, default=80)
    s.add_argument("--no-dashboard", action="store_true", help="no dashboard (no job submission)")
    s.add_argument("--simulate", metavar="ACCEL_TYPE", help="also start simulated TPU slice hosts, e.g. v4-16")
    s.add_argument("--slices", type=int, default=1, help="number of simulated slices (with --simulate)")
    s.add_argument("--timeout", type=float, default=240.0)
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_head_start)
    s = head.add_parser("stop", parents=[common],
                        help="stop the head started from --run-dir (only processes proven its own)")
    s.set_defaults(fn=cmd_head_stop)
    s = head.add_parser("status", parents=[common], help="is it alive; where it listens; nodes and TPU slices")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_head_status)

    s = sub.add_parser("slices", parents=[common], help="TPU slices of the cluster (from node labels)")
    s.add_argument("--gcs-address", help="GCS address ip:port (default: the head in --run-dir)")
    s.set_defaults(fn=cmd_slices)

    job = sub.add_parser("job", help="Ray jobs").add_subparsers(dest="action", required=True)

    def addr(sp):
        sp.add_argument("--address", help="dashboard URL http://host:port (default: the head in --run-dir)")
        sp.add_argument("--token-file", help="the cluster's auth token file (default: RAY_AUTH_TOKEN[_PATH], "
                                             "else the head in --run-dir)")
        return sp

    s = addr(job.add_parser("submit", parents=[common],
                            help="submit an entrypoint; follows its logs unless --no-wait"))
    s.add_argument("--working-dir", help="directory uploaded as the job's working dir (.venv, .git excluded)")
    s.add_argument("--env", action="append", metavar="KEY=VALUE", help="environment variable for the job")
    s.add_argument("--runtime-env-json", help="extra runtime_env as JSON")
    s.add_argument("--submission-id")
    s.add_argument("--entrypoint-resources", metavar="JSON",
                   help='resources the job\'s driver needs, e.g. \'{"TPU": 4}\' (places it on such a host)')
    s.add_argument("--entrypoint-num-cpus", type=float)
    s.add_argument("--no-wait", action="store_true")
    s.add_argument("entrypoint", nargs=argparse.REMAINDER, help="-- command ...")
    s.set_defaults(fn=cmd_job_submit)
    s = addr(job.add_parser("list", parents=[common], help="every job of the cluster"))
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_job_list)
    s = addr(job.add_parser("logs", parents=[common]))
    s.add_argument("job_id")
    s.add_argument("--follow", action="store_true")
    s.set_defaults(fn=cmd_job_logs)
    s = addr(job.add_parser("status", parents=[common]))
    s.add_argument("job_id")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_job_status)
    s = addr(job.add_parser("stop", parents=[common]))
    s.add_argument("job_id")
    s.set_defaults(fn=cmd_job_stop)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except (ValueError, TypeError, FileNotFoundError, TimeoutError, RuntimeError) as e:
        print(f"torchtpu-ray: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
