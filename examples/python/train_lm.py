"""Train a GPT-2-style language model sharded with ``ts.nn.parallelize``.

    torchrun --nproc-per-node 2 examples/python/train_lm.py                  # 2 CPU processes, Gloo
    torchrun --nproc-per-node 2 examples/python/train_lm.py --fused-loss --sequence-parallel
    torchrun --nproc-per-node 4 examples/python/train_lm.py --tp 2 --dp 2 --fsdp
    torchrun --nproc-per-node 2 examples/python/train_lm.py --save-pretrained out/lm     # then, at any size:
    torchrun --nproc-per-node 3 examples/python/train_lm.py --from-pretrained out/lm --save-pretrained out/lm2

The model is Hugging Face transformers' ``GPT2LMHeadModel`` built from a config
(nothing is downloaded), parallelized in one call: attention split by whole
heads (the fused Conv1D ``c_attn`` included), MLPs column- then row-parallel,
the token embedding and the tied LM head split by vocabulary, so that the
logits stay sharded and the loss is shardtorch's vocabulary-parallel
cross-entropy (``--fused-loss``: the linear cross-entropy that never forms the
logits at all). ``--dp`` > 1 adds data parallelism over the remaining ranks:
DDP, or FSDP2 with ``--fsdp``. ``--save-pretrained`` writes the trained model
as a Hugging Face checkpoint (the unsharded model's, tensor by tensor);
``--from-pretrained`` starts from one, each rank reading only its slices.

Data: the Python standard library's own source files, which every machine with
Python has, split into train and held-out by file and tokenised with a
byte-level BPE (``--vocab`` tokens) that the first run trains and caches under
``--cache-dir`` (see stdlib_corpus.py). Rank 0 shows a progress bar (loss,
tokens/s) and the held-out perplexity every ``--eval-every`` steps and after
the last; at the end each rank prints its parameter and peak memory against
the unsharded model's, measured the same way (two training steps of the
unsharded model on this rank's batch, after the run).
"""
import argparse
import math
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

import shardtorch as ts
from shardtorch.utils.memory import PeakMemory

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the shared pieces beside this file
import stdlib_corpus  # noqa: E402
from training_common import (Progress, load_checkpoint, make_scheduler, memory_report,  # noqa: E402
                             print_in_rank_order, save_checkpoint)


