"""RLHF with PPO on tpu: a small policy learns digit completion from a programmatic reward.

The same topology as ``rlhf_grpo.py`` (learner actor with the colocated reference
policy and a critic, rollout-worker actors, weight sync after every step), with PPO:
a value head on a copy of the policy trunk, GAE over token rewards (the score on the
last token minus ``kl_coef`` * k1 per token), clipped policy and value losses.

    python examples/rlhf_ppo.py --out runs/rlhf_ppo
    ray job submit --address http://127.0.0.1:<dashboard port> --working-dir . -- \\
        python examples/rlhf_ppo.py --out runs/rlhf_ppo

Shows a progress bar; writes ``metrics.json`` and ``reward.png`` to ``--out``.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import rl_common  # noqa: E402


def main(argv=None):
    args = rl_common.parse_args("ppo", argv, steps=60, lr=1e-2, kl_coef=0.01, group_size=4, prompts_per_step=16)
    return rl_common.run("ppo", args, learner_extra={"ppo_epochs": 2, "gamma": 1.0, "lam": 0.95})


if __name__ == "__main__":
    main()
