"""All-reduce bus bandwidth across the job's ranks: run before a multi-day job to see which link carries
the traffic (`./launch.sh --check` runs this under the same torchrun as training).

Two groups, as in training: the default one (NCCL on GPUs: the step's collectives) and a gloo group of
CPU tensors over TCP (checkpoint.make_group: every save and resume agrees through it). gloo picks its
interface from the hostname, which resolves to 127.0.1.1 on many nodes: a check that hangs or fails
here, and not in the NCCL part, needs GLOO_SOCKET_IFNAME (see launch.sh).

Bus bandwidth = bytes x 2 (W - 1) / W / time, the NCCL-tests convention: what each rank's link carries
in a ring all-reduce, comparable across world sizes. On 2 x 8 H100 with 8 x 400 Gb/s InfiniBand per node
expect tens of GB/s at the larger sizes; single-digit GB/s between nodes means TCP is carrying the
traffic (run again with NCCL_DEBUG=INFO and look for NET/IB rather than NET/Socket). gloo is TCP: about
what one socket between two nodes carries is expected.
"""
import os
import time

import torch
import torch.distributed as dist


def check_all_reduce(group, device: torch.device, sizes_mb: list[int], rank: int, world: int):
    """Times all-reduces of each size in `group` and checks that the sum is right on every rank."""
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


def main():
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if rank == 0:
        print(f"all-reduce over {world} ranks ({'nccl' if use_cuda else 'gloo'}, {per_node} per node)", flush=True)
    check_all_reduce(None, torch.device("cuda") if use_cuda else torch.device("cpu"),
                     [1, 16, 256, 1024] if use_cuda else [1, 16], rank, world)
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
