"""Dispatch: the lowering table (``lowering``), the kernel executor (``kernel``), the
``torch.library`` installer (``install``) and the CPU fallback (``fallback``)."""
