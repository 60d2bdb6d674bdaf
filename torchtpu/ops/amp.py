"""The two ops of ``torch.amp.GradScaler``: unscale-and-check the gradients, update the scale.

CUDA's semantics (ATen's ``AmpKernels``): ``found_inf`` becomes 1 when any element of any
gradient is inf or nan (it is never reset to 0 here: the scaler zeroes it), every gradient is
multiplied by ``inv_scale``; the scale backs off on a found inf and grows after
``growth_interval`` clean steps unless growing would overflow float32. Without these the
scaler's step ran both through the CPU fallback. The in-place forms are derived.
"""

from __future__ import annotations

import jax.numpy as jnp

from ..dispatch.lowering import lower


@lower("_amp_foreach_non_finite_check_and_unscale")
def _unscale(grads, found_inf, inv_scale):
    bad = jnp.zeros((), bool)
    for g in grads:
        bad = bad | ~jnp.all(jnp.isfinite(g))
    inv = inv_scale.reshape(())
    # the product in float32 at least (CUDA's opmath), stored back in the gradient's dtype
    out = [(g.astype(jnp.promote_types(g.dtype, jnp.float32)) * inv).astype(g.dtype) for g in grads]
    return out, jnp.where(bad, jnp.ones_like(found_inf), found_inf)


@lower("_amp_update_scale")
def _update_scale(scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval):
    inf = found_inf.reshape(()) != 0
    successful = growth_tracker + 1
    grown = scale * jnp.asarray(growth_factor, scale.dtype)
    grow = successful == growth_interval
    new_scale = jnp.where(inf, scale * jnp.asarray(backoff_factor, scale.dtype),
                          jnp.where(grow & jnp.isfinite(grown), grown, scale))
    new_tracker = jnp.where(inf | grow, jnp.zeros_like(growth_tracker), successful)
    return new_scale, new_tracker
