"""Where oneDNN's bfloat16 product stops being row-invariant (``verispec.backends.kernels.packed_rows``): for each
projection of the default model, on random inputs, whether the rows of an m-row call equal the same rows in a 2-row
call (m = 3..64), and whether every row of a 5-, 17- and 32-row call equals the same row alone (run as two equal
rows, as ``packed_rows`` runs one row). design.md, "In bfloat16 a row's logits do not depend on its company".

    python scripts/experiments/linear_rows.py
"""

from __future__ import annotations

import torch

from verispec import load
from verispec.backends.kernels import packed_rows


def main() -> None:
    torch.set_num_threads(2)
    target = load("smollm2-135m", dtype="bfloat16")
    torch.manual_seed(0)
    first_bad: dict[str, int] = {}
    alone_bad = alone_total = 0
    for layer in target.hf.model.layers:
        mods = {"q": layer.self_attn.q_proj, "k": layer.self_attn.k_proj, "v": layer.self_attn.v_proj,
                "o": layer.self_attn.o_proj, "gate": layer.mlp.gate_proj, "up": layer.mlp.up_proj,
                "down": layer.mlp.down_proj}
        for name, mod in mods.items():
            x = torch.randn(64, mod.weight.shape[1]).to(torch.bfloat16)
            two = packed_rows(x[:2], mod)
            for m in range(3, 65):
                if not torch.equal(packed_rows(x[:m], mod)[:2], two):
                    first_bad[name] = min(first_bad.get(name, 10 ** 9), m)
                    break
            for m in (5, 17, 32):
                out = packed_rows(x[:m], mod)
                for r in range(m):
                    alone_total += 1
                    alone_bad += not torch.equal(out[r], packed_rows(x[r:r + 1].expand(2, -1).contiguous(), mod)[0])
    print("smallest row count whose rows 0-1 differ from a 2-row call, by projection (over all layers):",
          first_bad or "none up to 64")
    print(f"rows of 5-, 17- and 32-row calls that differ from the same row alone: {alone_bad} of {alone_total}")


if __name__ == "__main__":
    main()
