import time, torch
from atom.model_ops.kda import l2_normalize, kda_forget_gate
from atom.model_ops.kda_backend import select_kda_backend
torch.manual_seed(0)
fla, ref = select_kda_backend("cuda"), select_kda_backend("cuda", choice="torch")
print("auto picks", fla.name)
for lb in (-5.0, None):
    T, h, D = 3000, 8, 128
    q = l2_normalize(torch.randn(T, h, D, device="cuda")); k = l2_normalize(torch.randn(T, h, D, device="cuda"))
    v = torch.randn(T, h, D, device="cuda").bfloat16()
    a_log = torch.empty(h, device="cuda").uniform_(1, 16).log()
    g = kda_forget_gate(torch.randn(T, h, D, device="cuda"), a_log, torch.randn(h * D, device="cuda") * 0.5, lb)
    beta = torch.rand(T, h, device="cuda"); s = torch.randn(h, D, D, device="cuda") * 0.1
    for m in ("prefill", "decode"):
        o1, s1 = getattr(fla, m)(q, k, v, g, beta, s); o2, s2 = getattr(ref, m)(q, k, v, g, beta, s)
        print(lb, m, "max|do|/max|o|", float((o1 - o2).abs().max() / o2.abs().max()), "state", float((s1 - s2).abs().max() / s2.abs().max()))
    for name, be in (("fla", fla), ("torch", ref)):
        be.prefill(q, k, v, g, beta, s); torch.cuda.synchronize(); t = time.time()
        for _ in range(3): be.prefill(q, k, v, g, beta, s)
        torch.cuda.synchronize(); print(name, "prefill T=3000 ms", (time.time() - t) / 3 * 1e3)
