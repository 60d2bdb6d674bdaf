"""Small reference models used by the tests, the quickstart, the benchmarks and
``torchtpu_rl`` (which reuses :class:`TinyTransformer` as a policy).

Plain PyTorch: nothing here knows about ``tpu``. A model is built (usually on
CPU, so the same initial weights can be compared across devices) and moved with
``.to(device)``. It lives outside ``torchtpu``: the core has no model zoo, and
error messages that point at "the user's line" treat these files as user code.
"""

from .dlrm import DLRMConfig, DLRMStyleMLP
from .parallel import block_tp_plan
from .training import TRAINING_STEP_MODES, training_step
from .transformer import KVCache, TinyTransformer, TransformerConfig

__all__ = ["DLRMConfig", "DLRMStyleMLP", "KVCache", "TRAINING_STEP_MODES", "TinyTransformer", "TransformerConfig",
           "block_tp_plan", "training_step"]
