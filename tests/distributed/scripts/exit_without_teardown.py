"""A short job that ends without destroy_process_group, as most scripts do: the exit code its
launcher sees must be the script's own, never SIGABRT (tests/distributed/test_clean_exit.py).

It uses shardtorch's groups and ops (the shared-memory collectives for the small ones) and ends
on a plain torch.distributed all-reduce (Gloo's worker threads) and a print, the ending that
made one rank of a torchrun job abort at exit most often before shardtorch waited for those
threads (shardtorch/distributed/clean_exit.py).

Arguments: mode ("ok": exit 0; "raise": the last rank raises after its collectives, exit 1;
"exit": rank 0 calls sys.exit(3)), the tensor-parallel group size, and "spawn" to start the
ranks with torch.multiprocessing.spawn from this process (WORLD_SIZE and MASTER_PORT from the
environment)."""
import os
import sys

import torch
import torch.distributed as dist

import shardtorch as ts


def job(rank: int, world: int, group_size: int, mode: str) -> None:
    torch.manual_seed(0)
    ts.distributed.init_process_group(group_size=group_size)
    layer = ts.nn.ParallelLinear(16, 40, dim=1).double()
    logits = layer(torch.randn(4, 16, dtype=torch.float64))
    loss = ts.nn.ParallelCrossEntropyLoss()(logits, torch.randint(40, (4,)))
    loss.backward()
    total = torch.ones(8)
    dist.all_reduce(total)
    if mode == "raise" and rank == world - 1:
        raise RuntimeError("exit_without_teardown: this rank fails on purpose")
    if mode == "exit" and rank == 0:
        sys.exit(3)
    # One write per rank (print's pieces interleave between ranks): what the test counts.
    os.write(1, f"rank {rank} done: loss {loss.item():.6f}, all-reduced {total[0].item():.0f}\n".encode())


def spawned(local_rank: int, world: int, group_size: int, port: str, mode: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(local_rank),
                      LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    job(local_rank, world, group_size, mode)


if __name__ == "__main__":
    mode, group_size = sys.argv[1], int(sys.argv[2])
    if len(sys.argv) > 3 and sys.argv[3] == "spawn":
        world = int(os.environ["WORLD_SIZE"])
        torch.multiprocessing.spawn(spawned, args=(world, group_size, os.environ["MASTER_PORT"], mode),
                                    nprocs=world)
    else:
        job(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), group_size, mode)
