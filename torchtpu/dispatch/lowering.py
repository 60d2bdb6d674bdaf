"""The lowering table: aten op -> JAX function, and the hand-written kernels.

Plain data: ``lower`` and ``impl`` only fill the two dicts; the executor
(``kernel.py``) reads a lowering when an op runs, the installer (``install.py``)
registers a kernel per entry with ``torch.library``, and compiled graphs
(``torchtpu/compile``) call the same lowerings, so every op has one source of
truth. A lowering is written for the *functional* form of an op
(``aten::add.Tensor``); the installer derives the in-place (``add_``) and
``out=`` (``add.out``) forms.
"""

from __future__ import annotations

from ..base.opnames import normalize


class Lowering:
    __slots__ = ("name", "fn", "static", "random", "allow_cpu", "meta", "warn")

    def __init__(self, name, fn, static=(), random=False, allow_cpu=False, meta=None, warn=None):
        self.name = name
        self.fn = fn
        self.static = frozenset(static)
        self.random = random
        self.allow_cpu = allow_cpu
        self.meta = meta
        self.warn = warn


LOWERINGS: dict[str, Lowering] = {}  # qualified op name -> its JAX lowering
IMPLS: dict[str, object] = {}  # qualified op name -> a hand-written python kernel (views, copies, host reads)


def lower(*names, static=(), random=False, allow_cpu=False, meta=None, warn=None):
    """Register ``fn`` as the JAX lowering of the aten ops ``names``.

    ``fn`` receives ALL the op's arguments positionally in schema order (keyword-only
    ones too, so don't declare them with ``*``): tensors as jax arrays,
    ``Scalar`` arguments as traced values (not recompiled per value) unless
    named in ``static``, everything else as python values. ``random=True``
    passes a ``key=`` jax PRNG key. ``allow_cpu`` accepts CPU tensor operands
    (copied in); ``meta`` replaces PyTorch's meta kernel for output shapes (and may add the
    shape checks CPU makes that the meta kernel leaves out); ``warn`` is called with the op's
    arguments (tensors as they are, and ``inplace=``) before every call and emits the warnings
    PyTorch's CPU kernel emits for those arguments. Index values are checked on the device from
    inside ``fn`` (``runtime/checks.check_index``).
    Return a jax array (or a tuple/list).
    """

    def deco(fn):
        for name in names:
            qual = normalize(name)
            if qual in LOWERINGS:
                raise RuntimeError(f"torchtpu: two lowerings for {qual}")
            LOWERINGS[qual] = Lowering(qual, fn, static, random, allow_cpu, meta, warn)
        return fn

    return deco


def impl(*names):
    """Register ``fn`` as the hand-written tpu kernel of the aten ops ``names`` (installed as is)."""

    def deco(fn):
        for name in names:
            qual = normalize(name)
            if qual in IMPLS:
                raise RuntimeError(f"torchtpu: two kernels for {qual}")
            IMPLS[qual] = fn
        return fn

    return deco
