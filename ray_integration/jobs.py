"""Ray job submission against a head's dashboard (``JobSubmissionClient``).

``address`` is the dashboard URL (``http://127.0.0.1:<port>``, what ``LocalHead.dashboard_url``
and ``ray job submit --address`` take). ``token`` is the cluster's auth token
(``LocalHead.token()``); without it, ``RAY_AUTH_TOKEN`` or the file ``RAY_AUTH_TOKEN_PATH`` names,
when set, as Ray's own clients read them.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import sys
import time
from typing import Dict, List, Optional, Sequence, TextIO, Union

# Never upload these with a working_dir: the venv alone is gigabytes.
DEFAULT_EXCLUDES = [".venv", ".git", ".run", "runs", "**/__pycache__", "*.egg-info", ".pytest_cache"]
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")


def _token(token: Optional[str]) -> Optional[str]:
    if token:
        return token
    if os.environ.get("RAY_AUTH_TOKEN"):
        return os.environ["RAY_AUTH_TOKEN"]
    path = os.environ.get("RAY_AUTH_TOKEN_PATH")
    if path:
        try:
            with open(path) as f:
                return f.read().strip()
        except OSError as e:
            raise ValueError(f"RAY_AUTH_TOKEN_PATH={path!r} cannot be read: {e}") from e
    return None


def _client(address: str, token: Optional[str] = None):
    from ray.job_submission import JobSubmissionClient

    if not address or not address.startswith(("http://", "https://")):
        raise ValueError(f"job address must be the dashboard URL (http://host:port), got {address!r}")
    tok = _token(token)
    return JobSubmissionClient(address, headers={"Authorization": f"Bearer {tok}"} if tok else None)


def submit(address: str, entrypoint: Union[str, Sequence[str]], *, working_dir: Optional[str] = None,
           env_vars: Optional[Dict[str, str]] = None, runtime_env: Optional[dict] = None,
           submission_id: Optional[str] = None, metadata: Optional[Dict[str, str]] = None,
           entrypoint_num_cpus: Optional[float] = None, excludes: Optional[List[str]] = None,
           entrypoint_resources: Optional[Dict[str, float]] = None, token: Optional[str] = None) -> str:
    """Submit ``entrypoint`` (a shell command string or an argv list); returns the submission id.
    ``entrypoint_resources`` (e.g. ``{"TPU": 4}``, or ``resources.tpu_actor_options(4)["resources"]``)
    places the job's driver on a host that has them."""
    if not isinstance(entrypoint, str):
        entrypoint = shlex.join(list(entrypoint))
    if not entrypoint.strip():
        raise ValueError("submit: empty entrypoint")
    renv = dict(runtime_env or {})
    if working_dir is not None:
        renv["working_dir"] = str(working_dir)
        renv["excludes"] = list(renv.get("excludes", [])) + list(DEFAULT_EXCLUDES if excludes is None else excludes)
    if env_vars:
        renv["env_vars"] = {**renv.get("env_vars", {}), **{str(k): str(v) for k, v in env_vars.items()}}
    kwargs = {}
    if entrypoint_num_cpus is not None:
        kwargs["entrypoint_num_cpus"] = entrypoint_num_cpus
    if entrypoint_resources:
        kwargs["entrypoint_resources"] = dict(entrypoint_resources)
    return _client(address, token).submit_job(entrypoint=entrypoint, runtime_env=renv or None,
                                       submission_id=submission_id, metadata=metadata, **kwargs)


def status(address: str, job_id: str, token: Optional[str] = None) -> str:
    """``PENDING``, ``RUNNING``, ``SUCCEEDED``, ``FAILED`` or ``STOPPED``."""
    return str(_client(address, token).get_job_status(job_id).value)


def info(address: str, job_id: str, token: Optional[str] = None) -> dict:
    i = _client(address, token).get_job_info(job_id)
    return {"submission_id": i.submission_id, "status": str(i.status.value), "message": i.message,
            "entrypoint": i.entrypoint, "start_time": i.start_time, "end_time": i.end_time,
            "driver_exit_code": getattr(i, "driver_exit_code", None)}


def logs(address: str, job_id: str, token: Optional[str] = None) -> str:
    return _client(address, token).get_job_logs(job_id)


def stop(address: str, job_id: str, token: Optional[str] = None) -> bool:
    return bool(_client(address, token).stop_job(job_id))


def wait(address: str, job_id: str, timeout_s: float = 300.0, poll_s: float = 0.5,
         token: Optional[str] = None) -> str:
    """Block until the job ends; returns its final status. TimeoutError names the job and its status."""
    c = _client(address, token)
    deadline = time.monotonic() + timeout_s
    while True:
        st = str(c.get_job_status(job_id).value)
        if st in TERMINAL:
            return st
        if time.monotonic() > deadline:
            raise TimeoutError(f"job {job_id} still {st} after {timeout_s}s")
        time.sleep(poll_s)


def follow_logs(address: str, job_id: str, out: TextIO = None, token: Optional[str] = None) -> str:
    """Stream the job's logs to ``out`` (stdout) until it ends; returns the final status."""
    out = out or sys.stdout
    c = _client(address, token)

    async def _tail():
        async for chunk in c.tail_job_logs(job_id):
            out.write(chunk)
            out.flush()

    asyncio.run(_tail())
    # The log stream closes when the job ends; the status may lag by a moment.
    return wait(address, job_id, timeout_s=30, token=token)


def list_jobs(address: str, token: Optional[str] = None) -> List[dict]:
    """Every job the cluster knows: ``submission_id``, ``status``, ``entrypoint``, times."""
    return [{"submission_id": i.submission_id, "status": str(i.status.value), "entrypoint": i.entrypoint,
             "start_time": i.start_time, "end_time": i.end_time}
            for i in _client(address, token).list_jobs()]
