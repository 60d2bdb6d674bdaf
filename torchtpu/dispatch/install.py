"""The installer: one ``torch.library`` kernel per entry of the lowering table.

``install()`` registers, for the PrivateUse1 key: every hand-written kernel
(``lowering.IMPLS``), a :class:`~torchtpu.dispatch.kernel.Kernel` per lowering
(``lowering.LOWERINGS``), the derived in-place form of each lowered op
(``add_`` runs ``add``'s lowering and writes into ``self``) and the derived
``out=`` forms. It can be called again after more lowerings were added (a
test's own op namespace, an extension): what is installed stays.
"""

from __future__ import annotations

import torch

from ..base.opnames import op_from_name, qualified_name
from ..base.dtypes import scalar_type_name
from ..base.frames import warn_at_user_line
from .kernel import MIXED_DEVICE, Kernel
from .lowering import IMPLS, LOWERINGS

aten = torch.ops.aten

KERNELS: dict[str, Kernel] = {}  # qualified name -> the Kernel installed for it (lowered ops only)
_installed: set[str] = set()  # every qualified name this module installed a kernel for
_LIBS: dict = {}


def installed(qual: str) -> bool:
    """Has a tpu kernel been installed for the op ``qual`` (a qualified name)?"""
    return qual in _installed


def _lib_for(op) -> torch.library.Library:
    """The IMPL library of ``op``'s namespace (aten, fbgemm, a test's own, ...)."""
    ns = op._schema.name.split("::")[0]
    lib = _LIBS.get(ns)
    if lib is None:
        lib = _LIBS[ns] = torch.library.Library(ns, "IMPL")
    return lib


def install_kernel(op: torch._ops.OpOverload, lowering, functional=None) -> None:
    """Install a :class:`Kernel` running ``lowering`` for ``op`` (once; a second call is a no-op)."""
    qual = qualified_name(op)
    if qual in _installed:
        return
    k = Kernel(op, lowering, functional)
    KERNELS[qual] = k
    _lib_for(op).impl(op, k.__call__, "PrivateUse1")
    _installed.add(qual)


def install_impl(qual: str, fn) -> None:
    """Install hand-written python kernel ``fn`` for the op ``qual``."""
    if qual in _installed:
        raise RuntimeError(f"torchtpu: two kernels for {qual}")
    op = op_from_name(qual)
    _lib_for(op).impl(op, fn, "PrivateUse1")
    _installed.add(qual)


def _functional_of(op: torch._ops.OpOverload):
    """``aten.add_.Tensor`` -> ``aten.add.Tensor`` (None if not an in-place op)."""
    name = op._schema.name.split("::")[1]
    if not name.endswith("_") or name.startswith("_") and name.endswith("__"):
        return None
    base = name[:-1]
    overload = op._overloadname
    packet = getattr(aten, base, None)
    if packet is None:
        return None
    return getattr(packet, overload, None)


def install() -> None:
    """Install kernels for every table entry not installed yet, and their derived forms."""
    for qual, fn in list(IMPLS.items()):
        if qual not in _installed:
            install_impl(qual, fn)
    for qual, lowering in list(LOWERINGS.items()):
        install_kernel(op_from_name(qual), lowering)
    # derive in-place forms; dir(aten) lists only the op packets loaded so far, so load
    # every aten packet first (or ops like put_ would be missed)
    for name in torch._C._dispatch_get_all_op_names():
        if name.startswith("aten::"):
            try:
                getattr(aten, name[6:].split(".")[0])
            except (AttributeError, RuntimeError):
                pass
    for name in dir(aten):
        if not name.endswith("_") or name.startswith("__"):
            continue
        packet = getattr(aten, name)
        for overload in packet.overloads():
            op = getattr(packet, overload)
            qual = f"aten::{name}.{overload}"
            if qual in _installed or qual in LOWERINGS:
                continue
            fop = _functional_of(op)
            if fop is None:
                continue
            low = LOWERINGS.get(qualified_name(fop))
            if low is None:
                continue
            install_kernel(op, low, functional=fop)
    install_out_variants()


