"""Tensor parallelism from one Python process, as a notebook runs it: no torchrun.

    python examples/python/one_process.py                 # 2 CPU devices
    python examples/python/one_process.py --devices cuda:0,cuda:1

A small GPT-2 (from a config: nothing downloads) is split over the devices by
``ts.tensor_parallel``, trained for a few steps on the Python standard library's own sources
(tokenised once and cached, as examples/python/train_lm.py does), used to generate, saved with
``save_pretrained`` and loaded back slice by slice with ``ts.nn.from_pretrained(devices=...)``.
Each line below is what a notebook cell would hold.
"""
import argparse
import os
import sys
import tempfile
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import shardtorch as ts

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import stdlib_corpus  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", default="cpu,cpu", help="comma-separated, one rank each (default: cpu,cpu)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--vocab", type=int, default=8000)
    args = parser.parse_args()
    devices = args.devices.split(",")

    _, tokens_path = stdlib_corpus.build(args.vocab, max_bytes=4 << 20)
    ids = stdlib_corpus.load(tokens_path)["train"]
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=args.vocab, n_positions=128, n_embd=256, n_layer=4, n_head=8)

    start = time.perf_counter()
    model = ts.tensor_parallel(GPT2LMHeadModel(config), devices)        # one worker process per device
    print(f"split over {devices} in {time.perf_counter() - start:.1f} s (the workers' start and the proof)")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)          # the ranks' slices, updated in place
    generator = torch.Generator().manual_seed(0)
    for step in range(args.steps):
        offsets = torch.randint(0, len(ids) - 129, (8,), generator=generator)
        batch = torch.stack([ids[o:o + 128] for o in offsets])
        loss = model(input_ids=batch, labels=batch).loss                  # whole outputs, as unsharded
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 5 == 0 or step == args.steps - 1:
            print(f"step {step:3d}  loss {loss.item():.3f}")

    model.eval()
    prompt = ids[:16].unsqueeze(0)
    tokens = model.generate(prompt, max_new_tokens=16, do_sample=False, pad_token_id=0)
    print("generated ids:", tokens[0, 16:].tolist())

    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)                                     # the unsharded checkpoint
        model.close()                                                     # frees the devices
        with ts.nn.from_pretrained(folder, devices=devices) as loaded:   # each rank reads its slices
            again = loaded.generate(prompt, max_new_tokens=16, do_sample=False, pad_token_id=0)
    print("reloaded model's tokens are the same:", torch.equal(tokens, again))


if __name__ == "__main__":
    main()
