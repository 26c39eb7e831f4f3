"""The gated delta rule token by token, for decoding: one program per (sequence, value head, value block).

Per token, with ``k`` and ``q`` (l2-normalised when asked, ``q`` scaled) and the
state ``S`` [K, V] of the program's head:

    S <- exp(g) S
    u  = beta (v - k^T S)                the delta rule's correction
    S <- S + k u^T
    o  = q^T S

The program keeps its ``[K, block_v]`` slice of ``S`` in registers for all of
its sequence's tokens and touches global memory only for the state at both
ends and each token's vectors: a decode step is bound by reading and writing
the fp32 state (64 KB per head each way), or at small batch by latency.
Written with the state before the token, the step needs only its products with
k and q,

    u = beta (v - exp(g) k^T S)          o = exp(g) q^T S + (q . k) u,

so one pass of reductions over K per token (k^T S, q^T S, q . k, all within a
warp) comes before the rank-one update ``S <- exp(g) S + k u^T``.

The l2 norms are applied as scalars: ``k^T S`` and ``(q . k)`` are formed from
the raw rows and rescaled, so no normalised copy is rounded.

A program reads its whole state slice before it writes any of it, and no
other program touches that slice, so ``final_state`` may be the very tensor
passed as ``initial_state`` (the cache update in place).
"""

# No ``from __future__ import annotations``: TileLang evaluates the prim_func's annotations.  TileLang is
# imported in the factory: the constants here serve launchers that run shipped programs without it.
import dataclasses

from .inverse_norms import EPS  # 1 / sqrt(sum(x^2) + EPS), as everywhere

SOFTPLUS_THRESHOLD = 20.0  # as torch's softplus: x itself above it
THREADS = 128
BLOCK_WIDTHS = (16, 32, 64)  # value columns per program
COLUMNS = 4  # adjacent state columns per thread


@dataclasses.dataclass(frozen=True)
class RecurrentStepConfig:
    """What one compiled program of the recurrence is specialised for (all else is symbolic)."""

    num_qk_heads: int
    num_v_heads: int
    dtype: str  # q, k, v and o
    gate_dtype: str  # g, or the layer's raw ``a`` with gate_in_kernel
    beta_dtype: str  # beta, or the layer's raw ``b`` with beta_sigmoid_in_kernel
    block_v: int
    use_l2norm: bool
    has_initial_state: bool
    store_final_state: bool
    varlen: bool  # sequences from cu_seqlens; else a dense batch of equal lengths
    # The Qwen3.5 gates, computed here instead of in PyTorch:
    # g = -exp(A_log) softplus(a + dt_bias) and beta = sigmoid(b), in fp32.
    gate_in_kernel: bool = False
    beta_sigmoid_in_kernel: bool = False
    param_dtype: str = "float32"  # A_log and dt_bias
    head_dim: int = 128


