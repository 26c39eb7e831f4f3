"""Session 49: why fp16 products cannot overflow in the chunk inverse where every token is contractive.

Entry (r, j) of A0 = (I + strictly_lower(diag(beta) K K^T))^-1 is, for r > j,
    -beta_r k_r^T P_{r-1} ... P_{j+1} k_j,   P_l = I - beta_l k_l k_l^T,
times the decays between j and r when the matrix is gated (the inverse of I + M o E is A0 o E).  Each P_l has
norm max(1, |1 - beta_l |k_l|^2|), so |A0_rj| <= beta_r |k_r| |k_j| wherever every beta_l |k_l|^2 <= 2.  This
script checks the identity in float64 (exits non-zero above 1e-12) and prints the largest |A0| seen on sampled
chunks, contractive and not.  CPU only.

    python benchmarks/results/wy-entry-bound-s49.py
"""
import torch

torch.manual_seed(1)
n, d = 64, 128
worst = 0.0
for trial in range(4):
    k = torch.randn(n, d, dtype=torch.float64) * (0.15 if trial % 2 else 0.09)
    beta = 2 * torch.rand(n, dtype=torch.float64)
    g = -torch.rand(n, dtype=torch.float64) * 0.1
    decay = (g.cumsum(0)[:, None] - g.cumsum(0)[None, :]).exp()
    for gated in (False, True):
        m = (beta[:, None] * (k @ k.T) * (decay if gated else 1)).tril(-1)
        a = torch.linalg.inv(torch.eye(n, dtype=torch.float64) + m)
        t = torch.eye(n, dtype=torch.float64)
        for r in range(n):
            for j in range(r):
                x = k[j].clone()
                for l in range(j + 1, r):
                    x = (x - beta[l] * k[l] * (k[l] @ x)) * (g[l].exp() if gated else 1)
                t[r, j] = -beta[r] * (k[r] @ x) * (g[r].exp() if gated else 1)
        worst = max(worst, (a - t).abs().max().item())
print(f"identity: largest difference {worst:.1e}")
for rho in (0.0, 0.9, 1.0):  # keys' correlation with a common direction
    for bmax, knorm in ((1.0, 1.0), (2.0, 1.0), (2.0, 1.2)):
        largest = 0.0
        for _ in range(100):
            u = torch.randn(d, dtype=torch.float64)
            k = rho * u / u.norm() + (1 - rho ** 2) ** 0.5 * torch.randn(n, d, dtype=torch.float64) / d ** 0.5
            k = knorm * k / k.norm(dim=1, keepdim=True)
            beta = bmax * torch.rand(n, dtype=torch.float64)
            a = torch.linalg.inv(torch.eye(n, dtype=torch.float64) + (beta[:, None] * (k @ k.T)).tril(-1))
            largest = max(largest, a.abs().max().item())
        print(f"keys' correlation {rho}, beta <= {bmax}, |k| = {knorm} (beta |k|^2 <= {bmax * knorm ** 2:.2f}): "
              f"largest |A0| {largest:.3g}")
raise SystemExit(int(worst > 1e-12))
