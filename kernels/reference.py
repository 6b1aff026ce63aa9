"""Torch reference ops: the CPU path of the engine and the oracle for every Triton kernel.

Numerics follow Hugging Face's Qwen3-MoE so that logits match `transformers` on the same
checkpoint: norms and softmaxes in fp32, results cast back to the activation dtype.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in fp32, scaled after the cast back (as HF does)."""
    if x.dtype == torch.float32:  # the same arithmetic in one call (fewer ops per decode step)
        return F.rms_norm(x, x.shape[-1:], weight, eps)
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def rope_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    """cos/sin tables [*positions.shape, head_dim] for the rotate-half RoPE convention."""
    freqs = positions.float()[..., None] * inv_freq.to(positions.device)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rope_matrix(position: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """[D, D] R with x @ R == apply_rope(x, cos, sin) at one position: RoPE of many heads as one
    product (up to rounding: each output sums two products), built in a few ops."""
    freqs = inv_freq * float(position)  # the same fp32 products as rope_cos_sin's
    sin = freqs.sin()
    values = torch.cat((freqs.cos().repeat(2), sin, -sin))
    d = 2 * freqs.shape[0]
    return (
        torch.zeros(d * d, device=freqs.device)
        .index_copy_(0, _rope_slots(d, freqs.device), values)
        .view(d, d)
    )


@functools.lru_cache(maxsize=8)
def _rope_slots(d: int, device: torch.device) -> torch.Tensor:
    """Flat indices in R [D, D] for rope_matrix's values: the diagonal (cos), then
    R[j - D/2, j] = sin for j >= D/2 (out[j] += x[j - D/2] sin) and R[j + D/2, j] = -sin for
    j < D/2 (out[j] -= x[j + D/2] sin)."""
    half = d // 2
    diagonal = [j * d + j for j in range(d)]
    upper = [(j - half) * d + j for j in range(half, d)]
    lower = [(j + half) * d + j for j in range(half)]
    return torch.tensor(diagonal + upper + lower, device=device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., T, D] with cos/sin broadcastable to it (rotate-half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def causal_mask(
    q_positions: torch.Tensor, seq: int, sliding_window: int | None = None
) -> torch.Tensor:
    """[..., T, S] True where a query at q_positions [..., T] may see key j (key j sits at
    position j)."""
    key_pos = torch.arange(seq, device=q_positions.device)
    allowed = key_pos <= q_positions[..., None]
    if sliding_window is not None:
        allowed &= key_pos > q_positions[..., None] - sliding_window
    return allowed


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_positions: torch.Tensor,
    kv_len: torch.Tensor | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal GQA attention, prefill and decode alike.

    q [B, Hq, T, D]; k, v [B, Hkv, S, D] with Hq a multiple of Hkv; q_positions [B, T] the
    absolute position of each query (key j sits at position j). kv_len [B] masks keys at or past
    each row's length (ragged batches). Softmax in fp32; output [B, Hq, T, D] in q's dtype.
    Query head h reads KV head h // (Hq / Hkv), as transformers' repeat_kv does; the query heads
    of a group are stacked as rows instead of repeating K and V (no copy of the cache).
    """
    batch, n_q, n_tokens, head_dim = q.shape
    n_kv, seq = k.shape[1], k.shape[2]
    group = n_q // n_kv
    qg = q.reshape(batch, n_kv, group * n_tokens, head_dim)
    scores = torch.matmul(qg, k.transpose(-1, -2)) * (1.0 / math.sqrt(head_dim))  # [B, Hkv, G*T, S]
    # A lone query at the last position (decode of one sequence) sees every key: no mask to
    # build. Checked on the CPU only, where reading the position is no device sync.
    sees_all = (
        q.device.type == "cpu"
        and batch == 1
        and n_tokens == 1
        and kv_len is None
        and sliding_window is None
        and int(q_positions[0, 0]) == seq - 1
    )
    if not sees_all:
        allowed = causal_mask(q_positions, seq, sliding_window)  # [B, T, S]
        if kv_len is not None:
            allowed &= torch.arange(seq, device=q.device)[None, None, :] < kv_len[:, None, None]
        allowed = (
            allowed[:, None, None]
            .expand(batch, 1, group, n_tokens, seq)
            .reshape(batch, 1, group * n_tokens, seq)
        )
        scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v).reshape(batch, n_q, n_tokens, head_dim)


def attention_over_runs(
    q: torch.Tensor,
    key_runs: list[torch.Tensor],
    value_runs: list[torch.Tensor],
    q_positions: torch.Tensor,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """`attention` for one sequence whose keys lie in a few runs of consecutive pool slots.

    q [Hq, T, D]; key_runs / value_runs: views [n_i, Hkv, D] that together hold positions
    0..S-1 in order (a paged cache's blocks, consecutive ones merged). Reading the pool through
    views, rather than gathering every block into a new tensor, keeps a decode step's cost from
    growing with a copy of the whole cache. Returns [Hq, T, D].
    """
    n_q, n_tokens, head_dim = q.shape
    if n_tokens >= FUSED_PREFILL_ROWS:
        return _fused_attention_over_runs(q, key_runs, value_runs, q_positions, sliding_window)
    n_kv = key_runs[0].shape[1]
    group = n_q // n_kv
    qg = q.reshape(n_kv, group * n_tokens, head_dim)
    scale = 1.0 / math.sqrt(head_dim)
    # Plain matmuls over [Hkv, n, D] views: einsum's per-call parsing and permutes cost more
    # than the product itself at decode sizes.
    parts = [torch.matmul(qg, k.permute(1, 2, 0)) for k in key_runs]
    scores = (parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)) * scale
    seq = scores.shape[-1]
    # A lone query at the last position sees every key: no mask to build.
    if n_tokens > 1 or sliding_window is not None or int(q_positions[-1]) != seq - 1:
        allowed = causal_mask(q_positions, seq, sliding_window)  # [T, S]
        allowed = allowed[None].expand(group, n_tokens, seq).reshape(1, group * n_tokens, seq)
        scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return _probs_times_value_runs(probs, value_runs).reshape(n_q, n_tokens, head_dim)


# From this many queries on (a prefill chunk), the runs are joined and torch's fused attention
# computes the block: it never materialises the [Hq, T, S] scores, which at prompt lengths cost
# more than the copy of the keys and values (BENCHMARKS.md, "CPU prefill attention").
FUSED_PREFILL_ROWS = 16


def _fused_attention_over_runs(q, key_runs, value_runs, q_positions, sliding_window):
    """`attention_over_runs` by scaled_dot_product_attention over the joined runs: same
    causal (and sliding-window) mask, softmax in fp32 inside the fused kernel."""
    keys = key_runs[0] if len(key_runs) == 1 else torch.cat(key_runs)
    values = value_runs[0] if len(value_runs) == 1 else torch.cat(value_runs)
    allowed = causal_mask(q_positions, keys.shape[0], sliding_window)  # [T, S]
    out = F.scaled_dot_product_attention(
        q[None],
        keys.transpose(0, 1)[None],
        values.transpose(0, 1)[None],
        attn_mask=allowed,
        enable_gqa=True,
    )
    return out[0]


def _probs_times_value_runs(probs: torch.Tensor, value_runs: list[torch.Tensor]) -> torch.Tensor:
    """probs [Hkv, rows, S] times the values held in runs [n_i, Hkv, D] that cover S in order:
    [Hkv, rows, D], one product per run instead of a copy of all values."""
    out = None
    start = 0
    for v in value_runs:
        part = torch.matmul(probs[..., start : start + v.shape[0]], v.transpose(0, 1))
        out = part if out is None else out + part
        start += v.shape[0]
    return out


def attention_lean(
    q: torch.Tensor, key_runs: list[torch.Tensor], value_runs: list[torch.Tensor]
) -> torch.Tensor:
    """`attention_over_runs` for one query that sees every key (decode at the last position),
    with the softmax scale already in q. q [Hq, D]; runs [n_i, Hkv, D]. Returns [Hq, D]."""
    n_kv, head_dim = key_runs[0].shape[1], q.shape[-1]
    qg = q.view(n_kv, -1, head_dim)  # the query heads of one KV head stacked as rows
    if len(key_runs) == 1:  # a compacted sequence: its keys are one run
        probs = torch.softmax(
            torch.bmm(qg, key_runs[0].permute(1, 2, 0)), dim=-1, dtype=torch.float32
        )
        return torch.bmm(probs.to(q.dtype), value_runs[0].transpose(0, 1)).view(q.shape)
    scores = torch.cat([torch.bmm(qg, k.permute(1, 2, 0)) for k in key_runs], dim=-1)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return _probs_times_value_runs(probs, value_runs).view(q.shape)


def attention_rows(
    q: torch.Tensor, key_runs: list[torch.Tensor], value_runs: list[torch.Tensor]
) -> torch.Tensor:
    """`attention_lean` for the last n positions of one sequence, causal among them: row j sees
    keys 0..S-n+j. q [n, Hq, D] with the softmax scale in it; runs [n_i, Hkv, D] cover 0..S-1.
    Returns [n, Hq, D]."""
    n, n_q, head_dim = q.shape
    n_kv = key_runs[0].shape[1]
    qg = q.transpose(0, 1).reshape(n_kv, -1, head_dim)  # per KV head: its query heads' rows, n each
    scores = torch.cat([torch.bmm(qg, k.permute(1, 2, 0)) for k in key_runs], dim=-1)
    scores = scores.masked_fill(
        _tail_mask(n, scores.shape[-1], n_q // n_kv, q.device), float("-inf")
    )
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return _probs_times_value_runs(probs, value_runs).view(n_q, n, head_dim).transpose(0, 1)


def attention_beams(
    q: torch.Tensor,
    key_runs: list[torch.Tensor],
    value_runs: list[torch.Tensor],
    tail_keys: torch.Tensor,
    tail_values: torch.Tensor,
) -> torch.Tensor:
    """Attention of B beams' rows at one position (beam search): every row sees the keys they
    share (runs [n_i, Hkv, D], the prompt) and then its own beam's keys [B, t, Hkv, D] (its own
    among them). q [B, Hq, D] with the softmax scale in it. Returns [B, Hq, D]."""
    beams, n_q, head_dim = q.shape
    n_kv = tail_keys.shape[2]
    qb = q.view(beams, n_kv, n_q // n_kv, head_dim)  # [B, Hkv, group, D]
    qg = qb.transpose(0, 1).reshape(n_kv, -1, head_dim)  # per KV head: every beam's query heads
    shared = torch.cat(
        [torch.bmm(qg, k.permute(1, 2, 0)) for k in key_runs], dim=-1
    )  # [Hkv, B*group, P]
    own = torch.matmul(qb, tail_keys.permute(0, 2, 3, 1))  # [B, Hkv, group, t]
    shared = shared.view(n_kv, beams, -1, shared.shape[-1]).transpose(0, 1)  # [B, Hkv, group, P]
    probs = torch.softmax(torch.cat([shared, own], dim=-1), dim=-1, dtype=torch.float32).to(q.dtype)
    n_shared = shared.shape[-1]
    out_shared = _probs_times_value_runs(
        probs[..., :n_shared].transpose(0, 1).reshape(n_kv, -1, n_shared), value_runs
    )  # [Hkv, B*group, D]
    out_own = torch.matmul(
        probs[..., n_shared:], tail_values.permute(0, 2, 1, 3)
    )  # [B, Hkv, group, D]
    return (out_shared.view(n_kv, beams, -1, head_dim).transpose(0, 1) + out_own).reshape(
        beams, n_q, head_dim
    )


@functools.lru_cache(maxsize=4)  # built once per forward, read by every layer
def _tail_mask(n: int, seq: int, group: int, device: torch.device) -> torch.Tensor:
    """[group * n, S]: True at the keys after each of the last n rows (a group's rows repeat)."""
    hidden = (
        torch.arange(seq, device=device)[None] > torch.arange(seq - n, seq, device=device)[:, None]
    )
    return hidden.repeat(group, 1)


def route_one(logits: list[float], top_k: int, norm_topk_prob: bool) -> list[tuple[int, float]]:
    """`route` for one token, on its router logits as Python floats: [(expert, weight)] in
    descending order. Softmax in float64; top-k of the logits is top-k of the probabilities."""
    chosen = sorted(range(len(logits)), key=logits.__getitem__, reverse=True)[
        :top_k
    ]  # exact ties go to the lower id, which torch.topk does not promise
    top = logits[chosen[0]]
    exps = [math.exp(logits[e] - top) for e in chosen]
    total = sum(exps) if norm_topk_prob else sum(math.exp(v - top) for v in logits)
    return [(e, w / total) for e, w in zip(chosen, exps)]


def route(x: torch.Tensor, router_weight: torch.Tensor, top_k: int, norm_topk_prob: bool):
    """Softmax -> top-k -> optional renormalise.

    Returns (topk_ids [T,k] int64, topk_weights [T,k] fp32).

    The weights stay fp32: both MoE paths fold them into an fp32 accumulator.
    """
    logits = F.linear(x, router_weight)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    return route_probs(probs, top_k, norm_topk_prob)


def route_probs(probs: torch.Tensor, top_k: int, norm_topk_prob: bool):
    """`route` from the router's probabilities [T, E] fp32, for a caller that needs them as well
    (the training model's balance loss)."""
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights


def moe_expert_centric(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
) -> torch.Tensor:
    """Tokens grouped per expert, one GEMM pair per touched expert (the prefill path).

    x [T, H]; w_gate_up [E, 2I, H] (gate rows first); w_down [E, H, I]; topk_ids/weights [T, k].
    Each expert's output is computed in the activation dtype, as HF does, and summed in fp32.
    """
    n_tokens, k = topk_ids.shape
    inter = w_down.shape[2]
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    tokens = order // k  # the token of each (token, expert) pair, grouped by expert
    x_sorted = x[tokens]  # one gather for all experts, then contiguous row ranges
    weights = topk_weights.reshape(-1)[order].to(x.dtype)
    counts = torch.bincount(flat_ids, minlength=w_gate_up.shape[0]).tolist()
    ys = []
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        end = start + count
        gate_up = F.linear(x_sorted[start:end], w_gate_up[expert])
        ys.append(F.linear(F.silu(gate_up[:, :inter]) * gate_up[:, inter:], w_down[expert]))
        start = end
    y = torch.cat(ys) * weights[:, None]
    # One scatter-add in expert order: the same fp32 sums as adding expert by expert.
    out = torch.zeros(n_tokens, x.shape[1], dtype=torch.float32, device=x.device)
    return out.index_add_(0, tokens, y.float()).to(x.dtype)


def moe_output_centric(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
) -> torch.Tensor:
    """Each token gathers its top-k experts' rows; fp32 accumulation; routing weights folded in.

    The CPU analogue of warp decode: no sort, no grouping, one fp32 sum per output. Cost grows
    with T*k expert reads, so it is the decode path (few tokens), not the prefill path. The sum
    over the k experts runs in topk order, as the kernel's does.
    """
    inter = w_down.shape[2]
    x32 = x.float()
    weights = topk_weights.float()
    rows = []
    for t, experts in enumerate(topk_ids.tolist()):
        acc = None
        for j, e in enumerate(experts):
            # The expert's weights are read in place: indexing w[topk_ids] would copy them.
            gate_up = F.linear(x32[t], w_gate_up[e].float())
            hidden = F.silu(gate_up[:inter]) * gate_up[inter:]
            # Round the intermediate to the activation dtype, as the kernel stores it between its
            # two launches.
            hidden = hidden.to(x.dtype).float()
            y = F.linear(hidden, w_down[e].float()) * weights[t, j]
            acc = y if acc is None else acc + y
        rows.append(acc)
    return torch.stack(rows).to(x.dtype)


def moe_float64(x, w_gate_up, w_down, topk_ids, topk_weights) -> torch.Tensor:
    """The exact answer (float64 throughout), the yardstick for both MoE paths' error."""
    inter = w_down.shape[2]
    x64 = x.double()
    gate_up = torch.einsum("th,tkoh->tko", x64, w_gate_up[topk_ids].double())
    hidden = F.silu(gate_up[..., :inter]) * gate_up[..., inter:]
    y = torch.einsum("tki,tkhi->tkh", hidden, w_down[topk_ids].double())
    return (y * topk_weights.double()[..., None]).sum(dim=1)


def dense_mlp(x: torch.Tensor, w_gate_up, w_down, linear=F.linear) -> torch.Tensor:
    """SwiGLU MLP for the dense layers; w_gate_up [2I, H], w_down [H, I], multiplied by
    `linear` (F.linear's signature; kernels.quant_linear.linear for quantized weights)."""
    inter = w_down.shape[1]
    gate_up = linear(x, w_gate_up)
    return linear(F.silu(gate_up[..., :inter]) * gate_up[..., inter:], w_down)
