"""One process, one tree: plain, auto, auto without the copy pointer, alternated per prompt; ratios by prompt."""
import statistics, sys, json
from specdecode.pipeline import SpecDecoder, load_components
from specdecode.bench.methods import build_methods
from specdecode.prompts import load_prompts
from specdecode.sampling import SamplingParams
from specdecode.drafters import suffix
prompts = load_prompts(sys.argv[1], per_task=int(sys.argv[2]) or None)
new = int(sys.argv[3]) if len(sys.argv) > 3 else 192
repeats = int(sys.argv[4]) if len(sys.argv) > 4 else 2
target, tok, *_ = load_components("qwen2.5-coder-1.5b", None, dtype=None, threads=2, backend="llama.cpp")
dec = SpecDecoder(target, tok)
plain, auto = build_methods(["plain", "spec:auto"], target, tok, dec.eos, default_draft="auto", default_k=None, dtype=None, threads=2, drafters={})
(nocopy,) = build_methods(["spec:auto"], target, tok, dec.eos, default_draft="auto", default_k=None, dtype=None, threads=2, drafters={})
nocopy.name = "auto-nocopy"
ms = [plain, auto, nocopy]
samp = SamplingParams()
rows = []
for p in prompts:
    ids = dec.encode(p.text, chat=True)
    t = {m.name: [] for m in ms}
    for r in range(repeats):
        for m in (ms if r % 2 == 0 else ms[::-1]):
            suffix.COPY_ON = m is not nocopy
            run = m.run(ids, new, samp); m.forget_last_run()
            t[m.name].append((run.latency_s, len(run.token_ids), run.token_ids))
    med = {k: statistics.median(x[0] for x in v) for k, v in t.items()}
    same = {k: v[0][2] == t["plain"][0][2] for k, v in t.items()}
    n = {k: v[0][1] for k, v in t.items()}
    row = dict(prompt=p.id, **{f"{k}_tps": n[k] / med[k] for k in med}, same=same)
    rows.append(row)
    print(p.id, {k: round(n[k] / med[k], 2) for k in med}, "auto/nocopy", round((n["spec:auto"] / med["spec:auto"]) / (n["auto-nocopy"] / med["auto-nocopy"]), 3), same, flush=True)
r1 = [r["spec:auto_tps"] / r["plain_tps"] for r in rows]; r2 = [r["auto-nocopy_tps"] / r["plain_tps"] for r in rows]
print("mean vs plain: auto", round(statistics.mean(r1), 3), "min", round(min(r1), 3), "| auto-nocopy", round(statistics.mean(r2), 3), "min", round(min(r2), 3))
