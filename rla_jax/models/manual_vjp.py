"""Layers whose backward passes are written by hand, for XLA:CPU.

Each computes autodiff's gradients (tests/train_test.py checks them against
jax.vjp of the plain formula) in a form XLA:CPU runs faster: weight
gradients as 2-D matmuls instead of transposed copies or multiply-and-reduce
fusions over the rows.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from rla_jax import sharding


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def rms_norm(x, scale_D, eps: float):
  """scale * x / rms(x) over the last axis: normalised in float32, cast
  back to x's dtype, then scaled (the reference models' order).

  The backward pass computes autodiff's gradients in float32, the scale's
  as a matmul of ones over the leading axes: XLA:CPU runs autodiff's
  multiply-and-reduce over the rows at ~1 GB/s (the norms were 6% of a
  SmolLM2 train step at 1,024 tokens; 30 norms' backward 400 -> 150 ms).
  """
  return _rms_norm_fwd(x, scale_D, eps)[0]


def _rms_norm_fwd(x, scale_D, eps):
  x32 = x.astype(jnp.float32)
  r = jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + eps)
  scale = scale_D.astype(x.dtype)
  y = scale.reshape((1,) * (x.ndim - 1) + scale.shape) * (x32 * r).astype(
      x.dtype)
  return y, (x, scale_D, r)


def _rms_norm_bwd(eps, residuals, dy):
  del eps
  x, scale_D, r = residuals
  x_hat = x.astype(jnp.float32) * r
  dy32 = dy.astype(jnp.float32)
  g = dy32 * scale_D.astype(jnp.float32).reshape(
      (1,) * (x.ndim - 1) + scale_D.shape)
  dx = r * (g - x_hat * jnp.mean(g * x_hat, -1, keepdims=True))
  lead = tuple(range(x.ndim - 1))
  d_scale = jax.lax.dot_general(jnp.ones(x.shape[:-1], jnp.float32),
                                dy32 * x_hat, ((lead, lead), ((), ())))
  return dx.astype(x.dtype), d_scale.astype(scale_D.dtype)


rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


def _mlp_hidden(gate_BxTxF, up_BxTxF):
  return sharding.constrain(jax.nn.silu(gate_BxTxF) * up_BxTxF,
                            ('batch', 'length', 'act_mlp'))


@jax.custom_vjp
def gated_mlp(x_BxTxD, w_gate_DxF, w_up_DxF, w_down_FxD):
  """down(silu(x @ w_gate) * (x @ w_up)), with a hand-written backward pass.

  The backward pass computes what autodiff does, with each weight gradient
  written as a 2-D [K, N] @ [N, M] matmul. XLA:CPU compiles autodiff's
  version with transposed copies of the [B, T, F] gradients that recompute
  the SiLU derivative and cost more than the matmuls themselves.
  """
  return _gated_mlp_fwd(x_BxTxD, w_gate_DxF, w_up_DxF, w_down_FxD)[0]


def _gated_mlp_fwd(x_BxTxD, w_gate_DxF, w_up_DxF, w_down_FxD):
  gate_BxTxF = x_BxTxD @ w_gate_DxF
  up_BxTxF = x_BxTxD @ w_up_DxF
  h_BxTxF = _mlp_hidden(gate_BxTxF, up_BxTxF)
  residuals = (x_BxTxD, w_gate_DxF, w_up_DxF, w_down_FxD, gate_BxTxF,
               up_BxTxF, h_BxTxF)
  return h_BxTxF @ w_down_FxD, residuals


def _gated_mlp_bwd(residuals, dout_BxTxD):
  x_BxTxD, w_gate_DxF, w_up_DxF, w_down_FxD, gate, up, h_BxTxF = residuals
  b, t, d = x_BxTxD.shape
  f = w_gate_DxF.shape[1]
  dh_BxTxF = dout_BxTxD @ w_down_FxD.T
  sig = jax.nn.sigmoid(gate)
  d_up = dh_BxTxF * gate * sig
  d_gate = dh_BxTxF * up * sig * (1 + gate * (1 - sig))
  dx_BxTxD = d_gate @ w_gate_DxF.T + d_up @ w_up_DxF.T
  x_NxD = x_BxTxD.reshape(b * t, d)
  dw_gate = x_NxD.T @ d_gate.reshape(b * t, f)
  dw_up = x_NxD.T @ d_up.reshape(b * t, f)
  dw_down = (dout_BxTxD.reshape(b * t, d).T @ h_BxTxF.reshape(b * t, f)).T
  return dx_BxTxD, dw_gate, dw_up, dw_down


gated_mlp.defvjp(_gated_mlp_fwd, _gated_mlp_bwd)