def build_recurrent_step(config: RecurrentStepConfig):
    """Build the token recurrence for one static config; token and sequence counts stay symbolic.

    q, k ``[T, Hqk, K]`` and v ``[T, Hv, V]`` (any token stride), g and beta
    ``[T, Hv]`` in their own dtypes; sequences by ``cu_seqlens``, or for a dense
    batch ``seq_len`` tokens each.  With ``cu_seqlens``, ``o``'s rows from
    ``cu_seqlens[N]`` to ``T`` come out as zeros.
    """
    import tilelang.language as T

    c = config
    K = V = c.head_dim
    block_v, dtype = c.block_v, c.dtype
    assert c.num_v_heads % c.num_qk_heads == 0 and block_v in BLOCK_WIDTHS, c
    group = c.num_v_heads // c.num_qk_heads
    accum = "float32"

    num_tokens = T.dynamic("T")
    num_offsets = T.dynamic("N_offsets")  # N + 1 with varlen, else a one-entry placeholder
    # Own row symbols: a launcher passes a one-row placeholder for a state it does not use.
    num_states_in = T.dynamic("NS")
    num_states_out = T.dynamic("NS_out")
    # q, k and v may be views with any token stride (the layer's are columns of one
    # projection's rows); heads and dims stay packed.
    q_stride, k_stride, v_stride = T.dynamic("q_stride"), T.dynamic("k_stride"), T.dynamic("v_stride")

    # Thread layout: each thread holds COLUMNS adjacent columns (one 16-byte load of the
    # fp32 state) of every R-th row; the R threads of a column group are adjacent
    # lanes of one warp, so every sum over K is a few shuffles, with no barrier.
    R = THREADS // (block_v // COLUMNS)
    state_layout = T.Fragment([K, block_v], forward_thread_fn=lambda i, j: (j // COLUMNS) * R + i % R,
                              forward_index_fn=lambda i, j: (i // R) * COLUMNS + j % COLUMNS)
    # A row of K values, spread over the R lanes as the state's rows are (and
    # repeated in every column group).
    row_layout = T.Fragment([K], forward_thread_fn=lambda i, rep: rep * R + i % R, replicate=block_v // COLUMNS,
                            forward_index_fn=lambda i: i // R)

    @T.prim_func
    def recurrent_step(
        q: T.StridedTensor([num_tokens, c.num_qk_heads, K], (q_stride, K, 1), dtype),
        k: T.StridedTensor([num_tokens, c.num_qk_heads, K], (k_stride, K, 1), dtype),
        v: T.StridedTensor([num_tokens, c.num_v_heads, V], (v_stride, V, 1), dtype),
        g: T.Tensor([num_tokens, c.num_v_heads], c.gate_dtype),
        beta: T.Tensor([num_tokens, c.num_v_heads], c.beta_dtype),
        A_log: T.Tensor([c.num_v_heads], c.param_dtype),
        dt_bias: T.Tensor([c.num_v_heads], c.param_dtype),
        cu_seqlens: T.Tensor([num_offsets], "int32"),
        num_seqs: T.int32,
        seq_len: T.int32,
        initial_state: T.Tensor([num_states_in, c.num_v_heads, K, V], accum),
        scale: T.float32,
        o: T.Tensor([num_tokens, c.num_v_heads, V], dtype),
        final_state: T.Tensor([num_states_out, c.num_v_heads, K, V], accum),
    ):
        with T.Kernel(V // block_v, c.num_v_heads, num_seqs, threads=THREADS) as (iv, hv, seq):
            hk = hv // group
            v0 = iv * block_v

            state = T.alloc_fragment([K, block_v], accum)
            key = T.alloc_fragment([K], accum)
            query = T.alloc_fragment([K], accum)
            # Per-row products, each summed over K: with the state (k^T S, q^T S) and
            # of the rows themselves (q.k, and k.k, q.q for the l2 norms).
            key_products = T.alloc_fragment([K, block_v], accum)
            query_products = T.alloc_fragment([K, block_v], accum)
            key_squares = T.alloc_fragment([K], accum)
            query_squares = T.alloc_fragment([K], accum)
            cross = T.alloc_fragment([K], accum)
            key_state = T.alloc_fragment([block_v], accum)
            query_state = T.alloc_fragment([block_v], accum)
            key_dot = T.alloc_fragment([1], accum)
            query_dot = T.alloc_fragment([1], accum)
            cross_dot = T.alloc_fragment([1], accum)
            correction = T.alloc_fragment([block_v], accum)  # u
            T.annotate_layout({
                state: state_layout, key_products: state_layout, query_products: state_layout,
                key: row_layout, query: row_layout,
                key_squares: row_layout, query_squares: row_layout, cross: row_layout,
            })

            # A dense batch needs no offsets from memory: one dependent load less per step.
            bos = cu_seqlens[seq] if c.varlen else seq * seq_len
            eos = cu_seqlens[seq + 1] if c.varlen else bos + seq_len
            if c.has_initial_state:
                T.copy(initial_state[seq, hv, :, v0 : v0 + block_v], state)
            else:
                T.clear(state)

            for t in T.serial(bos, eos):
                for i in T.Parallel(K):
                    key[i] = T.cast(k[t, hk, i], accum)
                    query[i] = T.cast(q[t, hk, i], accum)
                for i in T.Parallel(K):
                    cross[i] = query[i] * key[i]
                for i, j in T.Parallel(K, block_v):
                    key_products[i, j] = key[i] * state[i, j]
                    query_products[i, j] = query[i] * state[i, j]
                T.reduce_sum(cross, cross_dot, dim=0)
                T.reduce_sum(key_products, key_state, dim=0)
                T.reduce_sum(query_products, query_state, dim=0)
                key_scale = T.float32(1)
                query_scale = scale
                if c.use_l2norm:
                    for i in T.Parallel(K):
                        key_squares[i] = key[i] * key[i]
                        query_squares[i] = query[i] * query[i]
                    T.reduce_sum(key_squares, key_dot, dim=0)
                    T.reduce_sum(query_squares, query_dot, dim=0)
                    key_scale = T.rsqrt(key_dot[0] + EPS)
                    query_scale = T.rsqrt(query_dot[0] + EPS) * scale

                log_decay = T.cast(g[t, hv], accum)
                if c.gate_in_kernel:
                    x = log_decay + T.cast(dt_bias[hv], accum)
                    softplus = T.if_then_else(x > SOFTPLUS_THRESHOLD, x, T.log1p(T.exp(x)))
                    log_decay = -T.exp(T.cast(A_log[hv], accum)) * softplus
                decay = T.exp(log_decay)
                b = T.cast(beta[t, hv], accum)
                if c.beta_sigmoid_in_kernel:
                    b = T.sigmoid(b)
                for j in T.Parallel(block_v):
                    correction[j] = b * (T.cast(v[t, hv, v0 + j], accum) - decay * key_scale * key_state[j])
                    o[t, hv, v0 + j] = T.cast(
                        query_scale * (decay * query_state[j] + key_scale * cross_dot[0] * correction[j]), dtype)
                for i, j in T.Parallel(K, block_v):
                    state[i, j] = decay * state[i, j] + key_scale * key[i] * correction[j]

            if c.store_final_state:
                T.copy(state, final_state[seq, hv, :, v0 : v0 + block_v])
            if c.varlen:
                if seq == num_seqs - 1:
                    # Rows past the last sequence: none outside CUDA-graph capture (the launcher checks that
                    # the offsets end at T), but a graph runtime may pad the token axis; no program walks
                    # them, so the last sequence's programs write their zeros.
                    for t in T.serial(eos, num_tokens):
                        for j in T.Parallel(block_v):
                            o[t, hv, v0 + j] = T.cast(0, dtype)

    return recurrent_step
