"""All-reduce bus bandwidth across the job's ranks: run before a multi-day job to see which link carries
the traffic (`./launch.sh --check` runs this under the same torchrun as training).

Two groups, as in training: the default one (NCCL on GPUs: the step's collectives) and a gloo group of
CPU tensors over TCP (out_dir.make_group: every save and resume agrees through it). gloo picks its
interface from the hostname, which resolves to 127.0.1.1 on many nodes: a check that hangs or fails
here, and not in the NCCL part, needs GLOO_SOCKET_IFNAME (see launch.sh).

Bus bandwidth = bytes x 2 (W - 1) / W / time, the NCCL-tests convention: what each rank's link carries
in a ring all-reduce, comparable across world sizes. On 2 x 8 H100 with 8 x 400 Gb/s InfiniBand per node
expect tens of GB/s at the larger sizes; single-digit GB/s between nodes means TCP is carrying the
traffic (run again with NCCL_DEBUG=INFO and look for NET/IB rather than NET/Socket). gloo is TCP: about
what one socket between two nodes carries is expected. On a GPU the planner knows, the largest all-reduce under
half the plan's bus bandwidth (agree.FABRIC_LEAST_FRACTION, the trainer's start-up warning) fails the check (exit 1).
"""
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train as T  # noqa: E402  (only its config's defaults)
from components import agree  # noqa: E402
from tools import plan as P  # noqa: E402


def check_all_reduce(group, device: torch.device, sizes_mb: list[int], rank: int, world: int) -> float:
    """Times all-reduces of each size in `group` and checks that the sum is right on every rank. Returns the bus
    bandwidth of the largest, GB/s."""
    for size_mb in sizes_mb:
        x = torch.ones(size_mb * 2**20 // 4, dtype=torch.float32, device=device)
        for _ in range(2):  # warm-up: connections, buffers
            dist.all_reduce(x, group=group)
        iters = 5
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier(group=group)
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(x, group=group)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = (time.perf_counter() - t0) / iters
        busbw = x.numel() * 4 * 2 * (world - 1) / world / seconds / 1e9
        if rank == 0:
            print(f"{size_mb:6d} MiB  {seconds * 1e3:9.2f} ms  bus bandwidth {busbw:8.2f} GB/s", flush=True)
    ok = torch.tensor([float(rank + 1)], device=device)
    dist.all_reduce(ok, group=group)
    assert ok.item() == world * (world + 1) / 2, f"all-reduce gave a wrong sum: {ok.item()}"
    return busbw


def fabric_problem(busbw: float, device: torch.device, world: int, per_node: int) -> str | None:
    """The training group's bus bandwidth against the plan's for this GPU and layout (--nics_per_node and --nic_gbps
    at their defaults for the GPU), under agree.FABRIC_LEAST_FRACTION of it: the start-up warning's line."""
    if device.type != "cuda":
        return None
    run = P.as_launched(T.TrainConfig(), world, per_node, torch.cuda.get_device_name(device))
    planned = run and P.bus_gbps(P.GPUS[run.gpu], run)
    return agree.fabric_warning(busbw, planned, "the largest all-reduce")


def main():
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if rank == 0:
        print(f"all-reduce over {world} ranks ({'nccl' if use_cuda else 'gloo'}, {per_node} per node)", flush=True)
    device = torch.device("cuda") if use_cuda else torch.device("cpu")
    busbw = check_all_reduce(None, device, [1, 16, 256, 1024] if use_cuda else [1, 16], rank, world)
    slowest = torch.tensor([busbw], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MIN)  # every rank takes the same verdict
    problem = fabric_problem(slowest.item(), device, world, per_node)
    if problem:  # every rank measured the same collectives: every rank stops here
        print(f"error: {problem}", file=sys.stderr, flush=True)
        dist.destroy_process_group()
        os._exit(1)
    # A second group, as the checkpoint group is made: gloo, CPU tensors, over its own TCP connections.
    checkpoint_group = dist.new_group(backend="gloo")
    if rank == 0:
        print(f"all-reduce over {world} ranks in the checkpoint group (gloo, CPU, "
              f"GLOO_SOCKET_IFNAME={os.environ.get('GLOO_SOCKET_IFNAME', 'unset: the hostname')})", flush=True)
    check_all_reduce(checkpoint_group, torch.device("cpu"), [1, 16], rank, world)
    if rank == 0:
        print("all-reduce results correct on every rank, in both groups", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    os._exit(0)  # as train.py: no interpreter teardown after destroy_process_group
