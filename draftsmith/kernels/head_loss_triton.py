"""The Triton kernel of kernels/fused_head_loss.py: one program per row of a chunk of student logits, which it turns
into the loss's gradient in place. Imported only where Triton is (fused_head_loss.py loads it lazily).

Per row r, with student logits z (V,), teacher logits t (V,) or a label y, q = softmax(z), p = softmax(t):

    soft_ce = lse(z) - sum_x p(x) z(x)                               d/dz = q - p
    kl      = sum_x p(x) t(x) - lse(t) - (sum_x p(x) z(x) - lse(z))   d/dz = q - p
    lk      = w kl + (1 - w)(1 - alpha),  alpha = sum_x min(p, q),  w = exp(-eta alpha) (not differentiated)
              d alpha / dz_j = m_j q_j - q_j sum_x m_x q_x,  m = 1 where q < p, 1/2 where q = p (torch.minimum's
              gradient), 0 elsewhere
    ce      = lse(z) - z(y)                                           d/dz = q - onehot(y)
    ce_l1   = a ce + b l1,  l1 = sum_x |q - p|  (DSpark's CE and L1 terms; LOSS holds l1, CE_OUT ce)
              d/dz = a (q - onehot(y)) + b (q s - q sum_x q s),  s = sign(q - p) (torch.abs's gradient: 0 at 0)

Pass 1 reads the row once, a BLOCK of the vocabulary at a time: online max and sum of exponentials for z and t (the
running sums rescaled when the maximum moves), sum exp(t - m_t) z and sum exp(t - m_t) t for the cross terms, both
argmaxes (first index of the maximum, as torch.argmax) and whether z or t holds a non-finite value. Pass 2, LK's and
CE_L1's only, sums what needs both normalisers: min(p, q) and m q (LK), |q - p| and q s (CE_L1). Pass 3 writes
row_weight[r] * d loss_r / d z over z (z's dtype). A row whose weight is 0 (a masked position) gets a zero gradient
even if its logits are not finite.
"""

from __future__ import annotations

import triton
import triton.language as tl

SOFT_CE, KL, LK, CE, CE_L1 = 0, 1, 2, 3, 4  # KIND


