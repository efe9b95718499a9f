"""Independent float64 reference of the V4 forward, for parity tests only.

Written from reference/v4-model-spec.md §1–3 with explicit masks, loops over
segments / entries / heads and full [L, L] score matrices (fine at test sizes). It
reads parameters from a state dict by released name and shares no code with
``v4launch.model``. ``TieError`` is raised when the indexer's top-k boundary is
ambiguous, so a test can redraw its inputs.
"""

from __future__ import annotations

import math

import torch

F64 = torch.float64


class TieError(RuntimeError):
    pass


def rms(x, w, eps):
    y = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
    return y * w if w is not None else y


def inv_freq(args, ratio):
    rd = args.rope_head_dim
    theta = args.compress_rope_theta if ratio else args.rope_theta
    f = torch.tensor([theta ** (-2.0 * i / rd) for i in range(rd // 2)], dtype=F64)
    if ratio and args.original_seq_len > 0:
        def dim_for(turns):  # channel index whose wavelength is original_seq_len / turns
            return rd * math.log(args.original_seq_len / (turns * 2 * math.pi)) / (2 * math.log(theta))
        lo = max(math.floor(dim_for(args.beta_fast)), 0)
        hi = min(math.ceil(dim_for(args.beta_slow)), rd - 1)
        out = []
        for i in range(rd // 2):
            ramp = min(max((i - lo) / (hi - lo), 0.0), 1.0)
            out.append(f[i].item() * (1 - ramp) + f[i].item() / args.rope_factor * ramp)
        f = torch.tensor(out, dtype=F64)
    return f


def rope(x, pos, freqs, inverse=False):
    """Rotate the last 2*len(freqs) channels of x [L, ..., d] at positions pos [L] (complex form)."""
    rd = 2 * freqs.numel()
    z = torch.view_as_complex(x[..., -rd:].contiguous().view(*x.shape[:-1], rd // 2, 2))
    ang = pos.to(F64)[:, None] * freqs[None, :]
    if inverse:
        ang = -ang
    rot = torch.polar(torch.ones_like(ang), ang)
    rot = rot.view(rot.shape[0], *([1] * (z.dim() - 2)), rot.shape[-1])
    out = torch.view_as_real(z * rot).reshape(*x.shape[:-1], rd)
    return torch.cat([x[..., :-rd], out], -1)


def hadamard(n):
    h = torch.tensor([[1.0]], dtype=F64)
    base = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=F64)
    while h.shape[0] < n:
        h = torch.kron(base, h)
    return h / math.sqrt(n)


def compress(sd, pre, x, ratio, d, args, freqs, rotate):
    """Entries of one segment, x [L, dim] -> [L // ratio, d]."""
    kv, sc = x @ sd[pre + "wkv.weight"].T, x @ sd[pre + "wgate.weight"].T
    ape = sd[pre + "ape"]
    entries = []
    for i in range(x.shape[0] // ratio):
        slots_kv, slots_sc = [], []
        if ratio == 4:
            for j in range(4):
                t = 4 * i - 4 + j
                if i > 0:
                    slots_kv.append(kv[t, :d]); slots_sc.append(sc[t, :d] + ape[j, :d])
                else:
                    slots_kv.append(torch.zeros(d, dtype=F64)); slots_sc.append(torch.full((d,), -math.inf, dtype=F64))
            for j in range(4):
                t = 4 * i + j
                slots_kv.append(kv[t, d:]); slots_sc.append(sc[t, d:] + ape[j, d:])
        else:
            for j in range(ratio):
                slots_kv.append(kv[ratio * i + j]); slots_sc.append(sc[ratio * i + j] + ape[j])
        K, S = torch.stack(slots_kv), torch.stack(slots_sc)
        entries.append((torch.softmax(S, 0) * K).sum(0))
    if not entries:
        return torch.zeros(0, d, dtype=F64)
    c = rms(torch.stack(entries), sd[pre + "norm.weight"], args.norm_eps)
    c = rope(c, torch.arange(c.shape[0]) * ratio, freqs)
    return c @ hadamard(d) if rotate else c


def attention(sd, pre, x, layer_id, args, phase):
    """One segment through layer attention. Returns (out [L, dim], kl_sum, kl_rows)."""
    L, H, D, eps = x.shape[0], args.n_heads, args.head_dim, args.norm_eps
    ratio = args.compress_ratios[layer_id]
    freqs = inv_freq(args, ratio)
    pos = torch.arange(L)
    qr = rms(x @ sd[pre + "wq_a.weight"].T, sd[pre + "q_norm.weight"], eps)
    q = (qr @ sd[pre + "wq_b.weight"].T).view(L, H, D)
    q = rope(rms(q, None, eps), pos, freqs)
    kv = rope(rms(x @ sd[pre + "wkv.weight"].T, sd[pre + "kv_norm.weight"], eps), pos, freqs)
    t_idx, s_idx = pos[:, None], pos[None, :]
    win_mask = (s_idx <= t_idx) & (s_idx > t_idx - args.window_size)  # [L, L]
    comp = torch.zeros(0, D, dtype=F64)
    comp_mask = torch.zeros(L, 0, dtype=torch.bool)
    kl_sum, kl_rows = torch.zeros((), dtype=F64), 0
    has_indexer = ratio == 4 and phase != "dense"
    if ratio:
        comp = compress(sd, pre + "compressor.", x, ratio, D, args, freqs, False)
        n = comp.shape[0]
        vis = torch.arange(n)[None, :] < ((pos + 1) // ratio)[:, None]  # [L, n]
        comp_mask = vis.clone()
        if has_indexer and n:
            ip = pre + "indexer."
            hi, di = args.index_n_heads, args.index_head_dim
            keys = compress(sd, ip + "compressor.", x, 4, di, args, freqs, args.use_hadamard)
            iq = rope((qr @ sd[ip + "wq_b.weight"].T).view(L, hi, di), pos, freqs)
            if args.use_hadamard:
                iq = iq @ hadamard(di)
            w = (x @ sd[ip + "weights_proj.weight"].T) / math.sqrt(hi) / math.sqrt(di)
            I = torch.zeros(L, n, dtype=F64)
            for h in range(hi):
                I += w[:, h:h + 1] * torch.relu(iq[:, h] @ keys.T)
            for t in range(L):
                cand = vis[t].nonzero().flatten()
                if len(cand) > args.index_topk:
                    vals = I[t, cand].sort(descending=True).values
                    if (vals[args.index_topk - 1] - vals[args.index_topk]).abs() < 1e-9:
                        raise TieError(f"top-k tie at row {t}")
                    keep = cand[I[t, cand].argsort(descending=True)[: args.index_topk]]
                    comp_mask[t] = False
                    comp_mask[t, keep] = True
            kl_set = vis if phase == "warmup" else comp_mask
            for t in range(L):
                cset = kl_set[t].nonzero().flatten()
                if len(cset) == 0:
                    continue
                logit = torch.einsum("hd,nd->hn", q[t], comp[cset]) / math.sqrt(D)
                p_t = torch.softmax(logit, -1).sum(0) / H
                p_i = torch.softmax(I[t, cset], -1)
                kl_sum = kl_sum + (p_t * (p_t.log() - p_i.log())).sum()
                kl_rows += 1
    keys = torch.cat([kv, comp])  # [L + n, D]
    mask = torch.cat([win_mask, comp_mask], 1)  # [L, L + n]
    logits = torch.einsum("thd,sd->ths", q, keys) / math.sqrt(D)
    logits = logits.masked_fill(~mask[:, None, :], -math.inf)
    e = logits.exp()
    denom = e.sum(-1, keepdim=True) + sd[pre + "attn_sink"].exp()[None, :, None]
    o = torch.einsum("ths,sd->thd", e / denom, keys)
    o = rope(o, pos, freqs, inverse=True)
    G, R = args.o_groups, args.o_lora_rank
    wo_a = sd[pre + "wo_a.weight"]
    parts, width = [], H * D // G  # group g: features [g * width, (g + 1) * width) of the flattened heads
    flat = o.reshape(L, H * D)
    for g in range(G):
        parts.append(flat[:, g * width:(g + 1) * width] @ wo_a[g * R:(g + 1) * R].T)
    return torch.cat(parts, -1) @ sd[pre + "wo_b.weight"].T, kl_sum, kl_rows


def mhc_pre(sd, pre, sub, h, args):
    """h [L, hc, dim] -> (y [L, dim], post [L, hc], comb [L, hc, hc])."""
    L, hc, dim = h.shape
    fn, base, sc = sd[f"{pre}hc_{sub}_fn"], sd[f"{pre}hc_{sub}_base"], sd[f"{pre}hc_{sub}_scale"]
    ys, posts, combs = [], [], []
    for t in range(L):
        flat = h[t].reshape(-1)
        m = (fn @ flat) / torch.sqrt((flat * flat).mean() + args.norm_eps)
        pre_w = torch.sigmoid(m[:hc] * sc[0] + base[:hc]) + args.hc_eps
        post = 2 * torch.sigmoid(m[hc:2 * hc] * sc[1] + base[hc:2 * hc])
        c = (m[2 * hc:] * sc[2] + base[2 * hc:]).view(hc, hc)
        c = torch.exp(c - c.max(1, keepdim=True).values)
        c = c / c.sum(1, keepdim=True) + args.hc_eps
        c = c / (c.sum(0, keepdim=True) + args.hc_eps)
        for _ in range(args.hc_sinkhorn_iters - 1):
            c = c / (c.sum(1, keepdim=True) + args.hc_eps)
            c = c / (c.sum(0, keepdim=True) + args.hc_eps)
        ys.append((pre_w[:, None] * h[t]).sum(0)); posts.append(post); combs.append(c)
    return torch.stack(ys), torch.stack(posts), torch.stack(combs)


def mhc_post(f, h, post, comb):
    L, hc, _ = h.shape
    out = torch.empty_like(h)
    for k in range(hc):
        out[:, k] = post[:, k:k + 1] * f + sum(comb[:, j, k:k + 1] * h[:, j] for j in range(hc))
    return out


def hc_head(fn, base, sc, h, args):
    flat = h.reshape(h.shape[0], -1)
    m = (flat @ fn.T) / torch.sqrt((flat * flat).mean(-1, keepdim=True) + args.norm_eps)
    w = torch.sigmoid(m * sc + base) + args.hc_eps
    return (w[:, :, None] * h).sum(1)


def expert(sd, pre, x, lim):
    g, u = x @ sd[pre + "w1.weight"].T, x @ sd[pre + "w3.weight"].T
    if lim > 0:
        g, u = torch.minimum(g, torch.tensor(lim, dtype=F64)), u.clamp(-lim, lim)
    return (g * torch.sigmoid(g) * u)


def moe(sd, pre, x, tok, layer_id, args):
    """One segment: (y [L, dim], balance loss of the segment)."""
    E, K = args.n_routed_experts, args.n_activated_experts
    s = torch.sqrt(torch.log1p(torch.exp(x @ sd[pre + "gate.weight"].T)))  # [L, E]
    if layer_id < args.n_hash_layers:
        idx = sd[pre + "gate.tid2eid"][tok].long()
    else:
        idx = (s + sd[pre + "gate.bias"]).topk(K, dim=-1).indices
    y = torch.zeros_like(x)
    for t in range(x.shape[0]):
        wsel = s[t, idx[t]]
        wsel = wsel / wsel.sum() * args.route_scale
        for k in range(K):
            e = int(idx[t, k])
            h = expert(sd, f"{pre}experts.{e}.", x[t:t + 1], args.swiglu_limit) * wsel[k]
            y[t] += (h @ sd[f"{pre}experts.{e}.w2.weight"].T)[0]
    if args.n_shared_experts:
        y += expert(sd, pre + "shared_experts.", x, args.swiglu_limit) @ sd[pre + "shared_experts.w2.weight"].T
    L = x.shape[0]
    f = torch.zeros(E, dtype=F64)
    for t in range(L):
        for e in idx[t].tolist():
            f[e] += E / (K * L)
    P = (s / s.sum(1, keepdim=True)).mean(0)
    return y, (f * P).sum()


def block(sd, pre, h, tok, layer_id, args, phase):
    x, post, comb = mhc_pre(sd, pre, "attn", h, args)
    a, kl_sum, kl_rows = attention(sd, pre + "attn.", rms(x, sd[pre + "attn_norm.weight"], args.norm_eps),
                                   layer_id, args, phase)
    h = mhc_post(a, h, post, comb)
    x, post, comb = mhc_pre(sd, pre, "ffn", h, args)
    f, bal = moe(sd, pre + "ffn.", rms(x, sd[pre + "ffn_norm.weight"], args.norm_eps), tok, layer_id, args)
    return mhc_post(f, h, post, comb), kl_sum, kl_rows, bal


def model_forward(sd, args, tokens, cu, labels, phase):
    """Whole model on a packed batch, one segment at a time.

    Returns dict: logits [T, V], lm_loss, aux (same names as the model's ModelOutput).
    """
    eps = args.norm_eps
    logits_all, ce_sum, ce_n = [], 0.0, 0
    mtp_sum, mtp_n = [0.0] * args.n_mtp_layers, [0] * args.n_mtp_layers
    kl = {}
    bal = {}
    head = sd["head.weight"]
    for b in range(len(cu) - 1):
        tok, lab = tokens[cu[b]:cu[b + 1]], labels[cu[b]:cu[b + 1]]
        L = tok.numel()
        h = sd["embed.weight"][tok][:, None, :].repeat(1, args.hc_mult, 1)
        for i in range(args.n_layers):
            h, ks, kr, bl = block(sd, f"layers.{i}.", h, tok, i, args, phase)
            kl.setdefault(i, [0.0, 0]); kl[i][0] += ks; kl[i][1] += kr
            bal.setdefault(i, []).append(bl)
        x = rms(hc_head(sd["hc_head_fn"], sd["hc_head_base"], sd["hc_head_scale"], h, args), sd["norm.weight"], eps)
        lg = x @ head.T
        logits_all.append(lg)
        m = lab != -100
        ce_sum = ce_sum + torch.nn.functional.cross_entropy(lg[m], lab[m], reduction="sum") if m.any() else ce_sum
        ce_n += int(m.sum())
        mtok, mlab = tok, lab
        for k in range(args.n_mtp_layers):
            pre = f"mtp.{k}."
            mtok = torch.cat([mtok[1:], mtok.new_zeros(1)])
            mlab = torch.cat([mlab[1:], mlab.new_full((1,), -100)])
            e = rms(sd["embed.weight"][mtok], sd[pre + "enorm.weight"], eps) @ sd[pre + "e_proj.weight"].T
            hh = rms(h, sd[pre + "hnorm.weight"], eps) @ sd[pre + "h_proj.weight"].T
            lid = args.n_layers + k
            h, ks, kr, bl = block(sd, pre, e[:, None, :] + hh, mtok, lid, args, phase)
            kl.setdefault(lid, [0.0, 0]); kl[lid][0] += ks; kl[lid][1] += kr
            bal.setdefault(lid, []).append(bl)
            x = rms(hc_head(sd[pre + "hc_head_fn"], sd[pre + "hc_head_base"], sd[pre + "hc_head_scale"], h, args),
                    sd[pre + "norm.weight"], eps)
            mm = mlab != -100
            if mm.any():
                mtp_sum[k] = mtp_sum[k] + torch.nn.functional.cross_entropy((x @ head.T)[mm], mlab[mm], reduction="sum")
            mtp_n[k] += int(mm.sum())
    aux = {}
    for lid in sorted(bal):
        if phase != "dense" and args.compress_ratios[lid] == 4:
            aux[f"indexer_kl/layer_{lid:02d}"] = torch.as_tensor(kl[lid][0] / max(kl[lid][1], 1), dtype=F64)
        aux[f"balance/layer_{lid:02d}"] = torch.stack(bal[lid]).mean()
    for k in range(args.n_mtp_layers):
        aux[f"mtp/depth_{k + 1}"] = torch.as_tensor(mtp_sum[k] / max(mtp_n[k], 1), dtype=F64)
    return {"logits": torch.cat(logits_all), "lm_loss": torch.as_tensor(ce_sum / max(ce_n, 1), dtype=F64), "aux": aux}
