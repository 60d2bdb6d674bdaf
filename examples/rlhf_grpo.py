"""RLHF with GRPO on tpu: a small policy learns digit completion from a programmatic reward.

Topology (Ray actors, through ray_integration): one learner actor (policy, colocated
reference policy, AdamW), ``--workers`` rollout-worker actors generating on tpu with a
KV cache, weight sync learner -> workers after every step (object store by default,
``--transport collective`` for a torch.distributed broadcast), rewards computed by
a Python function (or ``--reward-actor``). ``--mode async`` overlaps generation with
training within ``--max-staleness`` policy versions.

    python examples/rlhf_grpo.py --out runs/rlhf_grpo          # starts its own local Ray head
    ray job submit --address http://127.0.0.1:<dashboard port> --working-dir . -- \\
        python examples/rlhf_grpo.py --out runs/rlhf_grpo      # on a running head

Shows a progress bar; writes ``metrics.json`` (per step: reward, KL, policy version,
timings) and ``reward.png`` to ``--out``.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import rl_common  # noqa: E402


def main(argv=None):
    args = rl_common.parse_args("grpo", argv, steps=60, lr=1e-2, kl_coef=0.01, group_size=8, prompts_per_step=8)
    return rl_common.run("grpo", args)


if __name__ == "__main__":
    main()
