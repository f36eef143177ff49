"""Is a llama.cpp greedy divergence rounding? The same committed prefix: logits from one-token passes vs one wide pass
of 2, 4, 5, 8 positions (the Qwen 1.5B Q4_K_M; prompt ids and token indices from `check` output). Not part of CI."""
import torch
from specdecode.pipeline import SpecDecoder, load_components
from specdecode.prompts import load_prompts
target, tok, _, _, _ = load_components("qwen2.5-coder-1.5b", None, threads=2, backend="llama.cpp")
dec = SpecDecoder(target, tok)
prompts = {p.id: p for p in load_prompts(None, per_task=4)}
for pid, at in (("87", 35), ("163", 20)):
    ids = dec.encode(prompts[pid].text, chat=True)
    # plain greedy reference, one token per pass
    b = target
    logits = b.add_row(ids)
    gen = [int(logits.argmax())]
    one_logits = [logits[0]]
    for _ in range(at + 2):
        out = b.forward(torch.tensor([[gen[-1]]]), [1]); b.keep([[0]])
        one_logits.append(out[0, 0]); gen.append(int(out[0, 0].argmax()))
    b.clear()
    for width in (2, 4, 5, 8):
        # prefix = prompt + gen[:at - width + 1], then one pass over gen[at-width+1 : at+1]: its last logits predict token at+1
        start = at - width + 1
        b.add_row(torch.cat([ids, torch.tensor([gen[:start]])], 1) if start > 0 else ids)
        out = b.forward(torch.tensor([gen[start:at + 1]]), [width]); b.keep([[0]]); b.clear()
        wide, one = out[0, -1], one_logits[at + 1]
        top = torch.topk(one, 2)
        print(f"prompt {pid} token {at+1} width {width}: one-token argmax {int(one.argmax())} (gap {float(top.values[0]-top.values[1]):.3f}), "
              f"wide argmax {int(wide.argmax())}, max |diff| {float((wide-one).abs().max()):.3f}", flush=True)