def _functional_of_out(op):
    """``aten.add.out`` -> ``aten.add.Tensor``-style functional overload with the same inputs."""
    name = op._schema.name.split("::")[1]
    packet = getattr(aten, name)
    out_names = {a.name for a in op._schema.arguments if a.kwarg_only and a.alias_info is not None and a.alias_info.is_write}
    want = [a.name for a in op._schema.arguments if a.name not in out_names]
    for ov in packet.overloads():
        cand = getattr(packet, ov)
        if cand is op or any(a.alias_info is not None and a.alias_info.is_write for a in cand._schema.arguments):
            continue
        if [a.name for a in cand._schema.arguments] == want:
            return cand, [a.name for a in op._schema.arguments if a.name in out_names]
    return None, None


def _make_out_kernel(op, fop, out_names):
    schema_args = list(op._schema.arguments)
    fnames = [a.name for a in fop._schema.arguments]
    npos = sum(1 for a in fop._schema.arguments if not a.kwarg_only)
    defaults = {a.name: a.default_value for a in schema_args if a.has_default_value()}

    def out_kernel(*args, **kwargs):
        bound = dict(zip([a.name for a in schema_args], args))
        bound.update(kwargs)
        fargs = [bound[n] if n in bound else defaults[n] for n in fnames]
        # keyword-only arguments (sum.dim_IntList's dtype) must be passed by keyword
        res = fop(*fargs[:npos], **dict(zip(fnames[npos:], fargs[npos:])))
        res_flat = res if isinstance(res, (tuple, list)) else (res,)
        outs = []
        for n in out_names:  # a ``Tensor(a!)[] out`` (split_with_sizes_copy.out) is one list of outputs
            outs.extend(bound[n]) if isinstance(bound[n], (list, tuple)) else outs.append(bound[n])
        if len(outs) != len(res_flat):
            raise RuntimeError(f"{op._schema.name}: {len(outs)} out tensors given for {len(res_flat)} results")
        for o, r in zip(outs, res_flat):
            if o.device.type != "tpu":
                raise RuntimeError(MIXED_DEVICE.format("tpu:0", o.device))
            if o.dtype != r.dtype and not torch.can_cast(r.dtype, o.dtype):
                raise RuntimeError(f"result type {scalar_type_name(r.dtype)} can't be cast to the desired output "
                                   f"type {scalar_type_name(o.dtype)}")
            if tuple(o.shape) != tuple(r.shape):
                if o.numel():  # PyTorch's resize_output warning
                    warn_at_user_line(
                        f"An output with one or more elements was resized since it had shape {list(o.shape)}, which "
                        f"does not match the required output shape {list(r.shape)}. This behavior is deprecated, and "
                        "in a future PyTorch release outputs will not be resized unless they have zero elements. You "
                        "can explicitly reuse an out tensor t by resizing it, inplace, to zero elements with "
                        "t.resize_(0).")
                o.resize_(r.shape)
            o.copy_(r)
        if any(isinstance(bound[n], (list, tuple)) for n in out_names):
            return None  # such ops return nothing
        return outs[0] if len(outs) == 1 else tuple(outs)

    return out_kernel


def install_out_variants() -> None:
    """Derive the ``out=`` kernel of every aten op whose functional overload has a tpu kernel."""
    for name in dir(aten):
        if name.startswith("__"):
            continue
        packet = getattr(aten, name)
        if not isinstance(packet, torch._ops.OpOverloadPacket):
            continue
        for ov in packet.overloads():
            if not ov.endswith("out"):
                continue
            qual = f"aten::{name}.{ov}"
            if qual in _installed:
                continue
            op = getattr(packet, ov)
            fop, out_names = _functional_of_out(op)
            if fop is None or qualified_name(fop) not in _installed:
                continue
            _lib_for(op).impl(op, _make_out_kernel(op, fop, out_names), "PrivateUse1")
            _installed.add(qual)
