"""``torch_tpu._loader.load()``: what Ray calls before ``init_process_group("tpu_dist")``."""


def load() -> None:
    """Import torchtpu: the ``tpu`` device, ``torch.tpu`` and the c10d backends ``tpu`` and
    ``tpu_dist`` (``import torchtpu`` registers them; idempotent)."""
    import torchtpu  # noqa: F401
