"""Cases that bring torch.distributed up and down themselves (launch with
init=False): the harness must not start a case on one rank while another
still serves the last case's store. Rank 0 here keeps that store up for a
while after its case's teardown, as a slow teardown would; a rank that went
on at once would join that old store and the next rendezvous would hang
(what failed in CI before the worker waited for every rank between cases)."""
import os
import time

import torch
import torch.distributed as dist

import shardtorch as ts


def case_a_teardown_keeps_the_store_a_while_on_rank_0():
    ts.distributed.init_process_group(group_size=int(os.environ["WORLD_SIZE"]))
    store = dist.distributed_c10d._get_default_store()
    ts.distributed.destroy_process_group()
    if os.environ["RANK"] == "0":
        time.sleep(3)
    del store


def case_b_a_new_rendezvous_on_the_same_port():
    world = int(os.environ["WORLD_SIZE"])
    ts.distributed.init_process_group(group_size=world)
    try:
        total = torch.ones(1)
        dist.all_reduce(total)
        assert total.item() == world
    finally:
        ts.distributed.destroy_process_group()
