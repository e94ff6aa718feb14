"""Train a small language model built from CausalLinearAttention on associative recall, then decode
with the state API and check that step-by-step generation gives the full-sequence forward's tokens.

    python -m fast_causal_attn.demo                 # about two minutes on a 2-core CPU
    python -m fast_causal_attn.demo --steps 20      # a quick look

The task, generated here (no downloads): a sequence of key-value pairs, then one of the keys again;
the model must answer with that key's value. "recall" is the accuracy of that answer.
"""
import argparse
import sys
import time

import torch
from torch import nn
import torch.nn.functional as F

from .nn import CausalLinearAttention


class RecallTask:
    """Sequences `k1 v1 k2 v2 ... kn vn QUERY k` with the answer `v` (the value paired with k).
    Keys are tokens [0, num_keys), values [num_keys, num_keys + num_values), QUERY the last token."""

    def __init__(self, num_pairs=6, num_keys=16, num_values=16):
        self.num_pairs, self.num_keys, self.num_values = num_pairs, num_keys, num_values
        self.query_token = num_keys + num_values
        self.vocab_size = num_keys + num_values + 1
        self.length = 2 * num_pairs + 2  # pairs, QUERY, key; the answer follows

    def batch(self, size, generator, device):
        keys = torch.argsort(torch.rand(size, self.num_keys, generator=generator), dim=1)[:, : self.num_pairs]
        values = torch.randint(self.num_keys, self.num_keys + self.num_values, (size, self.num_pairs),
                               generator=generator)
        pick = torch.randint(0, self.num_pairs, (size,), generator=generator)
        rows = torch.arange(size)
        pairs = torch.stack([keys, values], dim=2).reshape(size, -1)
        query = torch.full((size, 1), self.query_token)
        tokens = torch.cat([pairs, query, keys[rows, pick, None], values[rows, pick, None]], dim=1)
        return tokens.to(device)  # [size, length + 1]: inputs are tokens[:, :-1], targets tokens[:, 1:]


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attention = CausalLinearAttention(dim, heads, feature_map="elu", normalize=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x, state=None, return_state=False):
        attended = self.attention(self.norm1(x), state=state, return_state=return_state)
        attended, state = attended if return_state else (attended, None)
        x = x + attended
        x = x + self.mlp(self.norm2(x))
        return (x, state) if return_state else x


class TinyLM(nn.Module):
    def __init__(self, vocab_size, max_length, dim=64, heads=4, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.position = nn.Embedding(max_length, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size)

    def forward(self, tokens, states=None, start=0):
        """Logits for tokens [B, L] at positions start...; with states (a list, one per block, None
        entries to begin) it continues from them and also returns the new ones."""
        positions = torch.arange(start, start + tokens.shape[1], device=tokens.device)
        x = self.embed(tokens) + self.position(positions)
        new_states = []
        for i, block in enumerate(self.blocks):
            if states is None:
                x = block(x)
            else:
                x, state = block(x, state=states[i], return_state=True)
                new_states.append(state)
        logits = self.head(self.norm(x))
        return logits if states is None else (logits, new_states)


def progress(step, steps, loss, recall, tokens_per_s, width=30):
    done = int(width * step / steps)
    bar = "#" * done + "." * (width - done)
    sys.stderr.write(f"\r[{bar}] {step}/{steps}  loss {loss:.3f}  recall {recall:6.1%}  {tokens_per_s:,.0f} tokens/s")
    sys.stderr.flush()


def evaluate(model, task, generator, device, size=512):
    model.eval()
    with torch.no_grad():
        tokens = task.batch(size, generator, device)
        logits = model(tokens[:, :-1])
        recall = (logits[:, -1].argmax(-1) == tokens[:, -1]).float().mean().item()
    model.train()
    return recall


def check_decoding(model, task, generator, device, prompts=16, new_tokens=4):
    """Greedy generation one token at a time from the attention states, against the argmax of a
    full-sequence forward over the generated sequence. Returns True when every token agrees."""
    model.eval()
    with torch.no_grad():
        tokens = task.batch(prompts, generator, device)[:, : task.length]  # up to the queried key
        logits, states = model(tokens, states=[None] * len(model.blocks))
        generated = [logits[:, -1].argmax(-1)]
        for i in range(new_tokens - 1):
            step_logits, states = model(generated[-1][:, None], states=states, start=task.length + i)
            generated.append(step_logits[:, -1].argmax(-1))
        sequence = torch.cat([tokens, torch.stack(generated, dim=1)], dim=1)
        full = model(sequence[:, :-1])[:, task.length - 1 :].argmax(-1)
    model.train()
    return torch.equal(full, sequence[:, task.length :])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    device = torch.device(args.device)
    task = RecallTask()
    model = TinyLM(task.vocab_size, task.length + 8).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-3, total_steps=max(args.steps, 1))
    print(f"fast_causal_attn demo: associative recall with {task.num_pairs} pairs, "
          f"{sum(p.numel() for p in model.parameters()):,} parameters, on {device}")

    start, tokens_seen, recall, loss = time.perf_counter(), 0, 0.0, float("nan")
    for step in range(1, args.steps + 1):
        tokens = task.batch(args.batch, generator, device)
        logits = model(tokens[:, :-1])
        loss_all = F.cross_entropy(logits.reshape(-1, task.vocab_size), tokens[:, 1:].reshape(-1), reduction="none")
        # The pairs are random: only the answer (and the query key after QUERY) can be predicted.
        loss = loss_all.view(args.batch, -1)[:, -1].mean() + 0.1 * loss_all.mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        tokens_seen += tokens[:, :-1].numel()
        if step % 50 == 0 or step == args.steps:
            recall = evaluate(model, task, generator, device)
        if step % 10 == 0 or step == args.steps:
            progress(step, args.steps, loss.item(), recall, tokens_seen / (time.perf_counter() - start))
    sys.stderr.write("\n")
    elapsed = time.perf_counter() - start
    recall = evaluate(model, task, generator, device)
    print(f"trained {args.steps} steps in {elapsed:.1f} s ({tokens_seen / elapsed:,.0f} tokens/s): "
          f"loss {loss.item():.3f}, recall {recall:.1%} (chance {1 / task.num_values:.1%})")

    ok = check_decoding(model, task, generator, device)
    print("step-by-step decoding with the state API gives the full forward's tokens:", "yes" if ok else "NO")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
