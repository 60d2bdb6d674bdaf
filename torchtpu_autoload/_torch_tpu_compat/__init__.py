"""``torch_tpu`` as Ray Train (and other code written for Google's TorchTPU) imports it: torchtpu's
stand-in, served only when opted in and only when no real ``torch_tpu`` is installed
(:func:`torchtpu_autoload.enable_torch_tpu_compat`).

Ray 2.60 hard-wires the name: ``ScalingConfig(use_tpu=True)`` makes its device manager ``import
torch_tpu`` (``ray.train.torch.get_device()`` is ``tpu`` only if that import works) and call
``torch_tpu._loader.load()`` before ``init_process_group("tpu_dist")``. This module is light on
purpose (no JAX): ``import torch_tpu`` is how Ray asks whether a tpu backend exists.
"""

IS_TORCHTPU_COMPAT = True  # how to tell this stand-in from Google's package


def __getattr__(name):
    # anything beyond the names Ray uses is torchtpu's own (torch_tpu.device_count(), ...)
    if name.startswith("__"):
        raise AttributeError(name)
    import torchtpu

    try:
        return getattr(torchtpu, name)
    except AttributeError:
        raise AttributeError(f"torch_tpu (torchtpu's compatibility module) has no attribute {name!r}") from None