def build_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=None,
                   help="tensor-parallel group size: ranks that share one model (default: world size / --dp)")
    p.add_argument("--dp", type=int, default=1,
                   help="data-parallel size: model replicas, each reading its own batches; world size must be "
                        "--tp x --dp (default: 1)")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="norms and dropout on 1/tp of the sequence (all-gather before each column-parallel block, "
                        "reduce-scatter after each row-parallel one)")
    p.add_argument("--fused-loss", action="store_true",
                   help="LM head + loss chunk by chunk (ts.nn.causal_lm_loss(..., fused=True)): the "
                        "logits never exist, not even this rank's shard")
    p.add_argument("--amp", action="store_true", help="mixed precision: bfloat16 autocast (CPU)")
    p.add_argument("--fsdp", action="store_true",
                   help="torch's FSDP2 (ts.nn.parallel.fully_shard) over the data-parallel dimension instead of "
                        "DDP: parameters, gradients and optimizer state sharded over --dp too")
    p.add_argument("--steps", type=int, default=60, help="training steps (default: 60)")
    p.add_argument("--batch-size", type=int, default=2, help="sequences per model replica per step (default: 2)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (default: 256)")
    p.add_argument("--layers", type=int, default=6, help="transformer blocks (default: 6)")
    p.add_argument("--width", type=int, default=512, help="hidden size (default: 512)")
    p.add_argument("--heads", type=int, default=8, help="attention heads; need not divide by --tp (default: 8)")
    p.add_argument("--vocab", type=int, default=32000, help="BPE vocabulary size (default: 32000)")
    p.add_argument("--dropout", type=float, default=0.0,
                   help="GPT-2's dropout probabilities (embedding, attention, residual) (default: 0.0)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW peak learning rate (default: 0.001)")
    p.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay (default: 0.01)")
    p.add_argument("--warmup-steps", type=int, default=10, help="linear learning-rate warm-up steps (default: 10)")
    p.add_argument("--lr-schedule", choices=["constant", "cosine"], default="cosine",
                   help="learning rate after the warm-up, over --steps (default: cosine)")
    p.add_argument("--seed", type=int, default=0, help="random seed of the model and the data (default: 0)")
    p.add_argument("--eval-every", type=int, default=20,
                   help="held-out perplexity every N steps, besides before the first and after the last step; "
                        "0: only those two (default: 20)")
    p.add_argument("--eval-windows", type=int, default=8,
                   help="held-out sequences of --seq-len tokens scored at each evaluation, the same ones every "
                        "time, split over the model replicas (default: 8)")
    p.add_argument("--cache-dir", default=None,
                   help="where the trained tokenizer and the token ids are cached "
                        "(default: ~/.cache/shardtorch/stdlib_corpus)")
    p.add_argument("--corpus-bytes", type=int, default=0,
                   help="use only the first files of the corpus, about this many bytes (0: all) (default: 0)")
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32",
                   help="parameter dtype (default: float32; float64 for exactness checks)")
    p.add_argument("--save", default=None, help="directory to save a checkpoint to at the end (and every --save-every)")
    p.add_argument("--save-every", type=int, default=0, help="also save every N steps (default: only at the end)")
    p.add_argument("--resume", default=None,
                   help="directory of a checkpoint to resume from, saved at any --tp and --dp")
    p.add_argument("--from-pretrained", default=None, metavar="DIR",
                   help="start from a Hugging Face checkpoint folder (save_pretrained's, or --save-pretrained's at any "
                        "--tp), each rank reading only its slices (ts.nn.from_pretrained); its config decides the "
                        "model and the BPE vocabulary (--layers, --width, --heads and --vocab are ignored)")
    p.add_argument("--save-pretrained", default=None, metavar="DIR",
                   help="at the end, save the trained model as a Hugging Face checkpoint folder (config.json, "
                        "model.safetensors) that transformers' from_pretrained and --from-pretrained load at any size")
    p.add_argument("--dump-params", default=None,
                   help="rank 0 saves the final unsharded state dict of the model (GPT2LMHeadModel's own) to this file")
    p.add_argument("--verbose-plan", action="store_true", help="print the parallelization plan and its shard shapes")
    p.add_argument("--no-compare", action="store_true", help="skip measuring the unsharded model at the end")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (one line per step on rank 0)")
    p.add_argument("--log-json", default=None,
                   help="rank 0 writes the per-step losses and the held-out losses to this JSON file")
    return p


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    for flag in ("dp", "steps", "batch_size", "seq_len", "layers", "width", "heads", "eval_windows"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be a positive number, got {getattr(args, flag)}")
    if args.tp is not None and args.tp < 1:
        parser.error(f"--tp must be a positive number, got {args.tp}")
    if args.width % args.heads:
        parser.error(f"--width must be a multiple of --heads={args.heads} (GPT-2's head size), got {args.width}")
    if args.vocab < 257:
        parser.error(f"--vocab must be at least 257 (the 256 bytes and the end-of-text token), got {args.vocab}")
    if args.eval_every < 0:
        parser.error(f"--eval-every must be 0 or a positive number of steps, got {args.eval_every}")
    if args.fsdp and args.dp == 1:
        parser.error("--fsdp shards over the data-parallel dimension: use it with --dp 2 or more")
    if args.from_pretrained is not None:
        config = os.path.join(args.from_pretrained, "config.json")
        if not os.path.isfile(config):
            parser.error(f"--from-pretrained {args.from_pretrained}: no config.json there (a save_pretrained folder)")
        import json
        with open(config) as f:
            loaded = json.load(f)
        if loaded.get("model_type") != "gpt2":
            parser.error(f"--from-pretrained {args.from_pretrained}: a {loaded.get('model_type')!r} model; this "
                         f"program trains GPT-2")
        args.vocab, args.layers, args.width, args.heads = (loaded["vocab_size"], loaded["n_layer"], loaded["n_embd"],
                                                           loaded["n_head"])
        if args.seq_len > loaded["n_positions"]:
            parser.error(f"--seq-len {args.seq_len} exceeds the checkpoint's {loaded['n_positions']} positions")
    return args


# ----------------------------------------------------------------------------- model
def make_model(args, vocab):
    """GPT2LMHeadModel from a config: the same weights on every rank (seeded),
    as the unsharded model would draw them."""
    from transformers import GPT2Config, GPT2LMHeadModel
    config = GPT2Config(vocab_size=vocab, n_positions=args.seq_len, n_embd=args.width, n_layer=args.layers,
                        n_head=args.heads, resid_pdrop=args.dropout, embd_pdrop=args.dropout,
                        attn_pdrop=args.dropout, bos_token_id=vocab - 1, eos_token_id=vocab - 1)
    torch.manual_seed(args.seed)
    model = GPT2LMHeadModel(config).to(getattr(torch, args.dtype))
    model.loss_type = "ForCausalLM"  # transformers reads it off the class name, which GPT2LMHeadModel's lacks
    return model


def unsharded_bytes(model):
    """Bytes of the unsharded model's parameters (each once), from the shards' whole shapes."""
    from shardtorch.checkpoint.layout import model_layout
    params = dict(model.named_parameters())
    layout = model_layout(model, {name: p.detach() for name, p in params.items()})
    return sum(math.prod(layout[name].full_shape) * p.element_size() for name, p in params.items())


class CausalLMLoss(nn.Module):
    """The mean next-token loss of a batch (labels are the inputs: the model
    shifts them), as one module's forward, so that DDP and FSDP2 wrap the
    whole step, the fused loss included."""

    def __init__(self, lm, fused):
        super().__init__()
        self.lm, self.fused = lm, fused

    def forward(self, input_ids):
        if self.fused:
            return ts.nn.causal_lm_loss(self.lm, input_ids, input_ids, fused=True)
        return self.lm(input_ids, labels=input_ids).loss


# ----------------------------------------------------------------------------- training
def main(argv=None):
    args = parse_args(argv)
    if "RANK" not in os.environ:
        sys.exit("launch with torchrun, e.g.: torchrun --nproc-per-node 2 examples/python/train_lm.py")
    world = int(os.environ["WORLD_SIZE"])
    tp = args.tp or world // args.dp
    if tp * args.dp != world:
        sys.exit(f"--tp {tp} x --dp {args.dp} must equal the number of processes, {world}")
    ts.distributed.init_process_group(group_size=tp)
    rank = ts.distributed.get_rank()
    ts.utils.memory.track_cpu_memory()
    device = torch.device("cpu")

    # Rank 0 trains the tokenizer and tokenises the corpus once (cached); the others wait for it.
    if rank == 0:
        stdlib_corpus.build(args.vocab, args.cache_dir, args.corpus_bytes)
    dist.barrier()
    _, tokens_path = stdlib_corpus.build(args.vocab, args.cache_dir, args.corpus_bytes, log=lambda _: None)
    data = stdlib_corpus.TokenBatches(stdlib_corpus.load(tokens_path), args.seq_len, args.seed)
    replica, replicas = ts.distributed.get_data_parallel_rank(), ts.distributed.get_data_parallel_size()
    if rank == 0:
        print(f"data: {len(data.train):,} training tokens, {len(data.heldout):,} held-out tokens "
              f"(stdlib sources, BPE vocabulary {args.vocab:,}); tp {tp} x dp {replicas}", flush=True)

    if args.from_pretrained:
        # Each rank reads its slices; no rank ever builds the whole model.
        model = ts.nn.from_pretrained(args.from_pretrained, dtype=getattr(torch, args.dtype), group="tp",
                                      sequence_parallel=args.sequence_parallel, verbose=args.verbose_plan,
                                      logits="sharded")
        model.train()
        model.loss_type = "ForCausalLM"
        unsharded_param_bytes = unsharded_bytes(model)
    else:
        model = make_model(args, args.vocab)
        unsharded_param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        # logits="sharded": training reads only the loss, so the logits are never gathered whole.
        model = ts.nn.parallelize(model, group="tp", sequence_parallel=args.sequence_parallel,
                                  verbose=args.verbose_plan, logits="sharded")
    lm = model  # the parallelized GPT2LMHeadModel
    net = model = CausalLMLoss(lm, args.fused_loss)  # ``model``: what a step calls, DDP's / FSDP2's wrapper
    if args.fsdp:
        model = ts.nn.parallel.fully_shard(net, ts.distributed.device_mesh(device.type), layout="2d")
    elif replicas > 1:
        model = ts.nn.parallel.DistributedDataParallel(net, layout="2d")
    optimizer = torch.optim.AdamW(lm.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    scheduler = make_scheduler(optimizer, args)
    start_step = load_checkpoint(args.resume, {"model": lm}, net, optimizer, None, scheduler,
                                 args.seed) if args.resume else 0

    def train_step(step):
        input_ids = data.batch(step, replica, args.batch_size)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.amp):
            loss = model(input_ids)
        loss.backward()
        optimizer.step()
        scheduler.step()
        return loss.item()

    windows = data.heldout_windows(args.eval_windows)

    @torch.no_grad()
    def heldout_loss():
        """Mean next-token loss over the held-out windows, each replica
        scoring its share (summed over the data-parallel group)."""
        model.eval()
        try:
            total = torch.zeros(2, dtype=torch.float64)
            for i in range(replica * args.batch_size, len(windows), replicas * args.batch_size):
                batch = windows[i:i + args.batch_size]
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.amp):
                    loss = model(batch)
                predicted = batch.shape[0] * (batch.shape[1] - 1)  # the shift: the last token predicts nothing
                total += torch.tensor([loss.item() * predicted, predicted], dtype=torch.float64)
            if replicas > 1:
                dist.all_reduce(total, group=ts.distributed.get_data_parallel_group())
        finally:
            model.train()
        return (total[0] / total[1]).item()

    evaluations, losses = {}, {}

    def evaluate(step):
        evaluations[step] = loss = heldout_loss()
        progress.note(f"eval after step {step}: held-out loss {loss:.4f} perplexity {math.exp(loss):.2f}")

    progress = Progress(rank, args.steps, start_step, enabled=not args.no_progress)
    tokens, train_seconds = 0, 0.0
    with PeakMemory(device) as peak:
        evaluate(start_step)
        for step in range(start_step, args.steps):
            began = time.perf_counter()
            losses[step] = loss = train_step(step)
            train_seconds += time.perf_counter() - began  # tokens/s: training steps only, not evaluation
            tokens += args.batch_size * args.seq_len * replicas
            if step + 1 == args.steps or (args.eval_every and (step + 1) % args.eval_every == 0):
                evaluate(step + 1)
            progress.step(f"step {step + 1}/{args.steps} loss {loss:.4f} tokens/s {tokens / train_seconds:.0f}",
                          loss=f"{loss:.3f}", tokens_s=f"{tokens / train_seconds:.0f}")
            if args.save and args.save_every and (step + 1) % args.save_every == 0:
                save_checkpoint(args.save, step + 1, {"model": lm}, net, optimizer, None, scheduler)
    progress.close()
    if rank == 0 and losses:
        first, last = min(losses), max(losses)
        before, after = math.exp(evaluations[min(evaluations)]), math.exp(evaluations[max(evaluations)])
        print(f"trained steps {first + 1}-{last + 1}: loss {losses[first]:.3f} -> {losses[last]:.3f}; held-out "
              f"perplexity {before:.2f} -> {after:.2f}; {tokens / train_seconds:.0f} tokens/s (training steps only)",
              flush=True)
    if args.save:
        save_checkpoint(args.save, args.steps, {"model": lm}, net, optimizer, None, scheduler)
    if args.save_pretrained:
        lm.save_pretrained(args.save_pretrained)  # every rank: rank 0 writes the unsharded checkpoint
        if rank == 0:
            print(f"saved the model to {args.save_pretrained} (transformers' from_pretrained loads it)", flush=True)
    if args.dump_params:
        full = ts.collect_state_dict(lm, lm.state_dict(), dst=0)
        if rank == 0:
            torch.save(full, args.dump_params)
        del full
    if rank == 0 and args.log_json:
        import json
        with open(args.log_json, "w") as f:
            json.dump({"train": {str(k): v for k, v in losses.items()},
                       "heldout": {str(k): v for k, v in evaluations.items()}}, f)
    unsharded_peak = None if args.no_compare else measure_unsharded_step(args, data, replica)
    print_in_rank_order(memory_report(lm.parameters(), optimizer, unsharded_param_bytes, peak.peak_bytes,
                                      unsharded_peak))
    ts.distributed.destroy_process_group()


def measure_unsharded_step(args, data, replica):
    """Peak memory of training the plain model on this rank's batch, measured
    the same way (two steps: the second holds AdamW's moments, as training
    does): what each rank would need without tensor parallelism."""
    model = make_model(args, args.vocab)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    input_ids = data.batch(0, replica, args.batch_size)
    with PeakMemory("cpu") as peak:
        for _ in range(2):
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.amp):
                loss = model(input_ids, labels=input_ids).loss
            loss.backward()
            optimizer.step()
    return peak.peak_bytes


if __name__ == "__main__":
    main()
