"""The reference backend: plain PyTorch math per slice, float64-capable. The oracle."""

from __future__ import annotations

import torch

from doccp.kernels.merge import merge_into
from doccp.kernels.slices import Slices
from doccp.masks import BandMask


def _visible(slice_row, mask: BandMask, device) -> torch.Tensor:
    qs, qe, ks, ke, qp, kp = slice_row
    qpos = qp + torch.arange(qe - qs, device=device)
    kpos = kp + torch.arange(ke - ks, device=device)
    return mask.allows(qpos[:, None], kpos[None, :])


def _scores(q, k, row, scale):
    """``[Hkv, G, m, n]`` scores of one slice (GQA by viewing q heads as [Hkv, G])."""
    qs, qe, ks, ke = row[:4]
    hkv = k.shape[1]
    qg = q[qs:qe].unflatten(1, (hkv, -1))  # [m, Hkv, G, D]
    return torch.einsum("mhgd,nhd->hgmn", qg, k[ks:ke]) * scale


def attend(q, k, v, slices: Slices, mask: BandMask, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    qc, kc, vc = q.to(compute), k.to(compute), v.to(compute)
    t, hq, d = q.shape
    out = torch.zeros(t, hq, v.shape[-1], dtype=compute, device=q.device)
    lse = torch.full((hq, t), float("-inf"), dtype=compute, device=q.device)
    for row in slices.rows():
        qs, qe, ks, ke = row[:4]
        if qe <= qs or ke <= ks:
            continue
        vis = _visible(row, mask, q.device)
        s = _scores(qc, kc, row, scale).masked_fill(~vis, float("-inf"))
        part_lse = torch.logsumexp(s, -1)  # [Hkv, G, m]
        p = torch.exp(s - torch.where(torch.isinf(part_lse), 0.0, part_lse)[..., None])
        part_out = torch.einsum("hgmn,nhd->mhgd", p, vc[ks:ke]).reshape(qe - qs, hq, -1)
        merge_into(out, lse, part_out, part_lse.reshape(hq, qe - qs), slice(qs, qe))
    return out.to(q.dtype), lse.to(torch.float64 if compute == torch.float64 else torch.float32)


def attend_backward(dout, q, k, v, out, lse, slices: Slices, mask: BandMask, scale: float):
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    qc, kc, vc = q.to(compute), k.to(compute), v.to(compute)
    doc_, outc = dout.to(compute), out.to(compute)
    hkv = k.shape[1]
    dq, dk, dv = torch.zeros_like(qc), torch.zeros_like(kc), torch.zeros_like(vc)
    delta = (doc_ * outc).sum(-1)  # [T, Hq]
    lse_c = lse.to(compute)
    for row in slices.rows():
        qs, qe, ks, ke = row[:4]
        if qe <= qs or ke <= ks:
            continue
        vis = _visible(row, mask, q.device)
        s = _scores(qc, kc, row, scale)
        rows_lse = lse_c[:, qs:qe].unflatten(0, (hkv, -1))  # [Hkv, G, m]
        p = torch.exp(s - torch.where(torch.isinf(rows_lse), 0.0, rows_lse)[..., None])
        p = p.masked_fill(~vis | torch.isinf(rows_lse)[..., None], 0.0)
        do_g = doc_[qs:qe].unflatten(1, (hkv, -1))  # [m, Hkv, G, D]
        dv[ks:ke] += torch.einsum("hgmn,mhgd->nhd", p, do_g)
        dp = torch.einsum("mhgd,nhd->hgmn", do_g, vc[ks:ke])
        dl = delta[qs:qe].unflatten(1, (hkv, -1)).permute(1, 2, 0)  # [Hkv, G, m]
        ds = p * (dp - dl[..., None]) * scale
        dq[qs:qe] += torch.einsum("hgmn,nhd->mhgd", ds, kc[ks:ke]).reshape(qe - qs, -1, q.shape[-1])
        dk[ks:ke] += torch.einsum("hgmn,mhgd->nhd", ds, qc[qs:qe].unflatten(1, (hkv, -1)))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