def _head_loss_rows(Z, z_stride, T, t_stride, LABELS, ROW_WEIGHT, LOSS, STUDENT_ARG, TEACHER_ARG, V, lk_eta,
                    CE_OUT, ce_w, l1_w, KIND: tl.constexpr, HAS_GRAD: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    z_row = Z + row * z_stride
    t_row = T + row * t_stride
    inf = float("inf")

    m_z = -inf  # running max of z, and sum exp(z - m_z)
    s_z = 0.0
    m_t = -inf  # of t, with sum exp(t - m_t) z and sum exp(t - m_t) t
    s_t = 0.0
    cross = 0.0
    self_t = 0.0
    best_z = -inf
    arg_z = 0
    best_t = -inf
    arg_t = 0
    bad_z = 0
    bad_t = 0
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < V
        z = tl.load(z_row + cols, mask=inside, other=-inf).to(tl.float32)
        bad_z += tl.sum((inside & ~(tl.abs(z) < inf)).to(tl.int32), axis=0)
        top = tl.max(z, axis=0)
        at = tl.argmax(z, axis=0)
        arg_z = tl.where(top > best_z, start + at, arg_z)
        best_z = tl.maximum(best_z, top)
        new_m = tl.maximum(m_z, top)
        s_z = s_z * tl.exp(m_z - new_m) + tl.sum(tl.exp(z - new_m), axis=0)
        m_z = new_m
        if KIND != 3:
            t = tl.load(t_row + cols, mask=inside, other=-inf).to(tl.float32)
            bad_t += tl.sum((inside & ~(tl.abs(t) < inf)).to(tl.int32), axis=0)
            top_t = tl.max(t, axis=0)
            at_t = tl.argmax(t, axis=0)
            arg_t = tl.where(top_t > best_t, start + at_t, arg_t)
            best_t = tl.maximum(best_t, top_t)
            new_mt = tl.maximum(m_t, top_t)
            rescale = tl.exp(m_t - new_mt)
            e = tl.where(inside, tl.exp(t - new_mt), 0.0)
            s_t = s_t * rescale + tl.sum(e, axis=0)
            if KIND != 4:
                cross = cross * rescale + tl.sum(e * tl.where(inside, z, 0.0), axis=0)
            if KIND == 1 or KIND == 2:
                self_t = self_t * rescale + tl.sum(e * tl.where(inside, t, 0.0), axis=0)
            m_t = new_mt

    lse_z = m_z + tl.log(s_z)
    if KIND == 3:
        label = tl.load(LABELS + row)
        loss = lse_z - tl.load(z_row + label).to(tl.float32)
    else:
        lse_t = m_t + tl.log(s_t)
        if KIND == 4:
            label = tl.load(LABELS + row)
            ce = lse_z - tl.load(z_row + label).to(tl.float32)
        else:
            p_z = cross / s_t  # sum_x p(x) z(x)
            if KIND == 0:
                loss = lse_z - p_z
            else:
                kl = self_t / s_t - lse_t - (p_z - lse_z)
                loss = kl

    alpha = 0.0  # LK: sum_x min(p, q) and sum_x m_x q_x
    under = 0.0
    l1 = 0.0  # CE_L1: sum_x |q - p| and sum_x q_x sign(q_x - p_x)
    qs = 0.0
    if KIND == 2 or KIND == 4:  # the sums that need both normalisers
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            inside = cols < V
            q = tl.exp(tl.load(z_row + cols, mask=inside, other=-inf).to(tl.float32) - lse_z)
            p = tl.exp(tl.load(t_row + cols, mask=inside, other=-inf).to(tl.float32) - lse_t)
            if KIND == 2:
                alpha += tl.sum(tl.minimum(p, q), axis=0)
                m = tl.where(q < p, 1.0, tl.where(q == p, 0.5, 0.0))
                under += tl.sum(m * q, axis=0)
            else:
                l1 += tl.sum(tl.abs(q - p), axis=0)
                sign = tl.where(q > p, 1.0, tl.where(q < p, -1.0, 0.0))
                qs += tl.sum(sign * q, axis=0)
    if KIND == 2:
        w_kl = tl.exp(-lk_eta * alpha)
        loss = w_kl * kl + (1.0 - w_kl) * (1.0 - alpha)
    if KIND == 4:
        loss = l1
        tl.store(CE_OUT + row, ce)

    tl.store(LOSS + row, loss)
    tl.store(STUDENT_ARG + row, tl.where(bad_z > 0, -1, arg_z).to(tl.int64))
    tl.store(TEACHER_ARG + row, tl.where(bad_t > 0, -2, arg_t).to(tl.int64))

    if HAS_GRAD:
        weight = tl.load(ROW_WEIGHT + row).to(tl.float32)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            inside = cols < V
            z = tl.load(z_row + cols, mask=inside, other=-inf).to(tl.float32)
            q = tl.exp(z - lse_z)
            if KIND == 3:
                g = q - tl.where(cols == label, 1.0, 0.0)
            else:
                p = tl.exp(tl.load(t_row + cols, mask=inside, other=-inf).to(tl.float32) - lse_t)
                if KIND == 4:
                    sign = tl.where(q > p, 1.0, tl.where(q < p, -1.0, 0.0))
                    g = ce_w * (q - tl.where(cols == label, 1.0, 0.0)) + l1_w * (q * sign - q * qs)
                else:
                    g = q - p
                    if KIND == 2:
                        m = tl.where(q < p, 1.0, tl.where(q == p, 0.5, 0.0))
                        g = w_kl * g - (1.0 - w_kl) * (m * q - q * under)
            g = tl.where(weight != 0.0, g * weight, 0.0)
            tl.store(z_row + cols, g.to(Z.dtype.element_ty), mask=inside)


compiled = triton.jit(_head_loss_rows)  # CUDA and ROCm tensors


def interpreted():
    """The same kernel under Triton's interpreter (numpy, CPU tensors): what the CPU tests run. Built on request,
    whatever TRITON_INTERPRET says, so that the compiled kernel and this one can share one process."""
    from triton.runtime.interpreter import InterpretedFunction

    return InterpretedFunction(_head_loss_rows)
