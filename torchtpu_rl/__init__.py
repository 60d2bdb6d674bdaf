"""torchtpu_rl: RL post-training of language-model policies on tpu.

Single-process core: the policy interface (:mod:`.policy`), batched generation
with a KV cache and bucketed shapes (:mod:`.rollout`; Hugging Face models' cache
in :mod:`.hf_cache`, imported on first use), GRPO/PPO losses and
estimators (:mod:`.algorithms`) and the learner (:mod:`.learner`). On Ray:
rollout / learner / reward actors (:mod:`.workers`), versioned bucketed weight
sync (:mod:`.weight_sync`), the driver loop (:mod:`.driver`) and checkpoints
(:mod:`.checkpoint`). Text: Hugging Face checkpoints (:mod:`.hf`), prompts from files
(:mod:`.data`), TRL-style reward functions (:mod:`.rewards`), and the entry point
``python -m torchtpu_rl.train`` (:mod:`.train`). At the bottom: the wire types between the
driver and its workers (:mod:`.protocol`) and the typed run configuration (:mod:`.config`);
the actors are driven as worker groups with declared dispatch (:mod:`.worker_group`).
"""

from . import algorithms
from .algorithms import (
    agg_loss,
    gae,
    grpo_advantages,
    kl_estimate,
    masked_mean,
    masked_whiten,
    policy_loss,
    truncated_is_weights,
    value_loss,
)
from .learner import Learner
from .policy import (
    ValueModel,
    clone_policy,
    get_logits,
    is_hf_model,
    make_policy,
    policy_logits,
    position_ids_from_mask,
    sequence_logprobs,
    supports_kv_cache,
    token_logprobs,
)
from .config import ConfigError, LearnerConfig, RolloutConfig, RunConfig, SyncConfig
from .protocol import RolloutBatch, SamplingParams
from .rollout import RolloutEngine, sample_from_logits
from . import checkpoint, driver, weight_sync, workers  # noqa: E402  (import ray)
from .driver import PromptDataset, RewardError, RLDriver, ray_session  # noqa: E402
from .weight_sync import (  # noqa: E402
    BucketPlan,
    SyncAborted,
    WeightReceiver,
    WeightSender,
    WeightUpdate,
    install_state_dict,
    plan_buckets,
    tensor_checksums,
)
from .topology import Topology, make_topology  # noqa: E402
from .worker_group import LearnerClient, WorkerGroup, dispatch  # noqa: E402
from .workers import LearnerWorker, RewardModelActor, RolloutWorker  # noqa: E402
from . import data, hf, rewards  # noqa: E402  (text in, text out: Hugging Face checkpoints, prompts, rewards)
from .data import load_prompts  # noqa: E402
from .rewards import RewardSet  # noqa: E402

__all__ = [
    "BucketPlan",
    "ConfigError",
    "LearnerClient",
    "LearnerConfig",
    "RolloutConfig",
    "RunConfig",
    "SyncConfig",
    "WorkerGroup",
    "dispatch",
    "Learner",
    "LearnerWorker",
    "PromptDataset",
    "RLDriver",
    "RewardError",
    "RewardModelActor",
    "RolloutWorker",
    "SyncAborted",
    "Topology",
    "WeightReceiver",
    "WeightSender",
    "WeightUpdate",
    "checkpoint",
    "driver",
    "install_state_dict",
    "make_topology",
    "plan_buckets",
    "ray_session",
    "tensor_checksums",
    "weight_sync",
    "workers",
    "RolloutBatch",
    "RolloutEngine",
    "SamplingParams",
    "ValueModel",
    "agg_loss",
    "algorithms",
    "clone_policy",
    "gae",
    "get_logits",
    "grpo_advantages",
    "kl_estimate",
    "make_policy",
    "masked_mean",
    "masked_whiten",
    "policy_logits",
    "policy_loss",
    "sample_from_logits",
    "sequence_logprobs",
    "supports_kv_cache",
    "token_logprobs",
    "truncated_is_weights",
    "value_loss",
    "is_hf_model",
    "position_ids_from_mask",
    "RewardSet",
    "data",
    "hf",
    "load_prompts",
    "rewards",
]
